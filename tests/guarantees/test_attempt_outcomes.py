"""What an attempt's end is recorded as, on every path (issue 16: A3, A4, A6, A8, A9,
A10). Each test runs on both backends with a real in-process worker.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from contextlib import closing
from typing import Any

import pytest

import errands
from errands.backends.base import HeartbeatResult
from errands.jobs import JobState

from .helpers import execute, force_rescue, is_postgres, query, wait_until

Worker = Callable[..., Any]


def _spin_until_cancelled(ctx: errands.Context, limit: float = 20.0) -> None:
    deadline = time.monotonic() + limit
    while not ctx.cancelled and time.monotonic() < deadline:
        time.sleep(0.01)


# -- A3: returning after being asked to stop is not a completion ---------------------------
def test_a_sync_handler_that_returns_after_an_operator_cancel_ends_cancelled(
    store: errands.App, worker: Worker
) -> None:
    """``if ctx.cancelled: return`` after an operator's cancel: the job ends cancelled,
    with no result, never completed."""
    started = threading.Event()

    @store.job(name="reason.cancel")
    def polite(ctx: errands.Context) -> str:
        started.set()
        _spin_until_cancelled(ctx)
        return "stopped early"

    with worker():
        handle = polite.enqueue()
        assert started.wait(30)
        store.cancel(handle.id)
        wait_until(lambda: handle.status() is JobState.CANCELLED, timeout=30, what="cancelled")
    job = handle.job()
    assert job.result is None
    assert job.last_error is not None and job.last_error.kind == "cancelled"


def test_an_async_handler_that_catches_an_operator_cancel_and_returns_ends_cancelled(
    store: errands.App, worker: Worker
) -> None:
    """The async form: the handler catches the CancelledError of an operator's cancel
    and returns a value. It stopped early: the job ends cancelled, its result dropped
    (docs/concurrency.md, concepts.md and design-notes.md said completed)."""
    started = threading.Event()

    @store.job(name="reason.cancel_async")
    async def polite() -> str:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            return "finished its work on the way out"
        return "slept"

    with worker():
        handle = polite.enqueue()
        assert started.wait(30)
        store.cancel(handle.id)
        wait_until(lambda: handle.status() is JobState.CANCELLED, timeout=30, what="cancelled")
    job = handle.job()
    assert job.result is None
    assert job.last_error is not None and job.last_error.kind == "cancelled"


def test_a_self_fenced_handler_that_returns_is_released_uncharged_not_completed(
    store: errands.App, worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given heartbeats that cannot reach the store, the worker stops the handler before
    its lease runs out; a handler that then returns has not done its work, and the store
    being out of reach is not the job's failure: the job is given back (released, the
    attempt not charged, the release recorded), never completed, never charged."""
    started = threading.Event()

    @store.job(name="reason.fenced", retries=3)
    def polite(ctx: errands.Context) -> str:
        started.set()
        _spin_until_cancelled(ctx)
        return ctx.cancel_reason

    def unreachable(leases: Any) -> HeartbeatResult:
        raise OSError("the store is unreachable (test)")

    monkeypatch.setattr(store.backend, "job_heartbeat_many", unreachable)
    with worker(maintenance=False):
        handle = polite.enqueue()
        assert started.wait(30)
        wait_until(lambda: handle.job().errors, timeout=30, what="the attempt recorded")
    job = handle.job()
    assert (job.state, job.attempt, job.result) == (JobState.AVAILABLE, 0, None)
    [released] = job.errors
    assert (released.kind, released.attempt) == ("released", 1)
    assert "lease could not be renewed" in released.message


# -- A8: heartbeats matched by id and token ---------------------------------------------------
def test_a_stale_attempt_beside_a_newer_one_in_the_same_worker_is_told_its_lease_is_lost(
    store: errands.App, worker: Worker
) -> None:
    """Given attempt 1 still running when its lease was taken away, and attempt 2 of the
    same job claimed by the same worker, then the heartbeat extends attempt 2 only and
    tells attempt 1 its lease is lost (matched by id *and* lease token)."""
    first_started, second_started, release = threading.Event(), threading.Event(), threading.Event()
    reasons: list[str] = []

    @store.job(name="reason.stale", retries=3)
    def work(ctx: errands.Context) -> None:
        if ctx.attempt == 1:
            first_started.set()
            _spin_until_cancelled(ctx, 30)
            reasons.append(ctx.cancel_reason)
            return
        second_started.set()
        release.wait(30)

    try:
        with worker(concurrency=2, maintenance=False):
            handle = work.enqueue()
            assert first_started.wait(30)
            force_rescue(store, handle.id)
            assert second_started.wait(30), "the rescued job was not claimed again"
            wait_until(lambda: reasons, timeout=15, what="attempt 1 told its lease is lost")
            release.set()
            wait_until(lambda: handle.status() is JobState.COMPLETED, timeout=30, what="completed")
    finally:
        release.set()
    assert reasons == ["lease lost"]


# -- A4: a claim round starts or releases everything it claimed -------------------------------
def test_a_claim_round_that_fails_partway_starts_the_jobs_it_already_claimed(
    store: errands.App, worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a worker on a plain queue and a limited one whose claim fails every time
    (a killed session, a busy file), then the plain queue's jobs, claimed earlier in the
    same round, run at once: attempt 1, no lost-worker record."""
    store.queue("limited", limit=1)

    @store.job(name="round.plain", queue="plain")
    def plain(n: int) -> int:
        return n

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError("connection lost (test)")

    monkeypatch.setattr(store.backend, "job_claim_limited", broken)
    handles = [plain.enqueue(n=i) for i in range(5)]
    with worker(queues="plain,limited", concurrency=5):
        assert [h.result(timeout=30) for h in handles] == list(range(5))
    for handle in handles:
        job = handle.job()
        assert (job.attempt, job.errors, job.rescues) == (1, [], 0)


# -- A6: one idempotency key for a job's whole life ------------------------------------------
def test_the_idempotency_key_of_a_unique_for_job_is_its_own_for_its_whole_life(
    store: errands.App, worker: Worker
) -> None:
    """Given job A enqueued with key 'k' and unique_for, failing its first attempt; when
    the period passes and job B is enqueued with the same key, then A's retry sees the
    same ctx.idempotency_key as its first attempt, and B sees another one."""
    seen: dict[tuple[int, int], str] = {}

    @store.job(name="keys.charge", retries=2)
    def charge(ctx: errands.Context, order: int) -> None:
        seen[(ctx.job_id, ctx.attempt)] = ctx.idempotency_key
        if order == 1 and ctx.attempt == 1:
            raise errands.Retry("provider timeout", after=1.0)

    first = charge.enqueue(order=1, key="k", unique_for=0.3)
    with worker():
        wait_until(lambda: (first.id, 1) in seen, timeout=30, what="A's first attempt")
        wait_until(
            lambda: store.backend.db_now() > first.job().inserted_at.timestamp() + 0.4,
            timeout=10,
            what="the key's unique_for period over",
        )
        second = charge.enqueue(order=2, key="k", unique_for=0.3)
        assert second.id != first.id and not second.deduplicated
        wait_until(lambda: first.status() is JobState.COMPLETED, timeout=30, what="A completed")
        wait_until(lambda: second.status() is JobState.COMPLETED, timeout=30, what="B completed")
    assert seen[(first.id, 1)] == seen[(first.id, 2)]
    assert seen[(second.id, 1)] != seen[(first.id, 1)]


# -- A9: ctx.transaction() cannot be ended early ------------------------------------------------
@pytest.fixture
def effects_table(store: errands.App) -> str:
    store.migrate()
    execute(store, "CREATE TABLE errands_test_effects (job_id integer, n integer)")
    return "errands_test_effects"


def _effects(store: errands.App, job_id: int) -> int:
    return int(
        query(store, "SELECT count(*) FROM errands_test_effects WHERE job_id = ?", (job_id,))[0][0]
    )


def _insert(store: errands.App) -> str:
    table = "errands_test_effects"
    if is_postgres(store):
        return f'INSERT INTO "{store.backend.schema}".{table} (job_id, n) VALUES (%s, 1)'  # type: ignore[attr-defined]
    return f"INSERT INTO {table} (job_id, n) VALUES (?, 1)"


@pytest.mark.parametrize("statement", ["COMMIT", "commit; select 1", "END", "ROLLBACK", "BEGIN"])
def test_statements_that_would_end_the_transaction_are_refused_when_made(
    store: errands.App, worker: Worker, effects_table: str, statement: str
) -> None:
    """``tx.execute('COMMIT')`` (or END, ROLLBACK, ...) raises TransactionEnded at the
    call; the job fails for good and its writes are rolled back."""
    insert = _insert(store)

    @store.job(name="tx.ender", retries=3)
    def ender(ctx: errands.Context) -> None:
        tx = ctx.transaction()
        tx.execute(insert, (ctx.job_id,))
        tx.execute(statement)

    handle = ender.enqueue()
    with worker():
        wait_until(lambda: handle.status() is JobState.DEAD, timeout=30, what="dead")
    job = handle.job()
    assert (job.attempt, job.last_error.type) == (1, "TransactionEnded")  # type: ignore[union-attr]
    assert _effects(store, handle.id) == 0


def test_a_transaction_ended_through_the_raw_connection_fails_the_job_loudly_and_once(
    store: errands.App, worker: Worker, effects_table: str
) -> None:
    """Given a handler that commits errands' transaction through ``tx.raw`` and then
    fails, then the job is dead (TransactionEnded) after that one attempt, so its
    committed write exists once, not once per retry."""
    insert = _insert(store)

    @store.job(name="tx.raw", retries=3)
    def sneaky(ctx: errands.Context) -> None:
        tx = ctx.transaction()
        tx.execute(insert, (ctx.job_id,))
        tx.raw.execute("COMMIT")
        raise ValueError("failed after committing")

    @store.job(name="tx.raw_ok", retries=3)
    def sneaky_ok(ctx: errands.Context) -> None:
        tx = ctx.transaction()
        tx.execute(insert, (ctx.job_id,))
        tx.raw.execute("COMMIT")

    failing, returning = sneaky.enqueue(), sneaky_ok.enqueue()
    with worker():
        wait_until(
            lambda: failing.status() is JobState.DEAD, timeout=30, what="the failing job dead"
        )
        wait_until(
            lambda: returning.status() is JobState.DEAD, timeout=30, what="the returning job dead"
        )
    for handle in (failing, returning):
        job = handle.job()
        assert (job.attempt, job.last_error.type) == (1, "TransactionEnded"), job  # type: ignore[union-attr]
        assert _effects(store, handle.id) == 1


def test_executescript_and_isolation_level_are_refused_on_the_transaction_connection() -> None:
    """sqlite3's ``executescript`` commits the open transaction first, and so does setting
    its ``isolation_level`` to None: both refused (PostgreSQL has neither)."""
    import sqlite3

    from errands.worker.runtime import TransactionConnection

    with closing(sqlite3.connect(":memory:")) as conn:
        with pytest.raises(errands.TransactionEnded, match="executescript"):
            TransactionConnection(conn).executescript("SELECT 1")
        with pytest.raises(errands.TransactionEnded, match="executescript"):
            TransactionConnection(conn).cursor().executescript("SELECT 1")
        with pytest.raises(errands.TransactionEnded, match="isolation_level"):
            TransactionConnection(conn).isolation_level = None


# -- A10: a graceful-stop release leaves a trace and stops the handler --------------------------
def test_a_release_at_shutdown_is_recorded_and_the_handler_is_interrupted(
    store: errands.App, worker: Worker
) -> None:
    """Given an embedded worker whose handler ignores ctx.cancelled, when the worker stops
    and its grace period ends, then the job is released uncharged with the release in its
    errors (kind released, attempt 1), and the handler is interrupted as a timeout would."""
    started = threading.Event()
    stopped = threading.Event()

    @store.job(name="release.stubborn")
    def stubborn() -> None:
        started.set()
        try:
            while True:  # ignores ctx.cancelled
                time.sleep(0.01)
        finally:
            stopped.set()

    handle = stubborn.enqueue()
    with worker(grace=0.3):
        assert started.wait(30)
    assert stopped.wait(10), "the handler thread was never interrupted"
    job = handle.job()
    assert (job.state, job.attempt) == (JobState.AVAILABLE, 0)
    [released] = job.errors
    assert (released.kind, released.attempt, released.type) == ("released", 1, "Released")
