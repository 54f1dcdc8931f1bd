"""A handler abandoned after its timeout while inside a statement of ctx.transaction():
the worker never waits for that statement. The lease keeper (which heartbeats every job
of the worker) decided the timeout and rolled the transaction back on the handler's
connection, so it waited as long as the statement ran: no heartbeat for any job, every
lease running out under running handlers. Now the statement is cancelled, the connection
closed (the server rolls the transaction back), and the keeper goes on at once."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

import errands
from errands import JobState
from tests.conftest import running_worker
from tests.integration.helpers import wait_until


def _lease_expiry(app: errands.App, job_id: int) -> float:
    job = app.get_job(job_id)
    assert job.lease_expires_at is not None
    return job.lease_expires_at.timestamp()


def test_a_handler_stuck_in_a_statement_is_abandoned_without_freezing_the_lease_keeper(
    pg_url: str,
) -> None:
    app = errands.App(pg_url, lease=3.0)  # a heartbeat a second
    conninfo: Any = app.backend.config.conninfo  # type: ignore[attr-defined]

    @app.job(name="stuck.sleeper", timeout=0.3, retries=1, backoff=60)
    def sleeper(ctx: errands.Context) -> None:
        ctx.transaction().execute("SELECT pg_sleep(60)")  # psycopg's wait: no interrupt lands

    @app.job(name="stuck.steady", retries=0)
    def steady() -> str:
        time.sleep(6)
        return "done"

    try:
        stuck, other = sleeper.enqueue(), steady.enqueue()
        with running_worker(app, concurrency=2, abandon_after=0.5):
            job = wait_until(
                lambda: (j := stuck.job()).state is JobState.RETRYABLE and j,
                what="the stuck handler to be abandoned",
                timeout=10,
            )
            assert "abandoned" in job.errors[-1].message
            # The keeper goes on heartbeating the other job: its lease moves forward.
            first = _lease_expiry(app, other.id)
            wait_until(
                lambda: _lease_expiry(app, other.id) > first,
                what="a heartbeat after the abandonment",
                timeout=5,
            )
            # The stuck statement was cancelled: no session sleeps on.
            with psycopg.connect(conninfo, autocommit=True) as conn:
                wait_until(
                    lambda: (
                        not conn.execute(
                            "SELECT 1 FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(60)'"
                        ).fetchall()
                    ),
                    what="the abandoned statement to be cancelled",
                    timeout=5,
                )
            assert other.result(timeout=20) == "done"
    finally:
        app.close()


def test_a_handler_abandoned_while_it_waits_for_a_transaction_never_holds_up_the_keeper(
    pg_url: str,
) -> None:
    """The handler waits for a ctx.transaction() connection (a pool of one, held by
    another job) when its timeout abandons it: letting its transaction go waited for the
    lock the handler held while it waited (up to the pool's 30 s), on the lease keeper,
    so no job was heartbeated meanwhile."""
    sep = "&" if "?" in pg_url else "?"
    app = errands.App(f"{pg_url}{sep}tx_pool_size=1", lease=3.0)

    @app.job(name="pool.holder")
    def holder(ctx: errands.Context) -> None:
        ctx.transaction()
        time.sleep(8)

    @app.job(name="pool.waiter", timeout=0.3, retries=1, backoff=60)
    def waiter(ctx: errands.Context) -> None:
        ctx.transaction()  # waits for the one connection

    @app.job(name="pool.steady")
    def steady() -> str:
        time.sleep(6)
        return "done"

    try:
        holder.enqueue()
        time.sleep(0.05)
        stuck, other = waiter.enqueue(), steady.enqueue()
        with running_worker(app, concurrency=3, abandon_after=0.5):
            wait_until(
                lambda: stuck.job().state is JobState.RETRYABLE,
                what="the waiting handler to be abandoned",
                timeout=10,
            )
            first = _lease_expiry(app, other.id)
            wait_until(
                lambda: _lease_expiry(app, other.id) > first,
                what="a heartbeat after the abandonment",
                timeout=5,
            )
            assert other.result(timeout=20) == "done"
    finally:
        app.close()


def test_an_async_handler_stopped_by_its_timeout_never_blocks_the_event_loop(
    pg_url: str,
) -> None:
    """An async handler runs a statement of its ctx.atransaction() (on the transaction's
    thread) and is stopped by its timeout: the thread goes on in the statement. Deciding
    the timeout rolled the transaction back on the event loop, which waited for that
    statement: every async job of the worker stood still meanwhile."""
    app = errands.App(pg_url)

    @app.job(name="loop.slow_tx", timeout=0.3, retries=1, backoff=60)
    async def slow_tx(ctx: errands.Context) -> None:
        tx = await ctx.atransaction()
        await tx.execute("SELECT pg_sleep(30)")

    @app.job(name="loop.quick")
    async def quick() -> str:
        return "quick"

    try:
        stuck = slow_tx.enqueue()
        with running_worker(app, concurrency=4):
            wait_until(lambda: stuck.job().state is JobState.RUNNING, what="its start")
            time.sleep(1.0)  # its timeout (0.3 s) has fired; its thread is in pg_sleep
            # not behind the 30 s statement (the loop waited for it)
            assert quick.enqueue().result(timeout=15) == "quick"
            wait_until(
                lambda: stuck.job().state is JobState.RETRYABLE,
                what="the async handler's timeout recorded",
                timeout=10,
            )
    finally:
        app.close()


def test_an_async_handler_that_catches_its_timeouts_cancel_in_a_statement_is_let_go_of(
    pg_url: str,
) -> None:
    """An async handler's statement of ctx.atransaction() runs on the transaction's
    thread when its timeout cancels it; the handler catches the CancelledError and
    returns. The task counted as not stopped (only a JobTimeout or Interrupted did), so
    its outcome was committed (or its transaction rolled back) on that connection, which
    waited for the 30 s statement. The worker lets go of it instead: the statement is
    cancelled and the timeout recorded at once."""
    import asyncio

    app = errands.App(pg_url)
    conninfo: Any = app.backend.config.conninfo  # type: ignore[attr-defined]

    @app.job(name="loop.slow_tx_caught", timeout=0.3, retries=1, backoff=60)
    async def slow_tx(ctx: errands.Context) -> str:
        tx = await ctx.atransaction()
        try:
            await tx.execute("SELECT pg_sleep(30)")
        except asyncio.CancelledError:
            return "gave up"
        return "slept"

    try:
        stuck = slow_tx.enqueue()
        with running_worker(app, concurrency=4):
            job = wait_until(
                lambda: (j := stuck.job()).state.value in ("retryable", "completed") and j,
                what="the caught timeout recorded (not after the 30 s statement)",
                timeout=10,
            )
            assert job.state is JobState.RETRYABLE, (job.state, job.result)
            assert [e.type for e in job.errors] == ["JobTimeout"]
            with psycopg.connect(conninfo, autocommit=True) as conn:
                wait_until(
                    lambda: (
                        not conn.execute(
                            "SELECT 1 FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(30)'"
                        ).fetchall()
                    ),
                    what="the statement to be cancelled",
                    timeout=5,
                )
    finally:
        app.close()


def test_an_async_handlers_transaction_is_committed_off_the_event_loop(pg_url: str) -> None:
    """An async handler's ctx.transaction() is committed with its completion, which may
    wait on a lock (a row another session holds, a workflow's fan-in). That commit ran on
    the worker's event loop: every async job of the worker stood still until the lock
    was let go. Here another session holds the job's row while the commit waits for it,
    and an unrelated async job still runs to its end."""
    import threading

    app = errands.App(pg_url)
    conninfo: Any = app.backend.config.conninfo  # type: ignore[attr-defined]
    started, go = threading.Event(), threading.Event()

    @app.job(name="loop.tx_commit", retries=0)
    async def with_tx(ctx: errands.Context) -> str:
        return await _in_a_transaction_until(ctx, started, go)

    @app.job(name="loop.unrelated")
    async def unrelated() -> str:
        return "ran"

    try:
        first = with_tx.enqueue()
        with running_worker(app, concurrency=4), psycopg.connect(conninfo) as holder:
            assert started.wait(15)
            schema = app.backend.config.schema  # type: ignore[attr-defined]
            holder.execute(
                f'SELECT 1 FROM "{schema}".errands_jobs WHERE id = %s FOR UPDATE', (first.id,)
            )
            go.set()  # its completion now waits for the row, in the commit of its transaction
            wait_until(
                lambda: _waiting_on_a_lock(conninfo, schema),
                what="the commit to wait on the row lock",
            )
            assert unrelated.enqueue().result(timeout=15) == "ran"
            holder.rollback()  # the row let go: the commit goes through
            assert first.result(timeout=15) == "committed"
    finally:
        app.close()


async def _in_a_transaction_until(ctx: errands.Context, started: Any, go: Any) -> str:
    """An async handler's body: a statement in its ctx.atransaction(), ``started`` set,
    then awaiting until ``go`` is set; its result is committed in that transaction."""
    import asyncio

    tx = await ctx.atransaction()
    await tx.execute("SELECT 1")
    started.set()
    while not go.is_set():
        await asyncio.sleep(0.01)
    return "committed"


def _waiting_on_a_lock(conninfo: Any, schema: str) -> bool:
    """Whether a statement on ``schema``'s tables waits for a lock."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database() AND position(%s in query) > 0",
            (f'"{schema}".',),
        ).fetchone()
    return bool(row and row[0])


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_graceful_stop_waits_for_a_commit_of_ctx_transaction_held_on_a_lock(
    pg_url: str, kind: str
) -> None:
    """A handler returned and its outcome is being committed in its own transaction,
    which waits for a row lock, when the worker is asked to stop. The stop waited only
    for the attempt to be decided: it returned with the commit still waiting, the
    process ended, the server rolled the work back and the job, which had succeeded,
    was rescued as lost. The stop waits for the commit, within its grace period."""
    import threading

    app = errands.App(pg_url)
    conninfo: Any = app.backend.config.conninfo  # type: ignore[attr-defined]
    schema = app.backend.config.schema  # type: ignore[attr-defined]
    started, go = threading.Event(), threading.Event()

    if kind == "sync":

        @app.job(name="stop.tx_sync", retries=0)
        def with_tx(ctx: errands.Context) -> str:
            ctx.transaction().execute("SELECT 1")
            started.set()
            go.wait(15)
            return "committed"

    else:

        @app.job(name="stop.tx_async", retries=0)
        async def with_tx(ctx: errands.Context) -> str:
            return await _in_a_transaction_until(ctx, started, go)

    try:
        handle = with_tx.enqueue()
        with psycopg.connect(conninfo) as holder:
            with running_worker(app, concurrency=2, grace=20):
                assert started.wait(15)
                holder.execute(
                    f'SELECT 1 FROM "{schema}".errands_jobs WHERE id = %s FOR UPDATE',
                    (handle.id,),
                )
                go.set()  # its completion now waits for the row, in its transaction's commit
                wait_until(
                    lambda: _waiting_on_a_lock(conninfo, schema),
                    what="the commit to wait on the row lock",
                )
                # the row is let go of a second into the stop
                letting_go = threading.Timer(1.0, holder.rollback)
                letting_go.start()
            # the worker has stopped: its job's outcome is committed, not left behind
            job = handle.job()
            letting_go.join()
            assert job.state is JobState.COMPLETED, (job.state, job.errors)
    finally:
        app.close()


@pytest.mark.parametrize("form", ["atransaction", "to_thread"])
def test_an_async_handler_ending_while_its_thread_waits_for_a_transaction_never_blocks_the_loop(
    pg_url: str, form: str
) -> None:
    """An async handler asks for its transaction (``await ctx.atransaction()``, or
    ctx.transaction() in asyncio.to_thread), which waits on a thread for the pool's one
    connection (held by another job), holding the attempt's lock meanwhile; its timeout
    ends the handler. Ending the attempt (no step or transaction may start from then on)
    never waits for that lock on the event loop: another async job runs on meanwhile,
    not after the holder lets go."""
    import asyncio

    sep = "&" if "?" in pg_url else "?"
    app = errands.App(f"{pg_url}{sep}tx_pool_size=1")
    holding, done = threading.Event(), threading.Event()

    @app.job(name="loop.holder")
    def holder(ctx: errands.Context) -> None:
        ctx.transaction()
        holding.set()
        done.wait(20)  # let go once the test has its answer (the stop waited 20 s)

    @app.job(name="loop.waiter", timeout=0.3, retries=1, backoff=60)
    async def waiter(ctx: errands.Context) -> None:
        if form == "atransaction":  # waits for the one connection
            await ctx.atransaction()
        else:
            await asyncio.to_thread(ctx.transaction)

    @app.job(name="loop.quick")
    async def quick() -> str:
        return "quick"

    try:
        with running_worker(app, concurrency=4, abandon_after=30):
            holder.enqueue()
            assert holding.wait(15)
            stuck = waiter.enqueue()
            wait_until(lambda: stuck.job().state is JobState.RUNNING, what="its start")
            time.sleep(1.0)  # its timeout (0.3 s) has fired; its thread waits for the pool
            assert quick.enqueue().result(timeout=10) == "quick"  # not behind the 20 s
            done.set()
    finally:
        done.set()
        app.close()
