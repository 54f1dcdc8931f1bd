"""Which due jobs a limited claim may take: shared by every backend.

A queue is *limited* when it has a cluster-wide concurrency limit, a rate limit, or job
types with per-key concurrency or rate limits. Its claims run one at a time (SQLite's
write lock; a PostgreSQL advisory lock per queue), so the counts read here cannot race:
running jobs per queue and per key, and starts inside each rate window.

The backend reads the candidates (due jobs in claim order, a bounded look-ahead) and the
counts; :func:`choose` picks the ids to claim. Jobs skipped for a busy key or an
exhausted rate stay pending and burn no attempt.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

from ..errors import ConfigurationError

LOOKAHEAD_FACTOR = 10
LOOKAHEAD_MIN = 100
RATE_PERIOD_MAX = 86_400.0
_RATE = re.compile(r"^\s*(\d+)\s*/\s*(\d*\.?\d*)\s*(s|sec|m|min|h|hour|d|day)\s*$")
_UNITS = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hour": 3600, "d": 86400, "day": 86400}


def parse_rate(value: str) -> tuple[int, float]:
    """``"100/m"`` -> (100, 60.0); ``"20/s"``, ``"5/h"``, ``"1000/d"``, ``"10/30s"``."""
    match = _RATE.match(value) if isinstance(value, str) else None
    if not match:
        raise ConfigurationError(
            f"rate={value!r}: write COUNT/PERIOD, as in '20/s', '100/m', '5/h', '1000/d' "
            "or '10/30s'"
        )
    count, multiple, unit = int(match[1]), match[2], match[3]
    period = (float(multiple) if multiple else 1.0) * _UNITS[unit]
    if count < 1 or not 0 < period <= RATE_PERIOD_MAX:
        raise ConfigurationError(
            f"rate={value!r}: the count must be at least 1 and the period at most one day"
        )
    return count, period


def format_rate(limit: int | None, period: float | None) -> str:
    if not limit or not period:
        return "-"
    for unit, seconds in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if period == seconds:
            return f"{limit}/{unit}"
    return f"{limit}/{period:g}s"


@dataclass(frozen=True)
class Candidate:
    id: int
    name: str
    concurrency_key: str | None
    concurrency_limit: int | None


def lookahead(room: int) -> int:
    return max(room * LOOKAHEAD_FACTOR, LOOKAHEAD_MIN)


def choose(
    candidates: list[Candidate],
    room: int,
    running_per_key: dict[str, int],
    room_per_name: dict[str, int],
) -> list[Candidate]:
    """The candidates to claim, in order, within the queue's room, each key's limit and
    each rate-limited job type's remaining starts."""
    chosen: list[Candidate] = []
    keys = dict(running_per_key)
    names = dict(room_per_name)
    for candidate in candidates:
        if len(chosen) >= room:
            break
        key = candidate.concurrency_key
        if key is not None and keys.get(key, 0) >= (candidate.concurrency_limit or 1):
            continue
        if candidate.name in names and names[candidate.name] <= 0:
            continue
        chosen.append(candidate)
        if key is not None:
            keys[key] = keys.get(key, 0) + 1
        if candidate.name in names:
            names[candidate.name] -= 1
    return chosen


@dataclass(frozen=True)
class QueueLimits:
    paused: bool
    max_running: int | None
    rate_limit: int | None
    rate_period: float | None


class LimitedClaimStore(Protocol):
    """What :func:`claim_limited` needs from a backend, inside one serialised transaction."""

    def rows(self, query: str, params: dict[str, object]) -> list[tuple[object, ...]]: ...

    def id_list(self, values: list[object]) -> object: ...


class Claimed(list):  # type: ignore[type-arg]
    """Rows a limited claim took; ``retry_in``: seconds until a rate window has room again
    (None when no rate limit held the claim back), so the worker wakes then, not later."""

    retry_in: float | None = None


def claim_limited(
    store: LimitedClaimStore,
    queue: str,
    cap: int,
    claim_params: dict[str, object],
    *,
    suspects: bool = False,
) -> Claimed:
    """Claim up to ``cap`` jobs of a limited queue; returns the claimed rows (JobRow order).

    Call inside the transaction that serialises this queue's limited claims.
    """
    result = Claimed()
    settings = store.rows("queue_settings_get", {"name": queue})
    if settings:
        _, paused, max_running, rate_limit, rate_period = settings[0][:5]
    else:
        paused, max_running, rate_limit, rate_period = False, None, None, None
    if paused:
        return result
    room = cap
    if max_running is not None:
        running = int(store.rows("queue_running_count", {"queue": queue})[0][0])  # type: ignore[call-overload]
        room = min(room, int(max_running) - running)  # type: ignore[call-overload]
    if rate_limit is not None and rate_period:
        used, frees_in = _rate_used(store, f"queue:{queue}", float(rate_period))  # type: ignore[arg-type]
        left = int(rate_limit) - used  # type: ignore[call-overload]
        if left <= room:
            result.retry_in = _sooner(result.retry_in, frees_in)
        room = min(room, left)
    if room <= 0:
        return result
    room_per_name: dict[str, int] = {}
    for name, limit, period in store.rows("job_limits_for_queue", {"queue": queue}):
        used, frees_in = _rate_used(store, f"job:{name}", float(period))  # type: ignore[arg-type]
        room_per_name[str(name)] = int(limit) - used  # type: ignore[call-overload]
        if room_per_name[str(name)] <= 0:
            result.retry_in = _sooner(result.retry_in, frees_in)
    blocked: list[object] = [name for name, left in room_per_name.items() if left <= 0]
    candidates = [
        Candidate(int(r[0]), str(r[1]), r[2], r[3])  # type: ignore[call-overload,arg-type]
        for r in store.rows(
            "claim_candidates_suspect" if suspects else "claim_candidates",
            {"queue": queue, "limit": lookahead(room), "blocked": store.id_list(blocked)},
        )
    ]
    if not candidates:
        return result
    keys = sorted({c.concurrency_key for c in candidates if c.concurrency_key is not None})
    running_per_key: dict[str, int] = {}
    if keys:
        for key, count in store.rows("running_per_key", {"keys": store.id_list(list(keys))}):
            running_per_key[str(key)] = int(count)  # type: ignore[call-overload]
    chosen = choose(candidates, room, running_per_key, room_per_name)
    if not chosen:
        return result
    claimed = store.rows(
        "job_claim_ids", {**claim_params, "ids": store.id_list([c.id for c in chosen])}
    )
    if rate_limit is not None:
        _log_starts(store, f"queue:{queue}", len(claimed))
    started: dict[str, int] = {}
    for row in claimed:
        if str(row[1]) in room_per_name:
            started[str(row[1])] = started.get(str(row[1]), 0) + 1
    for name, n in started.items():
        _log_starts(store, f"job:{name}", n)
    result.extend(claimed)
    return result


def _sooner(current: float | None, candidate: float | None) -> float | None:
    if candidate is None:
        return current
    candidate = max(candidate, 0.001)
    return candidate if current is None else min(current, candidate)


def _rate_used(store: LimitedClaimStore, bucket: str, period: float) -> tuple[int, float | None]:
    used, frees_in = store.rows("rate_count", {"bucket": bucket, "period": period})[0]
    return int(used), None if frees_in is None else float(frees_in)  # type: ignore[call-overload,arg-type]


def _log_starts(store: LimitedClaimStore, bucket: str, n: int) -> None:
    if n > 0:
        store.rows("rate_log_insert", {"bucket": bucket, "n": n})
