"""An interrupt (a timeout's HandlerInterrupt, a self-fence's) that lands as a handler
opens ``ctx.transaction()`` leaves nothing behind: no pool connection, no write lock.

The worker stops a sync handler by raising HandlerInterrupt inside its thread, wherever it
is. Landing just after the store handed the attempt its transaction and before the
attempt held it, it orphaned that transaction: on PostgreSQL the handler pool's connection
was never given back (the pool is as large as the worker's concurrency: with one slot,
every later ``ctx.transaction()`` waited 30 s and failed with PoolTimeout); on SQLite an
open write transaction nobody owned. The tests aim the interrupt, the worker's own way,
at that instant (chosen with a profile hook on the handler thread).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest

import errands
from errands.worker.runtime import AttemptRuntime
from errands.worker.worker import Worker


def _aim_when_opened(worker: list[Worker], aimed: list[str]) -> Any:
    """A profile hook: interrupt the handler's attempt as the store returns its
    ``ctx.transaction()`` connection to the attempt (the first attempt only)."""
    caller = AttemptRuntime.transaction.__code__

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if not threading.current_thread().name.startswith("errands-job"):
            sys.setprofile(None)  # only the handler threads are watched
            return
        back = frame.f_back
        if event != "return" or aimed or frame.f_code.co_name != "tx_begin" or back is None:
            return
        if back.f_code is caller:
            aimed.append("opened")
            [attempt] = worker[0].attempts()
            worker[0].threads.interrupt(attempt.future)  # type: ignore[arg-type]

    return hook


def test_an_interrupt_as_a_transaction_opens_leaves_no_connection_or_lock_behind(
    store: errands.App, worker: Callable[..., Any]
) -> None:
    """Given a worker with one slot, when HandlerInterrupt is aimed at a handler the
    instant its ``ctx.transaction()`` is opened, then that attempt fails with the
    interrupt and its transaction is rolled back, and the retry opens a transaction of its
    own at once and commits its write with the job."""
    app = store
    app.backend.migrate()

    @app.job(name="writes", retries=2, backoff=0.05)
    def writes(ctx: errands.Context) -> int:
        conn = ctx.transaction()
        conn.execute("SELECT 1")
        for _ in range(1000 if ctx.attempt == 1 else 0):  # the interrupt lands here
            time.sleep(0.01)
        return ctx.attempt

    handle = writes.enqueue()
    holder: list[Worker] = []
    aimed: list[str] = []
    threading.setprofile(_aim_when_opened(holder, aimed))  # the handler threads start now
    try:
        with worker(concurrency=1, maintenance=False) as w:
            holder.append(w)
            assert handle.result(timeout=20) == 2
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    job = app.get_job(handle.id)
    assert aimed == ["opened"]
    assert [e.type for e in job.errors] == ["HandlerInterrupt"]


class _Held(logging.Handler):
    """A logging handler whose lock the test holds, as another thread writing would."""

    def emit(self, record: logging.LogRecord) -> None:
        pass


def test_a_timeout_never_lands_in_a_logging_handlers_lock(
    store: errands.App, worker: Callable[..., Any]
) -> None:
    """Given a handler blocked on a logging handler's lock (another thread is writing)
    when its timeout's interrupt is due, then the interrupt waits until the handler is out
    of the logging call and stops it there, and the logging handler's lock is free after.
    Landing as the lock was taken (the moment the blocked acquire returned), it left the
    lock held for good: every later log line through that handler, in every thread, hung."""
    app = store
    held = _Held()
    logger = logging.getLogger(f"errands.tests.held.{id(held)}")
    logger.addHandler(held)
    logger.propagate = False
    logging_now = threading.Event()

    @app.job(name="logs", timeout=0.2, retries=0)
    def logs() -> None:
        logging_now.set()
        logger.warning("blocked until the test lets go of the handler's lock")
        for _ in range(1000):  # the interrupt lands here
            time.sleep(0.01)

    handle = logs.enqueue()
    held.acquire()
    try:
        with worker(concurrency=1, maintenance=False):
            assert logging_now.wait(20)
            time.sleep(1.8)  # past the deadline and the interrupt 1 s after it
            held.release()
            with pytest.raises(errands.JobFailed):
                handle.result(timeout=20)
            job = handle.job()
    finally:
        logger.removeHandler(held)
    assert job.state == "dead", job
    assert [e.type for e in job.errors] == ["JobTimeout"]
    free = held.lock.acquire(timeout=2)  # type: ignore[union-attr]
    assert free, "the logging handler's lock was left held by the interrupted handler"
    held.lock.release()  # type: ignore[union-attr]
