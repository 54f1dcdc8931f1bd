"""Async waits on many jobs, on both stores: ``await errands.await_all(handles)`` and
``async for handle in errands.as_completed(handles)`` wait as their sync forms do (the
same outcomes, order and errors) with one registration for every job, and a cancelled
awaiting task leaves none behind."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable

import pytest

import errands
from tests.conftest import running_worker

NO_POLL = 30.0  # far longer than any test here: a wait that ends sooner was woken


async def until(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_await_all_waits_for_200_jobs_with_one_registration(store: errands.App) -> None:
    """await_all on 200 jobs registers one waiter for all of them (asyncio.gather of
    aresult() made 200, each reading in a thread of its own), returns the handles in the
    order given once all ended, and leaves no registration behind."""
    add, hub = store.registry["results.add"], store.results
    handles = store.enqueue_many(add.bind(a=n, b=1) for n in range(200))

    async def scenario() -> list[errands.JobHandle]:
        waiting = asyncio.ensure_future(errands.await_all(handles, timeout=60, poll=NO_POLL))
        await until(lambda: hub.waiting() == 200, "the 200 jobs to be watched")
        assert hub.waiters() == 1
        with running_worker(store, concurrency=4):
            return await waiting

    assert asyncio.run(scenario()) == handles
    assert [h.result(timeout=1) for h in handles] == [n + 1 for n in range(200)]
    assert hub.waiting() == 0 and hub.waiters() == 0


def test_async_for_over_as_completed_yields_the_jobs_in_the_order_they_end(
    store: errands.App,
) -> None:
    """``async for`` over as_completed yields the quick job before the slow one, woken
    by the store (poll=30 s), as ``for`` does."""
    nap = store.registry["results.nap"]
    slow, quick = nap.enqueue(seconds=1.0), nap.enqueue(seconds=0.05)

    async def scenario() -> list[int]:
        completed = errands.as_completed([slow, quick], timeout=20, poll=NO_POLL)
        return [h.id async for h in completed]

    with running_worker(store, concurrency=2):
        started = time.monotonic()
        assert asyncio.run(scenario()) == [quick.id, slow.id]
        assert time.monotonic() - started < 10
    assert store.results.waiting() == 0


def test_await_all_returns_a_dead_job_without_raising(store: errands.App) -> None:
    """A job that died is over: await_all returns its handle among the others, and
    ``result()`` then raises JobFailed for it."""
    add, fail = store.registry["results.add"], store.registry["results.fail"]
    dead, done = fail.enqueue(), add.enqueue(a=2, b=2)
    with running_worker(store, concurrency=2):
        assert asyncio.run(errands.await_all([dead, done], timeout=20)) == [dead, done]
    with pytest.raises(errands.JobFailed):
        dead.result(timeout=1)
    assert done.result(timeout=1) == 4


def test_await_all_raises_result_timeout_for_jobs_that_do_not_end(store: errands.App) -> None:
    """No worker runs: await_all gives up at its timeout, with ResultTimeout, and its
    registration is gone."""
    add = store.registry["results.add"]
    started = time.monotonic()
    with pytest.raises(errands.ResultTimeout, match="2 job\\(s\\) still not finished"):
        asyncio.run(errands.await_all([add.enqueue(a=1, b=1), add.enqueue(a=2, b=1)], timeout=0.3))
    assert time.monotonic() - started < 3
    assert store.results.waiting() == 0


@pytest.mark.parametrize("form", ["await_all", "async for"])
def test_cancelling_the_awaiting_task_removes_its_registration(
    store: errands.App, form: str
) -> None:
    """The task awaiting the jobs is cancelled while they are pending: CancelledError
    reaches it and the hub watches nothing any more."""
    add, hub = store.registry["results.add"], store.results
    handles = store.enqueue_many(add.bind(a=n, b=0) for n in range(20))

    async def drain() -> None:
        async for _ in errands.as_completed(handles, timeout=60):
            pass

    async def scenario() -> None:
        waits = errands.await_all(handles, timeout=60) if form == "await_all" else drain()
        task = asyncio.ensure_future(waits)
        await until(lambda: hub.waiting() == 20, "the jobs to be watched")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert hub.waiting() == 0 and hub.waiters() == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("form", ["result", "aresult", "wait_all", "await_all"])
def test_a_wait_on_a_job_that_no_longer_exists_raises_job_not_found(
    app: errands.App, form: str
) -> None:
    """A job whose row is gone (pruned) is not waited on until the timeout: every wait
    raises JobNotFound saying so, and leaves no registration."""
    handle = errands.JobHandle(app, 424242, "results.gone")
    waits = {
        "result": lambda: handle.result(timeout=10),
        "aresult": lambda: asyncio.run(handle.aresult(timeout=10)),
        "wait_all": lambda: errands.wait_all([handle], timeout=10),
        "await_all": lambda: asyncio.run(errands.await_all([handle], timeout=10)),
    }
    app.migrate()
    with pytest.raises(errands.JobNotFound, match="job 424242 no longer exists"):
        waits[form]()
    assert app.results.waiting() == 0


def test_leaving_as_completed_early_inside_its_block_removes_the_registration_at_once(
    store: errands.App,
) -> None:
    """An ``async for`` left with ``break`` kept its registration until the event loop
    collected the iterator (the hub read its jobs' rows on every wake meanwhile): the
    ``async with`` block (and ``with`` for the sync form) ends the wait at its end."""
    nap, hub = store.registry["results.nap"], store.results
    quick, never = nap.enqueue(seconds=0.05), nap.enqueue(seconds=0.05, queue="nobody")

    async def scenario() -> int:
        async with errands.as_completed([quick, never], timeout=20, poll=NO_POLL) as ended:
            first = await anext(ended)  # then leave the loop
        assert hub.waiting() == 0 and hub.waiters() == 0  # at once, the iterator alive
        return first.id

    with running_worker(store, concurrency=2):
        assert asyncio.run(scenario()) == quick.id
        with errands.as_completed([quick, never], timeout=20) as ended:
            assert next(ended) is quick
        assert hub.waiting() == 0 and hub.waiters() == 0


def test_aresult_keeps_its_timeout_and_aenqueue_runs_while_the_loops_default_executor_is_busy(
    store: errands.App,
) -> None:
    """errands' async calls ran their blocking parts in the event loop's default executor,
    which the application's own asyncio.to_thread calls share: with its threads all busy,
    aenqueue waited for one, and aresult(timeout=1) took 8 s (its watcher's start waited
    for a thread before the deadline held). They run in errands' own threads now: both
    end while the application's one thread is still busy, the wait at its deadline."""
    nap = store.registry["results.nap"]

    async def scenario() -> bool:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(1))
        release = threading.Event()
        busy = loop.run_in_executor(None, release.wait, 60)  # the application's thread
        try:
            async with asyncio.timeout(30):
                handle = await nap.aenqueue(seconds=0.0)  # no worker: it stays available
                with pytest.raises(errands.ResultTimeout, match="still available"):
                    await handle.aresult(timeout=0.5)
            return release.is_set()
        finally:
            release.set()
            await busy

    assert asyncio.run(scenario()) is False  # ended before the busy thread was let go
