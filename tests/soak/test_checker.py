"""The soak's checker catches what it is there to catch: each check on rows made up to
break it (a checker that never fails proves nothing), and accepts what the store may
legitimately record (a release, a rescue, a signal timeout)."""

from __future__ import annotations

from typing import Any

from . import shapes
from .chaos import Episode
from .checker import _executions, _outcomes
from .records import Findings, JobInfo, Run
from .workload import Ledger


def job(job_id: int, name: str, state: str, attempt: int, errors: list[dict[str, Any]],
        result: Any = None) -> JobInfo:  # fmt: skip
    return JobInfo(job_id, name, state, attempt, 25, errors, result, None, {}, 0.0, None, 0)


def run(job_id: int, attempt: int, token: str, kind: str = "run", at: float = 0.0,
        detail: str | None = None) -> Run:  # fmt: skip
    return Run(job_id, attempt, token, kind, "w-1", at, 0.0, 0.0, detail, "soak.fast")


def entry(attempt: int, kind: str, token: str | None) -> dict[str, Any]:
    return {"attempt": attempt, "kind": kind, "lease_token": token, "type": kind}


def executions(jobs: list[JobInfo], runs: list[Run]) -> Findings:
    out = Findings()
    by_job: dict[int, list[Run]] = {}
    for r in runs:
        by_job.setdefault(r.job_id, []).append(r)
    _executions(out, {j.id: j for j in jobs}, by_job)
    return out


def test_a_released_attempt_that_runs_again_is_explained() -> None:
    released = job(1, "soak.fast", "completed", 1, [entry(1, "released", "t1")],
                   {"attempt": 1, "token": "t2"})  # fmt: skip
    out = executions([released], [run(1, 1, "t1"), run(1, 1, "t2")])
    assert out.violations == []
    assert out.figures["duplicate executions"] == 1
    assert out.figures["duplicates explained by lease losses"] == 1


def test_an_attempt_number_run_twice_without_a_release_is_a_violation() -> None:
    twice = job(1, "soak.fast", "completed", 1, [entry(1, "transient", "t1")],
                {"attempt": 1, "token": "t2"})  # fmt: skip
    out = executions([twice], [run(1, 1, "t1"), run(1, 1, "t2")])
    assert any("ran one attempt number twice" in v for v in out.violations), out.violations


def test_a_run_nothing_recorded_an_end_for_is_unexplained() -> None:
    silent = job(1, "soak.fast", "completed", 2, [], {"attempt": 2, "token": "t2"})
    out = executions([silent], [run(1, 1, "t1"), run(1, 2, "t2")])
    assert any("explained by no failure" in v for v in out.violations), out.violations


def test_an_attempt_charged_without_a_run_or_a_recorded_loss_is_a_violation() -> None:
    charged = job(1, "soak.fast", "completed", 2, [], {"attempt": 2, "token": "t2"})
    out = executions([charged], [run(1, 2, "t2")])
    assert any("without a run or a recorded loss" in v for v in out.violations)


def test_a_signal_timeout_or_a_rescue_explains_a_charged_attempt_without_a_run() -> None:
    waits = [entry(1, "signal_timeout", None), entry(2, "signal_timeout", None)]
    timed_out = job(1, "soak.signal_never", "dead", 2, waits)
    rescued = job(2, "soak.fast", "completed", 2, [entry(1, "worker_lost", "t1")],
                  {"attempt": 2, "token": "t2"})  # fmt: skip
    out = executions([timed_out, rescued], [run(2, 2, "t2")])
    assert out.violations == []


def test_a_return_after_a_stop_request_recorded_completed_is_a_violation() -> None:
    out = Findings()
    cut = job(1, "soak.slow_return", "completed", 1, [], {"attempt": 1, "cut_short": True})
    shapes._cut_short(out, {1: cut})
    assert any(v.startswith("A3") for v in out.violations), out.violations


def test_overlapping_runs_of_one_account_are_a_violation_unless_a_loss_ended_one() -> None:
    first = job(1, "soak.keyed_a", "completed", 1, [], {"attempt": 1, "token": "a"})
    second = job(2, "soak.keyed_b", "completed", 1, [], {"attempt": 1, "token": "b"})
    rows = {
        1: [run(1, 1, "a", at=10.0, detail="acct:1"), run(1, 1, "a", "end", 10.5, "acct:1")],
        2: [run(2, 1, "b", at=10.2, detail="acct:1"), run(2, 1, "b", "end", 10.3, "acct:1")],
    }
    out = Findings()
    shapes._keys(out, {1: first, 2: second}, rows)
    assert any(v.startswith("A5") for v in out.violations), out.violations
    first.errors = [entry(1, "worker_lost", "a")]  # the first was rescued: not a breach
    out = Findings()
    shapes._keys(out, {1: first, 2: second}, rows)
    assert out.violations == []


def test_an_idempotency_key_that_changes_or_is_shared_is_a_violation() -> None:
    a = job(1, "soak.uniq_retry", "completed", 2, [])
    b = job(2, "soak.uniq_retry", "completed", 2, [])
    rows = {
        1: [run(1, 1, "a1", detail="soak.uniq_retry:k"), run(1, 2, "a2", detail="x:1")],
        2: [run(2, 1, "b1", detail="soak.uniq_retry:k")],
    }
    out = Findings()
    shapes._idempotency_keys(out, {1: a, 2: b}, rows, Ledger())
    assert sum(v.startswith("A6") for v in out.violations) == 2, out.violations


def test_a_signal_waiter_that_database_restarts_used_up_ends_dead_as_expected() -> None:
    """Its wait's own store reads failing while the database restarts are transient
    failures (retried): with 2 attempts two restarts can end it; any other error cannot."""
    away = {**entry(2, "transient", None), "type": "AdminShutdown"}
    broken = {**entry(2, "transient", None), "type": "ValueError"}
    ledger = Ledger(jobs={1: "signal_never", 2: "signal_never"})
    jobs = {1: job(1, "soak.signal_never", "dead", 2, [away]),
            2: job(2, "soak.signal_never", "dead", 2, [broken])}  # fmt: skip
    out = Findings()
    _outcomes(out, jobs, ledger, {})
    assert out.figures["unexpected outcomes"] == 1
    assert any("(2, 'signal_never'" in v for v in out.violations), out.violations


def test_a_late_rescued_claim_is_told_apart_by_whether_a_fresher_job_went_ahead_of_it() -> None:
    """Diagnosis of I9's rescued-job waits: a fresher job of no higher priority claimed
    while the rescued one waited means a claim round passed it over; jobs due before it
    (a full cluster draining its backlog in order) do not."""
    from .checker import _passed_over, _passers

    jobs = {i: job(i, "soak.fast", "completed", 1, []) for i in (1, 2, 3)}

    def claimed(job_id: int, due: float, at: float, attempt: int = 1) -> Run:
        return Run(job_id, attempt, f"t{job_id}", "run", "w-1", at, due, at, None, "soak.fast")

    late = [(1, 2, 6.0)]  # job 1's second attempt: due at 10, claimed at 16
    rescued_before = {1: [1]}
    older = [claimed(1, 10.0, 16.0, attempt=2), claimed(2, 5.0, 12.0)]  # job 2 due before it
    assert _passed_over(late, jobs, older, rescued_before) == "0 of 1"
    fresher = [*older, claimed(3, 11.0, 13.0)]  # job 3 due after it, claimed ahead of it
    assert _passed_over(late, jobs, fresher, rescued_before) == "1 of 1"
    who = _passers(late, jobs, fresher, rescued_before, [], 2.0)
    assert who["claims of fresher same-queue jobs by worker"] == {"w-1": 1}
    jobs[3].queue = "other"  # a fresher job of another queue had no claim on it
    # The faults in play while it waited, relative to its due time: the kill that lost
    # its lease (3 s before) and a restart of the database during the wait; a fault
    # healed long before, or begun after its claim, is not shown.
    episodes = [
        Episode("sigkill", 7.0, healed=7.1, victim="w-9"),
        Episode("pg_restart", 12.0, healed=14.5),
        Episode("sigstop", 1.0, healed=2.0, victim="w-8"),
        Episode("conn_kill", 16.5, healed=17.0),
    ]
    assert _passers(late, jobs, fresher, rescued_before, episodes, 2.0)["late"] == [
        "1/2 fast@ 6.0s by w-1; ahead -; faults sigkill(w-9)@-3.0..-2.9, pg_restart@+2.0..+4.5"
    ]


def test_a_dead_job_whose_on_dead_hooks_never_ran_is_a_violation() -> None:
    """Hooks run at least once per death (the leader takes over a killed worker's): a
    dead job with no hook row fails A7; one run twice is reported, not failed."""
    jobs = {1: job(1, "soak.doomed", "dead", 1, []), 2: job(2, "soak.hooked", "dead", 1, []),
            3: job(3, "soak.doomed", "dead", 1, [])}  # fmt: skip
    rows = {1: [run(1, 1, None, kind="hook")],
            2: [run(2, 1, None, kind="hook"), run(2, 1, None, kind="hook")]}  # fmt: skip
    out = Findings()
    shapes._hooks(out, jobs, rows)
    assert [v for v in out.violations if v.startswith("A7")] == [
        "A7: 1 dead job(s) whose on_dead hooks never ran e.g. [3]"
    ], out.violations
    assert out.figures["on_dead hooks run more than once for a job"] == 1


def test_a_graceful_stop_ended_by_an_armed_fault_point_is_a_crash_not_a_failed_stop() -> None:
    """A worker asked to stop finishes its jobs; an armed fault point (F2) may fire in one
    of them and end it with exit 86. That is the soak's own crash, counted with the
    crashes; any other exit but 0 still fails F4."""
    from types import SimpleNamespace

    from .chaos import _fault_point_fired

    log = "worker w-1 stopping\nerrands fault point after_complete_commit: crashing (exit 86)\n"
    assert _fault_point_fired(log) == "after_complete_commit"
    assert _fault_point_fired("worker w-1 stopped after 3 job(s)\n") is None
    chaos: Any = SimpleNamespace(stop_exits=[0], stops_crashed=["after_complete_commit"],
                                 released_targets=[])  # fmt: skip
    out = Findings()
    shapes._releases(out, {}, chaos)
    assert out.violations == []
    assert out.figures["graceful stops cut short by an armed fault point (F2 crash)"] == {
        "after_complete_commit": 1
    }
    chaos.stop_exits.append(86)
    shapes._releases(out, {}, chaos)
    assert out.violations == ["F4: 1 worker(s) did not exit 0 on a graceful stop mid-run e.g. [86]"]
