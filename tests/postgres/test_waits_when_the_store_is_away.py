"""Waits keep their word while PostgreSQL is away.

``result(timeout=)`` and ``aresult(timeout=)`` keep their timeout while the store cannot
be read. A read during the wait took a connection from the pool, and with none to be had
(every connection taken, or the server away) waited the pool's 30 s, then raised
``psycopg_pool.PoolTimeout`` from deep inside, whatever the wait's own timeout. Now a
read waits for a connection no longer than the time left, an async read is awaited no
longer than that even when it hangs on the server, a failed read is made again until
the deadline, and the deadline's ResultTimeout says the store could not be read.

Waiters are woken when the result watcher's LISTEN connection drops. A waiter asleep
while the store pushes reads again only at its 30 s safety recheck; when that connection
was lost nothing woke it (and ``listening`` stayed set through the pause before the
reconnect), so a job that ended while the watcher was away was seen up to 30 s late.
Now the loss clears ``listening`` at once and wakes every waiter, which polls with
backoff until the watcher listens again."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import psycopg_pool
import pytest

import errands
from errands.backends.postgres import notifier
from errands.results import SAFETY_RECHECK
from tests.conftest import LoopTicks
from tests.pg import with_params

from .harness import wait_until


@pytest.fixture
def shop(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[errands.App]:
    """An App whose pool holds two connections (the least it takes), and a job to wait
    for. Its result watcher, once its connection is lost, tries again only after a
    minute: within a test only polling can see a job end meanwhile."""
    monkeypatch.setattr(notifier, "RECONNECT_FIRST", 60.0)
    app = errands.App(with_params(pg_url, pool_size="2"))

    @app.job(name="away.ship")
    def ship(order: int) -> int:
        return order

    app.migrate()
    assert app.results.ready(), "the result watcher never listened"
    yield app
    app.close()


@contextmanager
def every_connection_taken(app: errands.App) -> Iterator[Callable[[], None]]:
    """Every connection of the App's pool checked out, as by a burst of other calls; the
    block gets the function that gives them back (called at the end too)."""
    pool: Any = app.backend.pool  # type: ignore[attr-defined]
    held = [pool.getconn() for _ in range(pool.max_size)]
    lock = threading.Lock()

    def give_back() -> None:
        with lock:
            while held:
                pool.putconn(held.pop())

    try:
        yield give_back
    finally:
        give_back()


def admin(app: errands.App) -> psycopg.Connection[Any]:
    """A connection of the test's own, beside the App's pool."""
    return psycopg.connect(app.backend.config.conninfo, autocommit=True)  # type: ignore[attr-defined]


def wait(handle: errands.JobHandle, form: str, timeout: float) -> Any:
    if form == "sync":
        return handle.result(timeout=timeout)
    return asyncio.run(handle.aresult(timeout=timeout))


@pytest.mark.parametrize("form", ["sync", "async"])
def test_a_wait_raises_result_timeout_at_its_deadline_while_no_connection_can_be_had(
    shop: errands.App, form: str
) -> None:
    """Every connection taken: the wait ends at its deadline (0.5 s) with ResultTimeout
    saying the store could not be read, the pool's PoolTimeout as its cause (it waited
    the pool's 30 s and raised PoolTimeout)."""
    handle = shop.registry["away.ship"].enqueue(order=1)
    with every_connection_taken(shop):
        started = time.monotonic()
        with pytest.raises(errands.ResultTimeout) as raised:
            wait(handle, form, 0.5)
        elapsed = time.monotonic() - started
    assert elapsed < 1.5, f"ResultTimeout {elapsed:.2f} s after the call (timeout 0.5 s)"
    message = str(raised.value)
    assert f"job {handle.id} (away.ship) is still pending after 0.5 s" in message, message
    assert "the store could not be read (PoolTimeout" in message, message
    assert isinstance(raised.value.__cause__, psycopg_pool.PoolTimeout)


def test_aresult_raises_result_timeout_at_its_deadline_while_its_read_hangs_on_the_server(
    shop: errands.App,
) -> None:
    """The jobs table locked (ACCESS EXCLUSIVE, as a long ALTER holds it): the read gets a
    connection and waits on the server. aresult awaited it until the lock went (3 s
    here); now it gives up at its deadline, its event loop never blocked, and the read
    left behind ends in its thread once the lock goes."""
    handle = shop.registry["away.ship"].enqueue(order=2)
    locker = admin(shop)
    locker.execute("BEGIN")
    locker.execute(f'LOCK TABLE "{shop.backend.schema}".errands_jobs IN ACCESS EXCLUSIVE MODE')  # type: ignore[attr-defined]
    unlock = threading.Timer(3.0, locker.rollback)
    unlock.start()

    async def scenario() -> tuple[BaseException, float, float]:
        with LoopTicks() as ticks:
            started = time.monotonic()
            try:
                await handle.aresult(timeout=0.5)
            except errands.ResultTimeout as exc:
                return exc, time.monotonic() - started, ticks.longest
        raise AssertionError("aresult returned for a job that never ran")

    try:
        raised, elapsed, longest = asyncio.run(scenario())
    finally:
        unlock.join()
        locker.close()
    assert elapsed < 1.5, f"ResultTimeout {elapsed:.2f} s after the call (timeout 0.5 s)"
    assert "the store could not be read (TimeoutError: no answer within" in str(raised)
    assert longest < 0.3, f"the event loop was blocked for {longest:.2f} s"


def test_result_raises_result_timeout_at_its_deadline_while_its_read_hangs_on_the_server(
    shop: errands.App,
) -> None:
    """The jobs table locked (ACCESS EXCLUSIVE, as a long ALTER holds it): the sync
    result(timeout=0.5) waited for as long as the lock was held; now its read runs in
    errands' thread, waited for until the deadline, and the ResultTimeout comes while the
    lock is still held (released 30 s later at the earliest: no timing bound here)."""
    handle = shop.registry["away.ship"].enqueue(order=3)
    locker = admin(shop)
    locker.execute("BEGIN")
    locker.execute(f'LOCK TABLE "{shop.backend.schema}".errands_jobs IN ACCESS EXCLUSIVE MODE')  # type: ignore[attr-defined]
    released = threading.Event()

    def release() -> None:
        released.set()
        locker.rollback()

    unlock = threading.Timer(30.0, release)
    unlock.start()
    try:
        with pytest.raises(errands.ResultTimeout) as raised:
            handle.result(timeout=0.5)
        held_throughout = not released.is_set()
    finally:
        unlock.cancel()
        if not released.is_set():
            release()
        locker.close()
    assert held_throughout, "result() returned only after the lock was released"
    message = str(raised.value)
    assert f"job {handle.id} (away.ship) is still pending after 0.5 s" in message, message
    assert "the store could not be read (TimeoutError: no answer within" in message, message


@pytest.mark.parametrize("form", ["sync", "async"])
def test_a_wait_reads_again_after_a_store_error_and_returns_once_the_store_answers(
    shop: errands.App, form: str
) -> None:
    """The pool's checkouts give up after 0.3 s, long before the wait's 20 s: the first
    PoolTimeout ended the wait. Now the read is made again with backoff, and the wait
    returns the result once a connection is free again (1.5 s later)."""
    handle = shop.registry["away.ship"].enqueue(order=7)
    with admin(shop) as conn:
        conn.execute(
            f"UPDATE \"{shop.backend.schema}\".errands_jobs SET state = 'completed', "  # type: ignore[attr-defined]
            "result = '7'::jsonb, finished_at = now() WHERE id = %s",
            (handle.id,),
        )
    shop.backend.pool.timeout = 0.3  # type: ignore[attr-defined]
    with every_connection_taken(shop) as give_back:
        threading.Timer(1.5, give_back).start()
        started = time.monotonic()
        assert wait(handle, form, 20) == 7
        elapsed = time.monotonic() - started
    assert 1.2 < elapsed < 10, f"returned after {elapsed:.2f} s"


def watcher_sessions(conn: psycopg.Connection[Any]) -> list[int]:
    """The server pids of this process's result watcher (by its application_name)."""
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s",
        (f"errands-results:{os.getpid()}",),
    ).fetchall()
    return [pid for (pid,) in rows]


@pytest.mark.parametrize("form", ["sync", "async"])
def test_a_waiter_asleep_when_the_listen_connection_drops_sees_a_job_end_while_it_is_away(
    shop: errands.App, form: str
) -> None:
    """The watcher's session is terminated while a waiter sleeps (until its safety
    recheck), and the job ends while the watcher is away (its NOTIFY goes nowhere): the
    waiter returns the result within a few seconds, by polling, not at its recheck."""
    handle = shop.registry["away.ship"].enqueue(order=3)
    results: list[Any] = []

    def wait() -> None:
        if form == "sync":
            results.append(handle.result(timeout=20))
        else:
            results.append(asyncio.run(handle.aresult(timeout=20)))

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    wait_until(lambda: shop.results.waiting() == 1, 10, "the waiter to register")
    time.sleep(0.3)  # its first read is done: it sleeps until woken (or its recheck)
    conninfo = shop.backend.config.conninfo  # type: ignore[attr-defined]
    with psycopg.connect(conninfo, autocommit=True) as admin:
        (pid,) = watcher_sessions(admin)
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        wait_until(lambda: not shop.results.pushing, 5, "the hub to see the watcher gone")
        admin.execute(
            f"UPDATE \"{shop.backend.schema}\".errands_jobs SET state = 'completed', "  # type: ignore[attr-defined]
            "result = '3'::jsonb, finished_at = now() WHERE id = %s",
            (handle.id,),
        )
        ended = time.monotonic()
        waiter.join(timeout=25)
        seen = time.monotonic() - ended
        assert watcher_sessions(admin) == [], "the watcher reconnected: not proven by polling"
    assert results == [3]
    assert seen < 5 < SAFETY_RECHECK, f"the end seen {seen:.1f} s late"


def test_a_workflows_aresult_keeps_its_timeout_while_its_members_cannot_be_read(
    shop: errands.App,
) -> None:
    """The workflow settled; its members' table locked (a long ALTER): aresult waited
    for the members' read without a limit after its timeout (and the sync result read
    them after it, waiting the pool's 30 s). The results are read within the timeout."""
    from errands.testing import Tester

    batch = errands.Batch("away.batch")
    batch.add(shop.registry["away.ship"].bind(order=3), name="ship")
    handle = shop.enqueue_workflow(batch)
    with Tester(shop) as tester:
        assert tester.drain_workflow(handle).state == "succeeded"
    locker = admin(shop)
    locker.execute("BEGIN")
    schema = shop.backend.schema  # type: ignore[attr-defined]
    locker.execute(f'LOCK TABLE "{schema}".errands_workflow_members IN ACCESS EXCLUSIVE MODE')
    unlock = threading.Timer(3.0, locker.rollback)
    unlock.start()

    async def scenario() -> tuple[BaseException, float]:
        started = time.monotonic()
        try:
            await handle.aresult(timeout=0.5)
        except errands.ResultTimeout as exc:
            return exc, time.monotonic() - started
        raise AssertionError("aresult read the members through the lock")

    try:
        raised, elapsed = asyncio.run(scenario())
    finally:
        unlock.join()
        locker.close()
    assert elapsed < 1.5, f"ResultTimeout {elapsed:.2f} s after the call (timeout 0.5 s)"
    assert "the store could not be read" in str(raised), raised
    assert handle.result(timeout=5) == {"ship": 3}  # the lock gone: read as ever
