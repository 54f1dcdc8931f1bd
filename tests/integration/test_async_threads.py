"""The threads of a worker's async jobs: errands' own work off the event loop never waits
for the handlers' ``asyncio.to_thread`` calls, and those get a thread per slot."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import errands
from tests.conftest import running_worker


def _until(predicate: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_async_jobs_run_while_handlers_hold_every_thread_of_the_loops_default_executor(
    app: errands.App,
) -> None:
    """errands' own work for an async job (decoding its payload, a step's read and store,
    encoding its result) ran in the event loop's default executor, shared with the
    handlers' asyncio.to_thread calls (what docs/async.md tells them to use for blocking
    code): six handlers awaiting a slow call there held every other async job, and one
    with a 5 s timeout timed out before it began. Here two handlers hold every thread of
    that executor: an async job with a payload, a step and a result runs to its end
    meanwhile."""
    release = threading.Event()
    lock = threading.Lock()
    busy = [0]

    def hold() -> None:
        with lock:
            busy[0] += 1
        release.wait(60)

    @app.job(name="threads.hog")
    async def hog(n: int) -> int:
        await asyncio.gather(*(asyncio.to_thread(hold) for _ in range(40)))
        return n

    async def double(n: int) -> int:
        return 2 * n

    @app.job(name="threads.quick", timeout=30, retries=0)
    async def quick(ctx: errands.Context, n: int) -> int:
        return int(await ctx.astep("double", double, n))

    with running_worker(app, concurrency=4):
        hogs = [hog.enqueue(n=i) for i in range(2)]
        try:
            threads = min(32, (os.cpu_count() or 1) + 4)  # the executor's, at -c 4
            _until(lambda: busy[0] >= threads, "every thread of the executor held")
            assert quick.enqueue(n=21).result(timeout=30) == 42
        finally:
            release.set()
        assert [h.result(timeout=60) for h in hogs] == [0, 1]


def test_each_slot_of_an_async_worker_gets_a_thread_for_its_handlers_to_thread_calls(
    app: errands.App,
) -> None:
    """The worker's event loop had asyncio's default executor, min(32, cpu + 4) threads
    (6 on a 2-core machine), for the handlers' asyncio.to_thread calls: at -c 40, 34
    async jobs each awaiting one blocking call waited for another job's to end. It has a
    thread per slot now: 40 jobs whose blocking calls return only once all 40 are in
    (a barrier) all complete."""
    slots = 40
    barrier = threading.Barrier(slots, timeout=30)

    @app.job(name="threads.meet", retries=0)
    async def meet(n: int) -> int:
        await asyncio.to_thread(barrier.wait)
        return n

    with running_worker(app, concurrency=slots):
        handles = app.enqueue_many(meet.bind(n=i) for i in range(slots))
        assert [h.result(timeout=90) for h in handles] == list(range(slots))
