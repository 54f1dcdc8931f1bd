"""Finishing, heartbeats and releases: every write is fenced by the lease token."""

from __future__ import annotations

import json

import pytest

from errands.backends import Backend
from errands.backends.base import FinishParams, LeaseRef, RescueParams
from errands.jobs import JobRow

from .conftest import Harness
from .support import claim, claim_one, error, errors_of, finish, get, insert


def _reclaimed(backend: Backend, harness: Harness) -> tuple[JobRow, JobRow]:
    """A job whose first lease expired and was rescued, then claimed again.

    Returns (stale first claim, current second claim).
    """
    job_id = insert(backend)
    stale = claim_one(backend, worker_id="paused-worker")
    harness.expire_lease(backend, job_id)
    rescued = backend.job_rescue_many(
        [
            RescueParams(
                id=job_id,
                lease_token=stale.lease_token or "",
                state="retryable",
                error=error(message="worker lost"),
                delay=0.0,
            )
        ]
    )
    assert rescued == [True]
    current = claim_one(backend, worker_id="new-worker", suspects=True)
    assert current.id == job_id and current.lease_token != stale.lease_token
    return stale, current


# -- fencing ---------------------------------------------------------------------------


def test_stale_token_cannot_complete_a_reclaimed_job(backend: Backend, harness: Harness) -> None:
    """A late result from a worker whose lease was taken over changes nothing (I6)."""
    stale, current = _reclaimed(backend, harness)
    assert finish(backend, stale, "completed", result_json='"late"') is False
    row = get(backend, current.id)
    assert (row.state, row.lease_token, row.result) == ("running", current.lease_token, None)
    assert row.attempt == 2


@pytest.mark.parametrize("state", ["retryable", "dead", "cancelled"])
def test_stale_token_cannot_fail_a_reclaimed_job(
    backend: Backend, harness: Harness, state: str
) -> None:
    """A stale worker cannot retry, kill or cancel the newer attempt, nor add its error."""
    stale, current = _reclaimed(backend, harness)
    errors_before = errors_of(get(backend, current.id))
    assert finish(backend, stale, state, error=error(message="stale"), delay=5.0) is False
    row = get(backend, current.id)
    assert (row.state, row.lease_token) == ("running", current.lease_token)
    assert errors_of(row) == errors_before


def test_stale_token_cannot_extend_the_new_lease(backend: Backend, harness: Harness) -> None:
    """A heartbeat with a stale token is not reported extended and moves no expiry."""
    stale, current = _reclaimed(backend, harness)
    result = backend.job_heartbeat_many(
        [LeaseRef(id=stale.id, lease_token=stale.lease_token or "", lease_seconds=3600)]
    )
    assert result.extended == frozenset() and result.cancel_requested == frozenset()
    assert get(backend, current.id).lease_expires_at == current.lease_expires_at


def test_stale_token_cannot_release_the_new_claim(backend: Backend, harness: Harness) -> None:
    """A release with a stale token leaves the newer claim running."""
    stale, current = _reclaimed(backend, harness)
    assert backend.job_release_many(
        [LeaseRef(id=stale.id, lease_token=stale.lease_token or "", lease_seconds=30)]
    ) == [False]
    row = get(backend, current.id)
    assert (row.state, row.attempt, row.lease_token) == ("running", 2, current.lease_token)


def test_finish_many_reports_each_outcome_separately(backend: Backend) -> None:
    """In one batch, the write with the right token lands and the wrong one is rejected."""
    a, b = insert(backend), insert(backend)
    rows = {r.id: r for r in claim(backend, limit=2)}
    results = backend.job_finish_many(
        [
            FinishParams(id=a, lease_token=rows[a].lease_token or "", state="completed"),
            FinishParams(id=b, lease_token="not-the-token", state="completed"),
        ]
    )
    assert results == [True, False]
    assert (get(backend, a).state, get(backend, b).state) == ("completed", "running")


def test_finish_of_a_job_that_is_not_running_changes_nothing(backend: Backend) -> None:
    """A second completion of an already completed job is rejected."""
    insert(backend)
    row = claim_one(backend)
    assert finish(backend, row, "completed", result_json="1") is True
    assert finish(backend, row, "dead", error=error()) is False
    assert get(backend, row.id).state == "completed"


# -- finish states ---------------------------------------------------------------------


def test_finish_completed_stores_result_and_clears_the_lease(backend: Backend) -> None:
    """Completing writes the result, the finish time, and drops lease owner and token."""
    insert(backend)
    row = claim_one(backend)
    assert finish(backend, row, "completed", result_json='{"charge":"ch_1"}') is True
    done = get(backend, row.id)
    assert done.state == "completed"
    assert json.loads(done.result or "null") == {"charge": "ch_1"}
    assert done.finished_at is not None and done.finished_at <= backend.db_now() + 1
    assert (done.lease_owner, done.lease_token, done.lease_expires_at) == (None, None, None)
    assert done.attempt == 1


def test_finish_retryable_appends_error_and_waits_out_the_delay(backend: Backend) -> None:
    """A retryable finish records the error with a time and sets run_at = now + delay."""
    insert(backend)
    row = claim_one(backend)
    assert finish(backend, row, "retryable", error=error(message="flaky"), delay=60.0) is True
    waiting = get(backend, row.id)
    now = backend.db_now()
    assert waiting.state == "retryable"
    assert now + 55 <= waiting.run_at <= now + 61
    assert waiting.finished_at is None and waiting.lease_token is None
    (entry,) = errors_of(waiting)
    assert entry["message"] == "flaky" and entry["attempt"] == 1
    assert entry["type"] == "RuntimeError"
    assert now - 5 <= entry["at"] <= now + 1
    assert claim(backend) == []  # not due yet


def test_errors_accumulate_one_entry_per_failed_attempt(backend: Backend) -> None:
    """Each failed attempt adds its own entry; earlier ones are kept in order."""
    insert(backend)
    for attempt in (1, 2):
        row = claim_one(backend)
        assert row.attempt == attempt
        assert finish(backend, row, "retryable", error=error(attempt, f"fail {attempt}"))
    row = claim_one(backend)
    assert finish(backend, row, "dead", error=error(3, "fail 3"))
    dead = get(backend, row.id)
    assert [e["message"] for e in errors_of(dead)] == ["fail 1", "fail 2", "fail 3"]
    assert [e["attempt"] for e in errors_of(dead)] == [1, 2, 3]


def test_finish_dead_records_the_error_and_the_finish_time(backend: Backend) -> None:
    """A dead finish puts the job in the DLQ with its last error and a finish time."""
    insert(backend)
    row = claim_one(backend)
    assert finish(backend, row, "dead", error=error(message="card declined")) is True
    dead = get(backend, row.id)
    assert dead.state == "dead" and dead.finished_at is not None
    assert errors_of(dead)[-1]["message"] == "card declined"
    assert claim(backend) == []


def test_finish_cancelled_ends_the_job(backend: Backend) -> None:
    """A cancelled finish is terminal and never claimed again."""
    insert(backend)
    row = claim_one(backend)
    assert finish(backend, row, "cancelled") is True
    cancelled = get(backend, row.id)
    assert cancelled.state == "cancelled" and cancelled.finished_at is not None
    assert claim(backend) == []


def test_cancel_requested_while_running_turns_a_retry_into_cancelled(backend: Backend) -> None:
    """A job an operator cancelled mid-run does not come back for another attempt."""
    insert(backend)
    row = claim_one(backend)
    assert backend.job_cancel(row.id, "ops").state == "running"
    assert finish(backend, row, "retryable", error=error(), delay=0.0) is True
    after = get(backend, row.id)
    assert after.state == "cancelled" and after.finished_at is not None
    assert claim(backend) == []


def test_cancel_requested_while_running_keeps_a_completed_result(backend: Backend) -> None:
    """A handler that finished its work despite a cancel request is recorded completed."""
    insert(backend)
    row = claim_one(backend)
    backend.job_cancel(row.id, "ops")
    assert finish(backend, row, "completed", result_json='"done"') is True
    assert get(backend, row.id).state == "completed"


# -- heartbeats ------------------------------------------------------------------------


def test_heartbeat_extends_the_lease_from_database_now(backend: Backend) -> None:
    """A heartbeat with the right token moves the lease expiry to now + lease_seconds."""
    insert(backend)
    row = claim_one(backend, lease=30.0)
    result = backend.job_heartbeat_many(
        [LeaseRef(id=row.id, lease_token=row.lease_token or "", lease_seconds=600.0)]
    )
    assert result.extended == frozenset({(row.id, row.lease_token)})
    assert result.cancel_requested == frozenset()
    expires = get(backend, row.id).lease_expires_at
    assert expires is not None and expires >= backend.db_now() + 590


def test_heartbeat_reports_a_cancel_request(backend: Backend) -> None:
    """The heartbeat is how a worker learns an operator asked to cancel its job."""
    insert(backend)
    insert(backend)
    first, second = claim(backend, limit=2)
    backend.job_cancel(first.id, "ops")
    result = backend.job_heartbeat_many(
        [
            LeaseRef(id=r.id, lease_token=r.lease_token or "", lease_seconds=30)
            for r in (first, second)
        ]
    )
    assert result.extended == frozenset(
        {(first.id, first.lease_token), (second.id, second.lease_token)}
    )
    assert result.cancel_requested == frozenset({(first.id, first.lease_token)})


def test_heartbeat_of_a_finished_job_extends_nothing(backend: Backend) -> None:
    """Once a job is finished its old lease cannot be renewed."""
    insert(backend)
    row = claim_one(backend)
    finish(backend, row, "completed")
    result = backend.job_heartbeat_many(
        [LeaseRef(id=row.id, lease_token=row.lease_token or "", lease_seconds=30)]
    )
    assert result.extended == frozenset()
    assert get(backend, row.id).lease_expires_at is None


def test_empty_batches_are_no_ops(backend: Backend) -> None:
    """Finishing, heartbeating, releasing and rescuing nothing return empty results."""
    assert backend.job_finish_many([]) == []
    assert backend.job_heartbeat_many([]).extended == frozenset()
    assert backend.job_release_many([]) == []
    assert backend.job_rescue_many([]) == []


# -- release ---------------------------------------------------------------------------


def test_release_returns_the_job_to_available_without_charging_the_attempt(
    backend: Backend,
) -> None:
    """A job released at shutdown is available at once with its attempt count restored."""
    insert(backend)
    row = claim_one(backend)
    assert backend.job_release_many(
        [LeaseRef(id=row.id, lease_token=row.lease_token or "", lease_seconds=30)]
    ) == [True]
    released = get(backend, row.id)
    assert (released.state, released.attempt) == ("available", 0)
    assert (released.lease_owner, released.lease_token, released.lease_expires_at) == (
        None,
        None,
        None,
    )
    assert released.run_at <= backend.db_now()
    again = claim_one(backend)
    assert again.id == row.id and again.attempt == 1


def test_a_release_with_a_pause_is_due_again_only_after_it_uncharged(
    backend: Backend, harness: Harness
) -> None:
    """A job given back with a pause (its ctx.transaction() met a store that cannot
    write) waits it out before any claim takes it again: ``retryable`` with its ``run_at``
    the release's time plus the pause, its attempt not charged, its release recorded. A
    job released beside it without one is due at once. Such a job was due at once too,
    and ran again in a tight loop for as long as the store could not write."""
    paused_id, other_id = insert(backend), insert(backend)
    rows = claim(backend, limit=2)
    assert {r.id for r in rows} == {paused_id, other_id}
    leases = [LeaseRef(id=r.id, lease_token=r.lease_token or "", lease_seconds=30) for r in rows]
    delays = [30.0 if r.id == paused_id else 0.0 for r in rows]
    assert backend.job_release_many(leases, "store full", delays=delays) == [True, True]
    paused, other = get(backend, paused_id), get(backend, other_id)
    assert (paused.state, paused.attempt) == ("retryable", 0)
    [entry] = errors_of(paused)
    assert (entry["kind"], entry["message"], entry["attempt"]) == ("released", "store full", 1)
    assert paused.run_at == pytest.approx(entry["at"] + 30.0, abs=1.0)  # the store's clock
    assert (other.state, other.attempt) == ("available", 0)
    assert [r.id for r in claim(backend, limit=2)] == [other_id]  # not the paused one
    harness.backdate_run_at(backend, paused_id, 31.0)
    again = claim_one(backend)
    assert (again.id, again.attempt) == (paused_id, 1)


def test_release_of_a_cancel_requested_job_cancels_it(backend: Backend) -> None:
    """A job released after an operator asked to cancel it is cancelled, not run again."""
    insert(backend)
    row = claim_one(backend)
    backend.job_cancel(row.id, "ops")
    assert backend.job_release_many(
        [LeaseRef(id=row.id, lease_token=row.lease_token or "", lease_seconds=30)]
    ) == [True]
    assert get(backend, row.id).state == "cancelled"
    assert claim(backend) == []


def test_unrun_releases_in_a_row_for_one_reason_are_counted_in_one_entry(
    backend: Backend,
) -> None:
    """A job released again and again, its handler never run, for one reason (child
    processes that cannot start: a release every 30 s for as long as it lasts) keeps one
    ``released`` entry counting them, naming the latest release's lease token; a release
    for another reason, or of a run (whose token explains it), is an entry of its own.
    Each release appended one (~2,880 a day)."""
    job_id = insert(backend)
    tokens = []
    for message in ("no child could start", "no child could start", "no child could start"):
        row = claim_one(backend)
        tokens.append(row.lease_token)
        lease = LeaseRef(id=row.id, lease_token=row.lease_token or "", lease_seconds=30)
        assert backend.job_release_many([lease], message, unrun=True) == [True]
    [entry] = errors_of(get(backend, job_id))
    assert (entry["kind"], entry["message"], entry["times"]) == (
        "released",
        "no child could start",
        3,
    )
    assert entry["lease_token"] == tokens[-1] and entry["attempt"] == 1
    assert get(backend, job_id).attempt == 0  # uncharged, each time

    for _ in range(2):  # releases of runs: each its own entry, naming its token
        row = claim_one(backend)
        lease = LeaseRef(id=row.id, lease_token=row.lease_token or "", lease_seconds=30)
        assert backend.job_release_many([lease], "released at shutdown") == [True]
    entries = errors_of(get(backend, job_id))
    assert [(e["message"], e.get("times")) for e in entries] == [
        ("no child could start", 3),
        ("released at shutdown", None),
        ("released at shutdown", None),
    ]


def test_a_prefetched_release_records_nothing_and_keeps_the_jobs_place_in_its_queue(
    backend: Backend, harness: Harness
) -> None:
    """A job claimed and never begun (prefetched, given back by a stopping worker) is
    available again uncharged with nothing recorded (its errors as they were) and its due
    time kept, so it goes back to the head of its queue, ahead of a job due after it.
    Each such release appended a ``released`` entry (one per deploy that found it
    prefetched) and moved it behind every job enqueued meanwhile."""
    job_id = insert(backend)
    harness.backdate_run_at(backend, job_id, 60.0)
    row = claim_one(backend)
    lease = LeaseRef(id=row.id, lease_token=row.lease_token or "", lease_seconds=30)
    assert backend.job_release_many([lease], "released at shutdown") == [True]  # a run's
    [entry] = errors_of(get(backend, job_id))  # the run it explains
    later = insert(backend)  # due now: after the job, and before any later release

    for _ in range(3):  # three stops that found it prefetched
        due = get(backend, job_id).run_at
        row = claim_one(backend)
        assert row.id == job_id  # first in its queue still
        lease = LeaseRef(id=row.id, lease_token=row.lease_token or "", lease_seconds=30)
        assert backend.job_release_many([lease], "stopping", prefetched=True) == [True]
        released = get(backend, job_id)
        assert (released.state, released.attempt, released.lease_token) == ("available", 0, None)
        assert errors_of(released) == [entry]
        assert released.run_at == due
    assert get(backend, later).state == "available"
