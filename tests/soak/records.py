"""What the checker reads after a soak run: the job rows, the ``soak_effects`` rows, and
where it writes its verdict (:class:`Findings`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .store import Store, as_json

TERMINAL = ("completed", "dead", "cancelled", "discarded")
# error kinds that record a run ended by something else than its handler (checker.py)
LOSS_KINDS = ("worker_lost", "poison", "lease_lost", "released", "crash")


@dataclass
class JobInfo:
    id: int
    name: str
    state: str
    attempt: int
    max_attempts: int
    errors: list[dict[str, Any]]
    result: Any
    key: str | None
    args: dict[str, Any]
    inserted_at: float
    attempted_at: float | None
    priority: int
    progress: float | None = None
    queue: str = ""


@dataclass
class Run:
    job_id: int
    attempt: int
    token: str | None
    kind: str
    worker: str
    at: float
    run_at: float | None
    claimed_at: float | None
    detail: str | None
    name: str = ""  # the job type


@dataclass
class Findings:
    figures: dict[str, Any] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)  # known issues: reported, not failed

    def fail(self, invariant: str, message: str, examples: list[Any] | None = None) -> None:
        shown = f" e.g. {examples[:8]}" if examples else ""
        self.violations.append(f"{invariant}: {message}{shown}")


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))
    return ordered[index]


def load_jobs(store: Store) -> dict[int, JobInfo]:
    e = store.epoch
    rows = store.query(
        f"SELECT id, name, state, attempt, max_attempts, errors, result, idempotency_key, "
        f"args, {e('inserted_at')}, {e('attempted_at')}, priority, progress, queue "
        f"FROM {{s}}errands_jobs"
    )
    return {
        r[0]: JobInfo(r[0], r[1], r[2], r[3], r[4], as_json(r[5]) or [],
                      as_json(r[6]) if r[6] is not None else None, r[7],
                      as_json(r[8]) or {}, r[9], r[10], r[11], r[12], r[13])
        for r in rows
    }  # fmt: skip


def load_effects(store: Store) -> list[Run]:
    rows = store.query(
        "SELECT job_id, attempt, token, kind, worker, at, run_at, claimed_at, detail, name "
        "FROM {s}soak_effects ORDER BY id"
    )
    return [Run(*r) for r in rows]


def brief(errors: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(e.get("attempt"), e.get("type"), e.get("kind")) for e in errors]
