"""The record that a death's on_dead hooks are due: written with the death, whichever path
made the job dead, forgotten when the hooks ran or the job is no longer dead."""

from __future__ import annotations

import time

from errands.backends import Backend
from errands.backends.base import ActionParams, RescueParams

from .conftest import Harness
from .support import claim_one, error, finish, get, insert, make_dead

# A negative age: every record is due, whatever the two clocks' resolution.
ANY_AGE = -60.0


def test_a_death_records_that_its_on_dead_hooks_are_due(backend: Backend) -> None:
    """The fenced finish that makes a job dead also records its hooks as due."""
    job_id = make_dead(backend)
    assert job_id in backend.dead_hooks_due(ANY_AGE, 100)


def test_a_rescue_to_dead_records_its_on_dead_hooks_too(backend: Backend, harness: Harness) -> None:
    """The leader's rescue of a poison job is a death like any other."""
    insert(backend, max_attempts=1)
    row = claim_one(backend)
    harness.expire_lease(backend, row.id)
    rescue = RescueParams(
        id=row.id,
        lease_token=row.lease_token or "",
        state="dead",
        error=error(1, "lost"),
        delay=0.0,
    )
    assert backend.job_rescue_many([rescue]) == [True]
    assert row.id in backend.dead_hooks_due(ANY_AGE, 100)


def test_no_other_outcome_records_hooks(backend: Backend) -> None:
    """Completed, retried and cancelled jobs have no on_dead hooks to run."""
    ids = [insert(backend, priority=1_000_000 - i) for i in range(3)]
    for state in ("completed", "retryable", "cancelled"):
        row = claim_one(backend)
        assert finish(backend, row, state, error=None if state == "completed" else error())
    assert not set(ids) & set(backend.dead_hooks_due(ANY_AGE, 100))


def test_hooks_are_due_only_after_the_grace(backend: Backend) -> None:
    """A fresh death is not due to the leader yet: its own worker runs its hooks first."""
    job_id = make_dead(backend)
    assert job_id not in backend.dead_hooks_due(3600.0, 100)


def test_marking_the_hooks_done_forgets_that_death_only(backend: Backend) -> None:
    """Done for the death at its finish time removes the record; a later death of the
    same job (replayed, then dead again) is recorded anew and stays until its own done."""
    job_id = make_dead(backend)
    died_at = get(backend, job_id).finished_at
    assert died_at is not None
    backend.dead_hooks_done(job_id, died_at)
    assert job_id not in backend.dead_hooks_due(ANY_AGE, 100)

    # A death is known by its time, to the millisecond (SQLite's clock): the second one
    # comes a few milliseconds later, as any replayed job's can only (it is run again).
    time.sleep(0.005)
    backend.job_replay(ActionParams(actor="alice", ids=[job_id]))
    row = claim_one(backend)
    assert row.id == job_id
    assert finish(backend, row, "dead", error=error(2))
    backend.dead_hooks_done(job_id, died_at)  # a late done for the first death
    assert job_id in backend.dead_hooks_due(ANY_AGE, 100)


def test_a_replayed_or_discarded_job_has_no_hooks_due(backend: Backend) -> None:
    """A dead job an operator replayed or discarded before its hooks ran is not told
    dead later: its record is forgotten."""
    replayed, discarded = make_dead(backend), make_dead(backend)
    backend.job_replay(ActionParams(actor="alice", ids=[replayed]))
    backend.job_discard(ActionParams(actor="alice", ids=[discarded], reason="bad data"))
    due = backend.dead_hooks_due(ANY_AGE, 100)
    assert replayed not in due and discarded not in due


def test_a_limit_of_zero_reads_nothing_and_still_forgets(backend: Backend) -> None:
    """An app without hooks asks with limit 0: nothing to run, stale records go."""
    kept, replayed = make_dead(backend), make_dead(backend)
    backend.job_replay(ActionParams(actor="alice", ids=[replayed]))
    assert backend.dead_hooks_due(ANY_AGE, 0) == []
    assert set(backend.dead_hooks_due(ANY_AGE, 100)) >= {kept}
