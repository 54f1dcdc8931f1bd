"""An outcome the store refuses for its content is isolated: it never holds others back."""

from __future__ import annotations

import time
from typing import Any

import psycopg.errors
import pytest

import errands
from errands import JobState
from errands.worker import completer

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


def test_an_outcome_past_postgresqls_own_size_limits_ends_dead_and_the_rest_is_recorded(
    app: errands.App, worker_factory: Any
) -> None:
    """PostgreSQL refuses a value past its own limits with SQLSTATE class 54
    (program_limit_exceeded: a jsonb past 256 MB). psycopg raises it as an
    OperationalError, which was taken for a lost connection: the batch was written again
    for ever, every outcome in it held back. It is content the store refuses: split off,
    recorded dead. (The store's answer is substituted: such a value takes a gigabyte.)"""

    @app.job(name="unstorable.huge")
    def work(n: int) -> int:
        return n

    handles = app.enqueue_many([work.bind(n) for n in range(6)])
    poisoned = handles[2].id
    original = app.backend.job_finish_many

    def refusing(outcomes: Any) -> list[bool]:
        if any(o.id == poisoned and o.state == "completed" for o in outcomes):
            raise psycopg.errors.ProgramLimitExceeded(
                "total size of jsonb array elements exceeds the maximum of 268435455 bytes"
            )
        return original(outcomes)

    app.backend.job_finish_many = refusing  # type: ignore[method-assign]
    with worker_factory(concurrency=6):
        wait_until(
            lambda: all(h.status() in (JobState.COMPLETED, JobState.DEAD) for h in handles),
            what="every job to be recorded",
            timeout=30,
        )
    for handle in handles:
        job = handle.job()
        expected = JobState.DEAD if handle.id == poisoned else JobState.COMPLETED
        assert job.state is expected, (handle.id, job.state)
    last = handles[2].job().last_error
    assert last is not None and last.type == "UnstorableOutcome" and "jsonb" in last.message


@pytest.mark.parametrize(
    "no_room",
    [
        errands.StorageFull("SQLite database 'x.db' is full (database or disk is full)"),
        psycopg.errors.DiskFull('could not extend file "base/16384/16385": No space left'),
        psycopg.errors.OutOfMemory("out of memory"),
    ],
    ids=["sqlite-full", "postgres-disk-full", "postgres-out-of-memory"],
)
def test_an_outcome_the_store_has_no_room_for_is_written_once_there_is_room(
    app: errands.App, worker_factory: Any, no_room: Exception, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store out of room refuses every write, not this outcome: the completer writes
    it again until there is room (it recorded the job dead after three tries). A full
    SQLite file on a real worker: tests/fuzz/test_storage_full.py."""

    @app.job(name="unstorable.later", retries=0)
    def work() -> int:
        return 7

    handle = work.enqueue()
    original = app.backend.job_finish_many
    tries: list[int] = []
    monkeypatch.setattr(completer, "_pause", lambda _: time.sleep(0.01))  # (not up to 1 s)

    def full_for_a_while(outcomes: Any) -> list[bool]:
        if len(tries) < 12:  # four times the refusals after which it was recorded dead
            tries.append(1)
            raise no_room
        return original(outcomes)

    app.backend.job_finish_many = full_for_a_while  # type: ignore[method-assign]
    with worker_factory(concurrency=1):
        wait_until(lambda: handle.status().is_terminal, what="the job to be recorded", timeout=60)
    job = handle.job()
    assert (job.state, job.attempt, job.result) == (JobState.COMPLETED, 1, 7), job.errors
