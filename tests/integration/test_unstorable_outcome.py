"""An outcome the store refuses for its content is isolated: it never holds others back."""

from __future__ import annotations

from typing import Any

import errands
from errands import JobState

from .helpers import wait_until


def test_an_outcome_the_store_refuses_ends_dead_and_the_rest_of_its_batch_is_recorded(
    app: errands.App, worker_factory: Any
) -> None:
    """Given a store that refuses one job's outcome (not a connection problem), the batch is
    split, the others complete, and that job is recorded dead with the refusal as reason."""

    @app.job(name="unstorable.work")
    def work(n: int) -> int:
        return n

    handles = app.enqueue_many([work.bind(n) for n in range(8)])
    poisoned = handles[3].id
    backend = app.backend
    original = backend.job_finish_many

    def refusing(outcomes: Any) -> list[bool]:
        if any(o.id == poisoned and o.state == "completed" for o in outcomes):
            raise ValueError("value too long for type character varying(8)")
        return original(outcomes)

    backend.job_finish_many = refusing  # type: ignore[method-assign]
    with worker_factory(concurrency=8):
        wait_until(
            lambda: all(h.status() in (JobState.COMPLETED, JobState.DEAD) for h in handles),
            what="every job to be recorded",
            timeout=30,
        )
    for handle in handles:
        job = handle.job()
        if handle.id == poisoned:
            assert job.state is JobState.DEAD
            assert job.last_error is not None and job.last_error.type == "UnstorableOutcome"
            assert "value too long" in job.last_error.message
        else:
            assert job.state is JobState.COMPLETED, (handle.id, job.state)


def test_an_outcome_not_stored_at_all_is_not_reported_as_a_stale_write(
    app: errands.App, worker_factory: Any
) -> None:
    """The store refused the outcome and its dead fallback too: it was counted and logged
    as a stale write ('lease lost or job cancelled'), which it was not; the lease runs
    out and the job is rescued."""

    @app.job(name="unstorable.twice")
    def work(n: int) -> int:
        return n

    handle = work.enqueue(n=1)
    backend = app.backend
    original = backend.job_finish_many
    refused: list[int] = []

    def refusing(outcomes: Any) -> list[bool]:
        if any(o.id == handle.id for o in outcomes):
            refused.append(handle.id)
            raise ValueError("value too long for type character varying(8)")
        return original(outcomes)

    stale: list[Any] = []
    app.events.subscribe(
        lambda e: stale.append(e) if e.name == "errands.job.stale_write_rejected" else None
    )
    backend.job_finish_many = refusing  # type: ignore[method-assign]
    with worker_factory(concurrency=1) as worker:
        wait_until(lambda: len(refused) >= 4, what="the outcome and its fallback refused")
        wait_until(lambda: worker.completer.pending == 0, what="the completer to be done")
        assert worker.completer.stale_rejected == 0
    assert stale == []
    assert handle.status() is JobState.RUNNING  # left to its lease: rescued later


def test_a_workflow_settled_by_an_unstorable_outcome_is_reported_as_settled(
    app: errands.App, worker_factory: Any
) -> None:
    """The last member of a batch whose outcome the store refuses is recorded dead, and
    that write settles the batch: its errands.workflow.settled event was never emitted
    (and the worker was not woken for the callback it released)."""
    settled: list[dict[str, Any]] = []
    app.events.subscribe(
        lambda e: settled.append(dict(e.fields)) if e.name == "errands.workflow.settled" else None
    )

    @app.job(name="unstorable.member")
    def member() -> int:
        return 1

    batch = errands.Batch("refused")
    batch.add(member.bind())
    handle = app.enqueue_workflow(batch)
    backend = app.backend
    original = backend.job_finish_many

    def refusing(outcomes: Any) -> list[bool]:
        if any(o.state == "completed" for o in outcomes):
            raise ValueError("value too long for type character varying(8)")
        return original(outcomes)

    backend.job_finish_many = refusing  # type: ignore[method-assign]
    with worker_factory(concurrency=2):
        wait_until(lambda: handle.status().settled, what="the batch to settle", timeout=30)
        wait_until(lambda: settled, what="its settled event", timeout=10)
    assert [(s["workflow_id"], s["state"]) for s in settled] == [(handle.id, "failed")]
