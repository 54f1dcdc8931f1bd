"""The fair queue's soak checks catch what they are there to catch: a quiet tenant's job
overtaken by a noisy burst due before it (FIFO's behaviour), and a claim folded into its
key's usage a wrong number of times; and they accept a fair run."""

from __future__ import annotations

from typing import Any

from .records import Findings, JobInfo, Run
from .tenants import SLOTS, _folds, _starvation

BOUND = SLOTS * 2  # 6 keys over 24 slots: ceil(6 / 24) + 1 = 2 rounds


def run(job_id: int, tenant: str, due: float, claimed: float) -> Run:
    return Run(job_id, 1, f"t{job_id}", "run", "w-1", claimed, due, claimed,
               f"tenant:{tenant}", "soak.tenant")  # fmt: skip


def burst_then_quiet(quiet_claimed: float) -> list[Run]:
    """150 noisy jobs due at 0, claimed one per 0.01 s from 1.0; a quiet job due at 0.5."""
    noisy = [run(i, "noisy", 0.0, 1.0 + i * 0.01) for i in range(150)]
    return [*noisy, run(1000, "quiet0", 0.5, quiet_claimed)]


def test_a_quiet_job_claimed_behind_the_whole_noisy_burst_breaks_the_starvation_bound() -> None:
    out = Findings()
    _starvation(out, burst_then_quiet(quiet_claimed=2.6), enforce=True)  # FIFO: after all 150
    assert any(v.startswith("fair starvation") for v in out.violations), out.violations


def test_a_quiet_job_claimed_within_the_bound_passes_and_is_only_reported_at_ci_size() -> None:
    out = Findings()
    _starvation(out, burst_then_quiet(quiet_claimed=1.2), enforce=True)  # after 20 of them
    assert out.violations == []
    late = Findings()
    _starvation(late, burst_then_quiet(quiet_claimed=2.6), enforce=False)
    assert late.violations == [] and any("fair starvation" in o for o in late.observations)


class FakeStore:
    def __init__(self, usage: dict[str, int]) -> None:
        self.usage = usage

    def query(self, text: str, params: Any = ()) -> list[tuple[Any, ...]]:
        assert "errands_fair_usage" in text
        return list(self.usage.items())


def tenant_job(job_id: int, tenant: str, attempt: int, errors: list[dict[str, Any]],
               state: str = "completed") -> JobInfo:  # fmt: skip
    return JobInfo(job_id, "soak.tenant", state, attempt, 25, errors, None, None,
                   {"tenant": tenant}, 0.0, None, 0)  # fmt: skip


def test_every_claim_folded_once_passes_and_a_release_counts_as_a_claim() -> None:
    jobs = {
        1: tenant_job(1, "noisy", 2, [{"kind": "worker_lost"}]),
        2: tenant_job(2, "noisy", 1, [{"kind": "released"}]),  # claimed twice, charged once
        3: tenant_job(3, "quiet0", 1, []),
    }
    out = Findings()
    _folds(out, FakeStore({"tenant:noisy": 4, "tenant:quiet0": 1}), jobs)  # type: ignore[arg-type]
    assert out.violations == []


def test_a_claim_folded_twice_or_never_or_a_job_left_running_is_a_leak() -> None:
    jobs = {
        1: tenant_job(1, "noisy", 1, []),
        2: tenant_job(2, "quiet0", 1, []),
        3: tenant_job(3, "quiet1", 1, [], state="running"),
    }
    out = Findings()
    _folds(out, FakeStore({"tenant:noisy": 2, "tenant:quiet1": 1}), jobs)  # type: ignore[arg-type]
    assert any("folded another number" in v and "tenant:quiet0" in v for v in out.violations)
    assert any("tenant:noisy" in v for v in out.violations)
    assert any("running or due after the drain" in v for v in out.violations)
