"""Every way a job ends reaches the result listener: a waiter is woken by the commit of
its job's end, whichever path wrote it (results.py). On PostgreSQL an attempt's end
announces its jobs in its own statement and every other end through a row trigger
(schema 17); a path that announced nothing would leave its waiters to their 30 s
re-read. Each case drives one path through the Backend protocol and waits for the
listener to report the job (by id, or None: ask job_states)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from errands.backends import Backend
from errands.backends.base import (
    ActionParams,
    FinishParams,
    LeaseRef,
    RescueParams,
    WaitTimeoutParams,
)

from .conftest import Harness
from .support import claim_one, error, finish, get, insert, make_dead
from .test_workflows import spec

End = Callable[[Backend, Harness], int]  # ends a job; returns its id


def _completed(backend: Backend, harness: Harness) -> int:
    insert(backend)
    row = claim_one(backend)
    assert finish(backend, row, "completed", result_json="1")
    return row.id


def _dead(backend: Backend, harness: Harness) -> int:
    return make_dead(backend)


def _failed_after_a_cancel(backend: Backend, harness: Harness) -> int:
    insert(backend)
    row = claim_one(backend)
    backend.job_cancel(row.id, "test")  # a running job is only flagged
    assert finish(backend, row, "retryable", error=error())
    return row.id


def _released_after_a_cancel(backend: Backend, harness: Harness) -> int:
    insert(backend)
    row = claim_one(backend)
    backend.job_cancel(row.id, "test")
    assert backend.job_release_many([LeaseRef(row.id, row.lease_token or "", 30.0)]) == [True]
    return row.id


def _rescued_to_dead(backend: Backend, harness: Harness) -> int:
    insert(backend, max_attempts=1)
    row = claim_one(backend)
    harness.expire_lease(backend, row.id)
    rescue = RescueParams(row.id, row.lease_token or "", "dead", error(1, "lost"), 0.0)
    assert backend.job_rescue_many([rescue]) == [True]
    return row.id


def _suspended_after_a_cancel(backend: Backend, harness: Harness) -> int:
    insert(backend)
    row = claim_one(backend)
    backend.job_cancel(row.id, "test")
    suspension = FinishParams(row.id, row.lease_token or "", "waiting", wait_signal="go")
    assert backend.job_finish_many([suspension]) == [True]
    return row.id


def _discarded(backend: Backend, harness: Harness) -> int:
    job_id = make_dead(backend)
    backend.job_discard(ActionParams(actor="test", ids=[job_id], reason="obsolete"))
    return job_id


def _cancelled_while_pending(backend: Backend, harness: Harness) -> int:
    job_id = insert(backend, delay=3600)
    backend.job_cancel(job_id, "test")
    return job_id


def _wait_timed_out(backend: Backend, harness: Harness) -> int:
    insert(backend, max_attempts=1)
    row = claim_one(backend)
    suspension = FinishParams(
        row.id, row.lease_token or "", "waiting", wait_signal="go", wait_timeout=0.0
    )
    assert backend.job_finish_many([suspension]) == [True]
    failure = {"attempt": 1, "type": "SignalTimeout", "message": "m"}
    timeout = WaitTimeoutParams(row.id, "go", "dead", failure, 0, get(backend, row.id).attempt)
    assert backend.job_expire_waits([timeout]) == [True]
    return row.id


def _workflow_member_cancelled(backend: Backend, harness: Harness) -> int:
    inserted = backend.workflow_insert(spec([("a", []), ("b", [(0, "cancel")])]))
    assert backend.workflow_cancel(inserted.id, "test") == 2
    return inserted.jobs[1].id  # the dependent, waiting for its parent


def _dependent_of_a_dead_parent(backend: Backend, harness: Harness) -> int:
    inserted = backend.workflow_insert(spec([("a", []), ("b", [(0, "cancel")])]))
    parent = claim_one(backend)
    assert finish(backend, parent, "dead", error=error())
    return inserted.jobs[1].id  # cancelled by its parent's death (it never ran)


def _marker(backend: Backend) -> int:
    """A job completed now, in a queue of its own."""
    insert(backend, queue="marker")
    row = claim_one(backend, "marker")
    assert finish(backend, row, "completed")
    return row.id


ENDS: dict[str, End] = {
    "completed": _completed,
    "dead": _dead,
    "failed after a cancel was requested": _failed_after_a_cancel,
    "released after a cancel was requested": _released_after_a_cancel,
    "rescued to dead": _rescued_to_dead,
    "suspended after a cancel was requested": _suspended_after_a_cancel,
    "discarded": _discarded,
    "cancelled while pending": _cancelled_while_pending,
    "signal wait timed out": _wait_timed_out,
    "workflow member cancelled": _workflow_member_cancelled,
    "dependent of a dead parent": _dependent_of_a_dead_parent,
}


# Ways that end a job twice: dead (announced), then discarded (announced again).
ENDS_TWICE = {"discarded": 2}


@pytest.mark.parametrize("way", list(ENDS))
def test_every_way_a_job_ends_reaches_the_result_listener(
    backend: Backend, harness: Harness, way: str
) -> None:
    reports: list[list[int] | None] = []
    changed = threading.Condition()

    def on_done(ids: list[int] | None) -> None:
        with changed:
            reports.append(ids)
            changed.notify_all()

    listener = backend.result_listener(on_done, lambda: None)
    assert listener is not None, f"{type(backend).__name__}: no result listener"
    listener.start()
    try:
        assert listener.listening.wait(5), "the listener never started listening"
        job_id = ENDS[way](backend, harness)
        assert get(backend, job_id).state in ("completed", "dead", "cancelled", "discarded")
        with changed:
            heard = changed.wait_for(
                lambda: any(ids is None or job_id in ids for ids in reports), timeout=5
            )
        assert heard, f"{way}: job {job_id} ended, the listener heard only {reports}"
        settled = _marker(backend)  # any later report of job_id would come before it
        with changed:
            changed.wait_for(
                lambda: any(ids is None or settled in ids for ids in reports), timeout=5
            )
            told = [ids for ids in reports if ids is not None and job_id in ids]
        ends = ENDS_TWICE.get(way, 1)  # reports by id (PostgreSQL): one per end, no more
        assert told == [] or len(told) == ends, f"{way}: job {job_id} told {told} ({reports})"
    finally:
        listener.stop()
