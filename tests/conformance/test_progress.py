"""Progress rides on the heartbeat: ``LeaseRef.progress`` is stored with the lease
extension (None leaves it as it is), only for a lease still held; a new claim clears it."""

from __future__ import annotations

from errands.backends import Backend
from errands.backends.base import LeaseRef

from .conftest import Harness
from .support import LEASE, claim_one, finish, get, insert


def test_a_heartbeat_stores_the_progress_it_carries(backend: Backend) -> None:
    """Progress and message land with the heartbeat; a heartbeat without leaves them."""
    insert(backend)
    row = claim_one(backend)
    assert row.lease_token is not None
    ref = LeaseRef(row.id, row.lease_token, LEASE, 0.4, "rendered 40 of 100")
    assert backend.job_heartbeat_many([ref]).extended == {(row.id, row.lease_token)}
    stored = get(backend, row.id)
    assert (stored.progress, stored.progress_message) == (0.4, "rendered 40 of 100")
    backend.job_heartbeat_many([LeaseRef(row.id, row.lease_token, LEASE)])
    stored = get(backend, row.id)
    assert (stored.progress, stored.progress_message) == (0.4, "rendered 40 of 100")
    assert stored.to_job().progress is not None


def test_a_stale_heartbeat_stores_no_progress(backend: Backend) -> None:
    """Progress sent with a lease token that no longer holds changes nothing."""
    insert(backend)
    row = claim_one(backend)
    assert finish(backend, row, "completed")
    backend.job_heartbeat_many([LeaseRef(row.id, row.lease_token or "", LEASE, 0.9, "late")])
    assert get(backend, row.id).progress is None


def test_a_new_claim_starts_without_progress(backend: Backend, harness: Harness) -> None:
    """A retry's claim clears what the previous attempt reported."""
    insert(backend)
    row = claim_one(backend)
    backend.job_heartbeat_many([LeaseRef(row.id, row.lease_token or "", LEASE, 0.5, "half")])
    assert finish(backend, row, "retryable", error={"attempt": 1, "type": "E", "message": "m"})
    harness.backdate_run_at(backend, row.id, 10)
    again = claim_one(backend)
    assert again.id == row.id and again.progress is None and again.progress_message is None
