"""Durable signals at the store: a suspension (outcome ``waiting``) gives the lease and
the attempt back; a signal already stored makes the job available at once; ``job_signal``
stores (audited) and resumes a job waiting for that name; expired waits end as failed
attempts, fenced by the job still waiting."""

from __future__ import annotations

import json

import pytest

from errands.backends import Backend
from errands.backends.base import FinishParams, WaitTimeoutParams
from errands.errors import InvalidTransition, JobNotFound

from .conftest import Harness
from .support import claim_one, finish, get, insert

TIMEOUT_ERROR = {"attempt": 1, "type": "SignalTimeout", "message": "m", "kind": "signal_timeout"}


def suspend(backend: Backend, job_id: int, token: str, timeout: float | None = 60.0) -> bool:
    (ok,) = backend.job_finish_many(
        [FinishParams(job_id, token, "waiting", wait_signal="approved", wait_timeout=timeout)]
    )
    return ok


def test_a_suspension_waits_without_a_lease_and_uncharged(backend: Backend) -> None:
    """The job waits for its signal, holding no lease; its attempt is given back."""
    job_id = insert(backend)
    row = claim_one(backend)
    assert suspend(backend, job_id, row.lease_token or "")
    stored = get(backend, job_id)
    assert (stored.state, stored.wait_signal, stored.attempt) == ("waiting", "approved", 0)
    assert stored.lease_token is None and stored.lease_expires_at is None
    assert stored.wait_until is not None
    assert job_id not in {w.id for w in backend.job_list_expired_waits(10)}  # not yet due


def test_a_stale_suspension_is_refused(backend: Backend) -> None:
    """A suspension under a lease token that no longer holds changes nothing."""
    job_id = insert(backend)
    row = claim_one(backend)
    assert finish(backend, row, "completed")
    assert not suspend(backend, job_id, row.lease_token or "")
    assert get(backend, job_id).state == "completed"


def test_a_signal_stored_before_the_suspension_makes_the_job_available(backend: Backend) -> None:
    """A signal sent while the job ran is there when it suspends: available at once."""
    job_id = insert(backend)
    row = claim_one(backend)
    result = backend.job_signal(job_id, "approved", json.dumps({"ok": True}), "ops")
    assert (result.previous_state, result.resumed) == ("running", False)
    assert suspend(backend, job_id, row.lease_token or "")
    stored = get(backend, job_id)
    assert (stored.state, stored.wait_signal) == ("available", None)
    assert json.loads(backend.signal_get(job_id, "approved") or "null") == {"ok": True}


def test_job_signal_resumes_a_job_waiting_for_it_and_is_audited(backend: Backend) -> None:
    """A signal of another name is kept but resumes nothing; the awaited one resumes."""
    job_id = insert(backend)
    row = claim_one(backend)
    assert suspend(backend, job_id, row.lease_token or "", timeout=None)
    assert get(backend, job_id).wait_until is None
    assert backend.job_signal(job_id, "other", "1", "ops").resumed is False
    assert get(backend, job_id).state == "waiting"
    assert backend.job_signal(job_id, "approved", "2", "ops").resumed is True
    assert get(backend, job_id).state == "available"
    assert backend.signal_get(job_id, "approved") == "2"
    assert backend.signal_get(job_id, "missing") is None
    actions = [(e.action, e.detail.get("signal")) for e in backend.audit_list(job_id=job_id)]
    assert actions == [("signal", "approved"), ("signal", "other")]


def test_job_signal_refuses_finished_and_unknown_jobs(backend: Backend) -> None:
    """Completed jobs refuse signals; unknown ids raise JobNotFound; nothing is stored."""
    job_id = insert(backend)
    assert finish(backend, claim_one(backend), "completed")
    with pytest.raises(InvalidTransition):
        backend.job_signal(job_id, "approved", "1", "ops")
    with pytest.raises(JobNotFound):
        backend.job_signal(424242, "approved", "1", "ops")
    assert backend.signal_get(job_id, "approved") is None


def test_expired_waits_end_as_failed_attempts_unless_signalled_first(
    backend: Backend, harness: Harness
) -> None:
    """A wait past its timeout is listed and ended (charged, with the error); one whose
    signal landed first is not touched."""
    timed_out, signalled = insert(backend), insert(backend)
    for _ in (timed_out, signalled):
        row = claim_one(backend)
        assert suspend(backend, row.id, row.lease_token or "", timeout=0.0)
    expired = {w.id: w for w in backend.job_list_expired_waits(10)}
    assert set(expired) == {timed_out, signalled} and expired[timed_out].wait_signal == "approved"
    assert backend.job_signal(signalled, "approved", "1", "ops").resumed
    plans = [
        WaitTimeoutParams(i, "approved", "retryable", TIMEOUT_ERROR, 5.0, expired[i].attempt)
        for i in (timed_out, signalled)
    ]
    assert backend.job_expire_waits(plans) == [True, False]
    ended = get(backend, timed_out)
    assert (ended.state, ended.attempt, ended.wait_signal) == ("retryable", 1, None)
    assert json.loads(ended.errors)[-1]["kind"] == "signal_timeout"
    assert get(backend, signalled).state == "available"


def test_a_timeout_planned_for_an_earlier_wait_never_ends_a_later_one(backend: Backend) -> None:
    """Two leaders (one paused) plan the end of the same expired wait, made for its
    attempt. The first ends it (retryable); the job runs again and waits on the same
    signal, expired too. The paused leader's plan, made for the earlier attempt, is
    refused: written, it made a job on its last attempt retryable (a run past its
    attempts). The next listing plans the new wait's end: dead."""
    job_id = insert(backend, max_attempts=2)
    row = claim_one(backend)
    assert suspend(backend, job_id, row.lease_token or "", timeout=0.0)
    (listed,) = backend.job_list_expired_waits(10)
    plan = WaitTimeoutParams(job_id, "approved", "retryable", TIMEOUT_ERROR, 0.0, listed.attempt)
    assert backend.job_expire_waits([plan]) == [True]  # the first leader's
    row = claim_one(backend)  # its last attempt
    assert suspend(backend, job_id, row.lease_token or "", timeout=0.0)
    assert backend.job_expire_waits([plan]) == [False]  # the paused leader's, too late
    (again,) = backend.job_list_expired_waits(10)
    assert again.attempt == listed.attempt + 1
    last = WaitTimeoutParams(job_id, "approved", "dead", TIMEOUT_ERROR, 0.0, again.attempt)
    assert backend.job_expire_waits([last]) == [True]
    ended = get(backend, job_id)
    assert (ended.state, ended.attempt) == ("dead", 2)


def test_a_waiting_job_can_be_cancelled(backend: Backend) -> None:
    """Cancel takes a waiting job straight to cancelled."""
    job_id = insert(backend)
    row = claim_one(backend)
    assert suspend(backend, job_id, row.lease_token or "")
    assert backend.job_cancel(job_id, "ops").state == "cancelled"
    assert get(backend, job_id).state == "cancelled"
