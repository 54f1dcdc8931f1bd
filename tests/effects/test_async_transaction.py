"""``await ctx.atransaction()``: an async handler's completion transaction, opened and used
off the event loop, on SQLite and PostgreSQL.

``ctx.transaction()`` in an ``async def`` handler ran on the worker's event loop: its
opening (SQLite's ``BEGIN IMMEDIATE``, a PostgreSQL pool checkout) and its statements
(a row lock) waited there, and two such jobs locked the loop, every async job of the
worker with it: the one holding the lock could never resume (SQLite: until
``write_timeout``, its heartbeats failing; PostgreSQL: for good). The sync form is
refused there now; ``ctx.atransaction()`` opens the transaction, and runs each of its
statements, on a thread of the transaction's own.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from effects_store import TX_TABLES, EffectsStore

import errands
from errands.testing import Tester
from tests.conftest import running_worker

Make = Callable[..., Any]


def _sql(store_url: str, sql: str) -> str:
    """``sql`` with the effect table qualified and the backend's placeholders."""
    sql = sql.replace("tx_effects", EffectsStore.qualified(store_url, "tx_effects"))
    return sql.replace("%s", "?") if EffectsStore.is_sqlite(store_url) else sql


def _rows(effects: EffectsStore, job_id: int) -> list[tuple[Any, ...]]:
    return effects.execute("SELECT n, attempt FROM tx_effects WHERE job_id = %s", (job_id,))


async def _until(event: threading.Event, limit: float = 30.0) -> None:
    """Wait for ``event`` without holding the loop (it fails the test past ``limit``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not event.is_set():
        assert loop.time() < deadline, "an event the test waits for never came"
        await asyncio.sleep(0.01)


def test_ctx_transaction_in_an_async_handler_raises_naming_await_ctx_atransaction(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    """The sync ctx.transaction() on the event loop of an async def handler opened the
    transaction there (waiting for SQLite's write lock or a pool connection) and gave a
    connection whose statements blocked it: it raises ConfigurationError naming
    ctx.atransaction(), and no transaction is opened. A connection taken on a thread
    (asyncio.to_thread) refuses a statement made back on the loop the same way."""
    app = make_app()
    refused: list[str] = []

    @app.job(name="sync_tx_in_async", retries=0)
    async def sync_tx_in_async(ctx: errands.Context) -> None:
        try:
            ctx.transaction()
        except errands.ConfigurationError as exc:
            refused.append(str(exc))
        tx = await asyncio.to_thread(ctx.transaction)  # allowed: a thread of its own
        try:
            tx.execute("SELECT 1")
        except errands.ConfigurationError as exc:
            refused.append(str(exc))
        await asyncio.to_thread(tx.execute, "SELECT 1")  # allowed there

    handle = sync_tx_in_async.enqueue()
    assert errands_testing(app).drain().outcomes == {"completed": 1}
    assert handle.job().errors == []
    opening, statement = refused
    assert "ctx.transaction()" in opening and "async def handler" in opening
    assert "use `tx = await ctx.atransaction()`" in opening
    assert "event loop" in statement and "await ctx.atransaction()" in statement


def test_async_transaction_writes_commit_with_the_completion_or_roll_back_with_a_failure(
    make_app: Make,
    errands_testing: Callable[..., Tester],
    effects: EffectsStore,
    store_url: str,
) -> None:
    """What ctx.atransaction() writes commits in the transaction that completes the job,
    or not at all: the failed attempt's row is rolled back, the completing attempt's is
    there once. Its cursors read inside the transaction (fetchone, fetchall, ``async
    for``), ``async with`` does what ``with`` does, run_sync hands the sync connection
    over on the transaction's thread, and what would end the transaction is refused."""
    effects.create(TX_TABLES)
    app = make_app()
    seen: list[Any] = []

    @app.job(name="async_record", retries=2, backoff=1.0)
    async def async_record(ctx: errands.Context, n: int) -> int:
        tx = await ctx.atransaction()
        async with tx:
            insert = "INSERT INTO tx_effects (job_id, n, attempt) VALUES (%s, %s, %s)"
            await tx.execute(_sql(store_url, insert), (ctx.job_id, n, ctx.attempt))
        select = _sql(store_url, "SELECT n, attempt FROM tx_effects WHERE job_id = %s")
        again = await ctx.atransaction()  # the same transaction: it sees its own row
        seen.append(await (await again.execute(select, (ctx.job_id,))).fetchall())
        cursor = tx.cursor()
        await cursor.execute(select, (ctx.job_id,))
        seen.append([tuple(row) async for row in cursor])
        count = _sql(store_url, "SELECT count(*) FROM tx_effects")
        seen.append(await tx.run_sync(lambda conn: conn.execute(count).fetchone()[0]))
        with pytest.raises(errands.TransactionEnded):
            await tx.execute("COMMIT")
        with pytest.raises(errands.TransactionEnded):
            tx.commit()
        driver_method = "set_trace_callback" if EffectsStore.is_sqlite(store_url) else "pipeline"
        with pytest.raises(TypeError, match="run_sync"):
            getattr(tx, driver_method)  # it would reach the database on the loop
        if ctx.attempt == 1:
            raise RuntimeError("after the write")
        return n

    tester = errands_testing(app)
    handle = async_record.enqueue(n=7)
    assert tester.drain(with_retries=False).outcomes == {"retryable": 1}
    assert _rows(effects, handle.id) == []  # the failed attempt's write rolled back
    assert tester.drain().completed == 1
    assert _rows(effects, handle.id) == [(7, 2)]
    assert handle.result(timeout=5) == 7
    assert seen == [[(7, 1)], [(7, 1)], 1, [(7, 2)], [(7, 2)], 1]


def test_async_jobs_holding_their_transactions_across_an_await_leave_the_event_loop_running(
    make_app: Make, effects: EffectsStore, store_url: str
) -> None:
    """Job A writes a row in its transaction and awaits; job B, on the same worker's
    loop, asks for its transaction and writes the same row: on SQLite its opening waits
    for A's write lock, on PostgreSQL its UPDATE for A's row lock. With ctx.transaction()
    that wait was on the event loop, where A could never resume: every async job of the
    worker stood still (SQLite: write_timeout, then B failed and A's lease self-fenced;
    PostgreSQL: for good). With ctx.atransaction() it is on B's transaction's thread: a
    third async job keeps running meanwhile, and once A is let go both complete on
    their first attempt, each with its row."""
    effects.create(TX_TABLES)
    effects.execute("INSERT INTO tx_effects (job_id, n, attempt) VALUES (0, 0, 0)")
    app = make_app()
    ticker_up, b_started, a_holds, b_asking, release = (threading.Event() for _ in range(5))
    ticks = [0]

    async def write(ctx: errands.Context) -> None:
        tx = await ctx.atransaction()
        bump = "UPDATE tx_effects SET n = n + 1 WHERE job_id = 0"
        await tx.execute(_sql(store_url, bump))
        insert = "INSERT INTO tx_effects (job_id, n, attempt) VALUES (%s, 1, %s)"
        await tx.execute(_sql(store_url, insert), (ctx.job_id, ctx.attempt))

    @app.job(name="tx.ticker")
    async def ticker() -> int:
        ticker_up.set()
        while not release.is_set():
            ticks[0] += 1
            await asyncio.sleep(0.01)
        return ticks[0]

    @app.job(name="tx.a", retries=0)
    async def job_a(ctx: errands.Context) -> str:
        await _until(ticker_up)
        await _until(b_started)  # (claimed before A takes SQLite's write lock)
        await write(ctx)
        a_holds.set()
        await _until(release, 60)
        return "a"

    @app.job(name="tx.b", retries=0)
    async def job_b(ctx: errands.Context) -> str:
        b_started.set()
        await _until(a_holds)
        b_asking.set()
        await write(ctx)  # waits for A's lock, off the loop
        return "b"

    tick = ticker.enqueue()
    a, b = job_a.enqueue(), job_b.enqueue()
    with running_worker(app, concurrency=4):
        assert b_asking.wait(30)
        before = ticks[0]
        # the loop turns while B waits for the lock A holds (it stood still for good)
        _wait_until(lambda: ticks[0] >= before + 20, "the loop to turn")
        release.set()
        assert (a.result(timeout=60), b.result(timeout=60)) == ("a", "b")
        assert tick.result(timeout=30) > 0
    for handle in (a, b):
        job = handle.job()
        assert (job.state.value, job.attempt, job.errors) == ("completed", 1, [])
        assert _rows(effects, handle.id) == [(1, 1)]
    assert _rows(effects, 0) == [(2, 0)]


def _wait_until(predicate: Callable[[], bool], what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.mark.parametrize("form", ["atransaction", "to_thread"])
def test_a_transaction_opened_after_its_async_handler_gave_up_waiting_is_rolled_back(
    store_url: str, form: str
) -> None:
    """An async handler waits for its transaction on a thread (``ctx.atransaction()``, or
    ctx.transaction() in asyncio.to_thread) while another job holds what it needs
    (SQLite's write lock; PostgreSQL's one handler connection), gives up waiting
    (asyncio.wait_for) and returns. The thread went on waiting, and opened the
    transaction after the attempt was decided without one: nobody ever ended it (on
    SQLite its write lock stalled every later write of the file; on PostgreSQL the pool's
    connection was never given back). It is rolled back there now: the next job that
    needs a transaction runs."""
    sep = "&" if "?" in store_url else "?"
    url = store_url if store_url.startswith("sqlite") else f"{store_url}{sep}tx_pool_size=1"
    app = errands.App(url)
    started, holding, gave_up = threading.Event(), threading.Event(), threading.Event()

    @app.job(name="late.waiter", retries=0)
    async def waiter(ctx: errands.Context) -> str:
        started.set()
        await _until(holding)
        opening = (
            ctx.atransaction() if form == "atransaction" else asyncio.to_thread(ctx.transaction)
        )
        try:
            await asyncio.wait_for(opening, 0.5)
        except TimeoutError:
            gave_up.set()
            return "gave up"
        return "opened"

    @app.job(name="late.holder", retries=0)
    def holder(ctx: errands.Context) -> str:
        assert started.wait(30)
        ctx.transaction()
        holding.set()
        assert gave_up.wait(30)
        return "held"

    @app.job(name="late.next", retries=0)
    def next_job(ctx: errands.Context) -> str:
        ctx.transaction().execute("SELECT 1")
        return "ran"

    try:
        with running_worker(app, concurrency=4):
            waiting = waiter.enqueue()
            assert started.wait(30)
            held = holder.enqueue()
            assert waiting.result(timeout=60) == "gave up"
            assert held.result(timeout=60) == "held"
            assert next_job.enqueue().result(timeout=30) == "ran"
    finally:
        app.close()
