"""Audited admin actions: replay and discard from the DLQ, cancel."""

from __future__ import annotations

import pytest

from errands.backends import Backend
from errands.backends.base import ActionParams, ListParams
from errands.errors import InvalidTransition, JobNotFound

from .support import claim, claim_one, errors_of, finish, get, insert, make_dead

# -- replay ----------------------------------------------------------------------------


def test_replay_puts_a_dead_job_back_with_the_same_id_and_key(backend: Backend) -> None:
    """Replay makes the dead job available again, attempts reset, history kept."""
    job_id = make_dead(backend, key="order:9")
    result = backend.job_replay(ActionParams(actor="alice", ids=[job_id]))
    assert (result.matched, result.skipped) == ([job_id], {})
    row = get(backend, job_id)
    assert (row.state, row.attempt, row.rescues) == ("available", 0, 0)
    assert row.idempotency_key == "order:9"
    assert row.finished_at is None and row.run_at <= backend.db_now()
    assert len(errors_of(row)) == 1  # the failed attempt stays in the history
    again = claim_one(backend)
    assert (again.id, again.attempt) == (job_id, 1)


def test_replay_is_audited_with_the_actor(backend: Backend) -> None:
    """Every replayed job gets an audit event naming who replayed it."""
    job_id = make_dead(backend)
    backend.job_replay(ActionParams(actor="alice", ids=[job_id]))
    (event,) = backend.audit_list(job_id=job_id)
    assert (event.action, event.actor, event.job_id) == ("replay", "alice", job_id)
    assert event.at <= backend.db_now()


def test_replay_skips_jobs_that_are_not_dead_saying_why(backend: Backend) -> None:
    """A pending or unknown id is reported skipped with a reason and left alone."""
    pending = insert(backend)
    result = backend.job_replay(ActionParams(actor="alice", ids=[pending, 999_999]))
    assert result.matched == []
    assert "available" in result.skipped[pending]
    assert "no such job" in result.skipped[999_999]
    assert get(backend, pending).state == "available"
    assert backend.audit_list() == []


def test_replay_dry_run_changes_nothing(backend: Backend) -> None:
    """A dry run reports what it would replay, writes no row and no audit event."""
    job_id = make_dead(backend)
    result = backend.job_replay(ActionParams(actor="alice", ids=[job_id], dry_run=True))
    assert result.matched == [job_id]
    assert get(backend, job_id).state == "dead"
    assert backend.audit_list() == []


def test_replay_all_matching_selects_dead_jobs_by_queue_and_name(backend: Backend) -> None:
    """With all_matching, the filters choose which dead jobs come back."""
    emails = make_dead(backend, queue="emails", name="shop.email")
    make_dead(backend, queue="payments", name="shop.charge")
    make_dead(backend, queue="emails", name="shop.digest")
    result = backend.job_replay(
        ActionParams(actor="ops", all_matching=True, queue="emails", name="shop.email")
    )
    assert result.matched == [emails]
    states = sorted(r.state for r in backend.job_list(ListParams()))
    assert states == ["available", "dead", "dead"]


# -- discard ---------------------------------------------------------------------------


def test_discard_needs_a_reason(backend: Backend) -> None:
    """Discarding without a reason is refused and the job stays dead."""
    job_id = make_dead(backend)
    for reason in (None, "", "   "):
        with pytest.raises(InvalidTransition, match="reason"):
            backend.job_discard(ActionParams(actor="bob", ids=[job_id], reason=reason))
    assert get(backend, job_id).state == "dead"


def test_discard_keeps_the_row_with_who_and_why(backend: Backend) -> None:
    """A discarded job stays as discarded, with discarded_by and discard_reason, audited."""
    job_id = make_dead(backend)
    result = backend.job_discard(ActionParams(actor="bob", ids=[job_id], reason="duplicate"))
    assert result.matched == [job_id]
    row = get(backend, job_id)
    assert (row.state, row.discarded_by, row.discard_reason) == ("discarded", "bob", "duplicate")
    assert row.finished_at is not None
    (event,) = backend.audit_list(job_id=job_id)
    assert (event.action, event.actor, event.detail) == ("discard", "bob", {"reason": "duplicate"})
    assert claim(backend) == []


def test_discard_skips_jobs_that_are_not_dead(backend: Backend) -> None:
    """Only dead jobs can be discarded; others are skipped with a reason."""
    pending = insert(backend)
    result = backend.job_discard(ActionParams(actor="bob", ids=[pending], reason="x"))
    assert result.matched == [] and pending in result.skipped
    assert get(backend, pending).state == "available"


def test_discard_dry_run_changes_nothing(backend: Backend) -> None:
    """A dry-run discard reports the match and leaves the job dead, unaudited."""
    job_id = make_dead(backend)
    result = backend.job_discard(ActionParams(actor="bob", ids=[job_id], reason="x", dry_run=True))
    assert result.matched == [job_id]
    assert get(backend, job_id).state == "dead"
    assert backend.audit_list() == []


# -- cancel ----------------------------------------------------------------------------


@pytest.mark.parametrize("delay", [0.0, 3600.0], ids=["available", "scheduled"])
def test_cancel_of_a_pending_job_cancels_it_at_once(backend: Backend, delay: float) -> None:
    """An available or scheduled job is cancelled immediately and never claimed."""
    job_id = insert(backend, delay=delay)
    previous = get(backend, job_id).state
    result = backend.job_cancel(job_id, "carol")
    assert (result.id, result.previous_state, result.state) == (job_id, previous, "cancelled")
    row = get(backend, job_id)
    assert row.state == "cancelled" and row.finished_at is not None
    assert claim(backend) == []


def test_cancel_of_a_retryable_job_cancels_it_at_once(backend: Backend) -> None:
    """A job waiting out its backoff is cancelled immediately."""
    insert(backend)
    row = claim_one(backend)
    finish(backend, row, "retryable", error={"message": "x"}, delay=3600.0)
    result = backend.job_cancel(row.id, "carol")
    assert (result.previous_state, result.state) == ("retryable", "cancelled")
    assert get(backend, row.id).state == "cancelled"


def test_cancel_of_a_running_job_requests_cancellation(backend: Backend) -> None:
    """A running job keeps running with cancel_requested set, for the worker to act on."""
    insert(backend)
    row = claim_one(backend)
    result = backend.job_cancel(row.id, "carol")
    assert (result.previous_state, result.state) == ("running", "running")
    stored = get(backend, row.id)
    assert stored.state == "running" and stored.cancel_requested
    assert stored.lease_token == row.lease_token


@pytest.mark.parametrize("outcome", ["completed", "dead", "cancelled"])
def test_cancel_of_a_finished_job_is_an_invalid_transition(backend: Backend, outcome: str) -> None:
    """A job that already ended cannot be cancelled; the error names its state."""
    insert(backend)
    row = claim_one(backend)
    finish(backend, row, outcome)
    with pytest.raises(InvalidTransition, match=outcome):
        backend.job_cancel(row.id, "carol")
    assert backend.audit_list() == []


def test_cancel_of_an_unknown_job_raises_job_not_found(backend: Backend) -> None:
    """Cancelling an id with no row raises JobNotFound naming the id."""
    with pytest.raises(JobNotFound, match="31337"):
        backend.job_cancel(31337, "carol")


def test_cancel_is_audited_with_the_previous_state(backend: Backend) -> None:
    """Each cancel writes an audit event with the actor and the state it cancelled from."""
    job_id = insert(backend)
    backend.job_cancel(job_id, "carol")
    (event,) = backend.audit_list(job_id=job_id)
    assert (event.action, event.actor) == ("cancel", "carol")
    assert event.detail == {"previous_state": "available"}


def test_audit_list_is_newest_first_and_filters_by_job(backend: Backend) -> None:
    """The audit log lists the latest events first; job_id narrows it to one job."""
    a, b = insert(backend), insert(backend)
    backend.job_cancel(a, "x")
    backend.job_cancel(b, "y")
    assert [e.job_id for e in backend.audit_list()] == [b, a]
    assert [e.actor for e in backend.audit_list(job_id=a)] == ["x"]
    assert len(backend.audit_list(limit=1)) == 1
