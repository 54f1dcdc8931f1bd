"""What a worker's outcome write tells a fair queue's fold: whether the job has a fair key
(none: the write skips the fold) and the seconds its handler ran (what its key is
charged, without the claim before it or the write after it)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from errands.jobs import JobRow
from errands.worker.execution import Attempt, outcome_for

ROW = JobRow(
    id=1, name="t.job", queue="reports", args="{}", meta="{}", state="running", priority=0,
    attempt=1, max_attempts=3, run_at=0.0, idempotency_key=None, errors="[]", result=None,
    inserted_at=0.0, attempted_at=0.0, finished_at=None, lease_owner="w", lease_token="t",
    lease_expires_at=30.0, rescues=0, cancel_requested=0, timeout=None, lease_seconds=None,
    discarded_by=None, discard_reason=None,
)  # fmt: skip


def _attempt(fair_key: str | None, started: float, ended: float) -> Attempt:
    attempt = Attempt(replace(ROW, fair_key=fair_key), None, 30.0, started=started)
    attempt.ended = ended
    return attempt


@pytest.mark.parametrize("error", [None, RuntimeError("boom")])
def test_an_outcome_carries_its_handlers_seconds_and_whether_the_job_has_a_fair_key(
    error: BaseException | None,
) -> None:
    fair = outcome_for(_attempt("tenant:7", 100.0, 100.25), error, "1", "w")
    assert (fair.fair, fair.ran) == (True, pytest.approx(0.25))
    plain = outcome_for(_attempt(None, 100.0, 102.0), error, "1", "w")
    assert (plain.fair, plain.ran) == (False, pytest.approx(2.0))


def test_the_handlers_own_call_is_charged_when_the_worker_timed_it() -> None:
    """The dispatcher times the handler's call itself (``Attempt.ran``): the arguments'
    decoding before it and the result's encoding after it are not the tenant's work."""
    attempt = _attempt("tenant:7", 100.0, 101.0)
    attempt.ran = 0.4
    assert outcome_for(attempt, None, "1", "w").ran == pytest.approx(0.4)
