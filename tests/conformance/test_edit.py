"""Editing pending jobs: each edit is a write guarded by the job's state (only scheduled,
available and retryable jobs change), audited with the actor in the same transaction; a
dry run changes nothing; a claim after an edit carries the edited arguments."""

from __future__ import annotations

import json
import time

from errands.backends import Backend
from errands.backends.base import EditParams, JobEdit

from .conftest import Harness
from .support import claim_one, error, finish, get, insert


def edit(backend: Backend, *ids: int, **fields: object) -> tuple[list[int], dict[int, str]]:
    edits = [JobEdit(i, **fields.pop("args", {}).get(i, {})) for i in ids]  # type: ignore[union-attr]
    result = backend.job_edit(EditParams("ops", edits, **fields))  # type: ignore[arg-type]
    return result.matched, result.skipped


def test_an_edit_changes_priority_queue_and_arguments_and_is_audited(backend: Backend) -> None:
    """Every field given changes; the audit says what changed, never the argument values."""
    job_id = insert(backend, args_json='{"n": 1}')
    args = {job_id: {"args_json": '{"n": 2}', "concurrency_key": None}}
    assert edit(backend, job_id, priority=5, queue="later", args=args) == ([job_id], {})
    row = get(backend, job_id)
    assert (row.priority, row.queue, json.loads(row.args)) == (5, "later", {"n": 2})
    [event] = backend.audit_list(job_id=job_id)
    assert (event.actor, event.action) == ("ops", "edit")
    assert event.detail == {"priority": 5, "queue": "later", "args": "replaced"}


def test_a_reschedule_sets_state_by_the_new_time(backend: Backend) -> None:
    """A future run_at makes the job scheduled, a past one available; delay counts from
    the database's now."""
    job_id = insert(backend)
    assert edit(backend, job_id, delay=3600.0)[0] == [job_id]
    assert get(backend, job_id).state == "scheduled"
    assert edit(backend, job_id, run_at=time.time() - 5)[0] == [job_id]
    row = get(backend, job_id)
    assert row.state == "available" and row.run_at < time.time()


def test_edits_never_land_on_running_or_finished_jobs(backend: Backend) -> None:
    """A running, completed or dead job is skipped with its state; unknown ids too."""
    running = insert(backend, priority=10)
    claim_one(backend)
    done = insert(backend, priority=9)
    assert finish(backend, claim_one(backend), "completed")
    dead = insert(backend, priority=8)
    assert finish(backend, claim_one(backend), "dead", error=error())
    matched, skipped = edit(backend, running, done, dead, 424242, priority=1)
    assert matched == []
    assert set(skipped) == {running, done, dead, 424242}
    assert "running" in skipped[running] and "no such job" in skipped[424242]
    assert get(backend, running).priority == 10 and backend.audit_list() == []


def test_a_dry_run_changes_nothing(backend: Backend) -> None:
    """The dry run reports the jobs it would change and writes nothing, not even audit."""
    job_id = insert(backend)
    assert edit(backend, job_id, priority=3, dry_run=True) == ([job_id], {})
    assert get(backend, job_id).priority == 0 and backend.audit_list() == []


def test_a_claim_after_an_edit_carries_the_new_arguments(backend: Backend) -> None:
    """The claim and the edit serialise on the row: the attempt runs the edited args."""
    job_id = insert(backend, args_json='{"n": 1}')
    edit(backend, job_id, args={job_id: {"args_json": '{"n": 99}'}})
    assert json.loads(claim_one(backend).args) == {"n": 99}


def test_a_retryable_job_stays_retryable_when_rescheduled(
    backend: Backend, harness: Harness
) -> None:
    """Rescheduling a retryable job keeps its state (its errors say why it waits)."""
    job_id = insert(backend)
    assert finish(backend, claim_one(backend), "retryable", error=error(), delay=60.0)
    assert edit(backend, job_id, delay=1.0)[0] == [job_id]
    assert get(backend, job_id).state == "retryable"
