"""Handlers that run past their ``timeout=`` (DESIGN §5): retryable, and the slot is freed."""

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any

import pytest

import errands
from errands import JobState

from .helpers import wait_until


def test_sync_handler_past_its_timeout_is_interrupted_and_retryable_with_job_timeout(
    app: errands.App, worker_factory
) -> None:
    cleaned_up: list[bool] = []

    @app.job(name="timeout.sync_busy", timeout=0.2, retries=1, backoff=60)
    def busy() -> None:
        try:
            while True:  # pure-Python work that never looks at ctx.cancelled
                sum(range(100))
        finally:
            cleaned_up.append(True)

    handle = busy.enqueue()
    with worker_factory(concurrency=1) as worker:
        job = wait_until(
            lambda: (j := handle.job()).state is JobState.RETRYABLE and j,
            what="the busy job to be interrupted",
        )
        assert worker.threads.abandoned == 0

    assert cleaned_up == [True]  # the interrupt ran its finally block
    assert job.attempt == 1
    [error] = job.errors
    assert error.type == "JobTimeout"
    assert error.message == "timed out after 0.2 s"
    assert "HandlerInterrupt" in (error.traceback or "")  # where it was stopped


def test_sync_handler_blocked_past_its_timeout_is_abandoned_and_its_slot_freed(
    app: errands.App, worker_factory
) -> None:
    let_go = threading.Event()
    seen: dict[str, object] = {}

    @app.job(name="timeout.sync_slow", timeout=0.3, retries=1, backoff=60)
    def slow(ctx: errands.Context) -> None:
        let_go.wait(10)  # blocked in C: neither ctx.cancelled nor the interrupt reach it
        seen["cancelled"] = ctx.cancelled
        seen["reason"] = ctx.cancel_reason

    @app.job(name="timeout.quick")
    def quick() -> str:
        return "served"

    handle = slow.enqueue()
    with worker_factory(concurrency=1, abandon_after=0.5) as worker:
        job = wait_until(
            lambda: (j := handle.job()).state is JobState.RETRYABLE and j,
            what="the slow job to be abandoned",
        )
        # the only slot is free again although the overrunning thread is still inside
        assert quick.enqueue().result(timeout=10) == "served"
        assert not seen
        assert worker.threads.abandoned == 1
        let_go.set()
        wait_until(lambda: seen, what="the abandoned handler to return")

    assert seen == {"cancelled": True, "reason": "timeout"}
    assert job.attempt == 1
    [error] = job.errors
    assert error.type == "JobTimeout"
    assert error.message.startswith("timed out after 0.3 s; the handler ignored the interrupt")
    assert handle.status() is JobState.RETRYABLE  # its late return was not recorded


def test_sync_handler_that_polls_ctx_cancelled_stops_at_its_timeout(
    app: errands.App, worker_factory
) -> None:
    observed: list[str] = []

    @app.job(name="timeout.sync_polite", timeout=0.2, retries=1, backoff=60)
    def polite(ctx: errands.Context) -> None:
        for _ in range(1000):
            if ctx.cancelled:
                observed.append(ctx.cancel_reason)
                return
            threading.Event().wait(0.01)

    handle = polite.enqueue()
    with worker_factory():
        wait_until(lambda: observed, what="the handler to see ctx.cancelled")
        wait_until(lambda: handle.status() is JobState.RETRYABLE)

    assert observed == ["timeout"]
    assert [e.type for e in handle.job().errors] == ["JobTimeout"]


def test_async_handler_past_its_timeout_is_retryable_with_job_timeout_and_the_worker_keeps_serving(
    app: errands.App, worker_factory
) -> None:
    interrupted: list[str] = []

    @app.job(name="timeout.async_slow", timeout=0.3, retries=1, backoff=60)
    async def slow() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            interrupted.append("cancelled")
            raise

    @app.job(name="timeout.async_quick")
    async def quick() -> str:
        return "served"

    handle = slow.enqueue()
    with worker_factory(concurrency=1):
        job = wait_until(
            lambda: (j := handle.job()).state is JobState.RETRYABLE and j,
            what="the async job to time out",
        )
        assert quick.enqueue().result(timeout=10) == "served"

    assert interrupted == ["cancelled"]
    assert job.attempt == 1
    [error] = job.errors
    assert error.type == "JobTimeout"
    assert error.message == "timed out after 0.3 s"


@pytest.mark.parametrize("timeout", [None, 30.0])
def test_an_async_handlers_own_timeout_error_is_an_ordinary_failure_not_the_jobs_timeout(
    app: errands.App, worker_factory, timeout: float | None
) -> None:
    """A TimeoutError the handler raises itself (an inner wait_for, a socket) is its own
    failure: retryable, with its own type and message. It was recorded as the job's
    JobTimeout (with timeout=30), or, without a job timeout, as "unsupported format string
    passed to NoneType.__format__"."""

    @app.job(name=f"timeout.own_{timeout}", timeout=timeout, retries=1, backoff=60)
    async def calls_a_service() -> None:
        await asyncio.wait_for(asyncio.sleep(10), 0.01)

    handle = calls_a_service.enqueue()
    with worker_factory(concurrency=1):
        job = wait_until(
            lambda: (j := handle.job()).state is JobState.RETRYABLE and j,
            what="the job's first attempt to fail",
        )
    [error] = job.errors
    assert (error.type, error.kind) == ("TimeoutError", "transient")


def test_an_async_handler_awaiting_a_cancelled_task_fails_and_is_retried_not_cancelled(
    app: errands.App, worker_factory
) -> None:
    """asyncio.CancelledError from a task the handler awaited (nobody asked the job to
    stop) ended the job for good as "cancelled by an operator while running"; it is a
    transient failure now, retried."""

    @app.job(name="timeout.awaits_cancelled", retries=1, backoff=60)
    async def awaits() -> None:
        task = asyncio.ensure_future(asyncio.sleep(10))
        task.cancel()
        await task

    handle = awaits.enqueue()
    with worker_factory(concurrency=1):
        job = wait_until(
            lambda: (j := handle.job()).state is JobState.RETRYABLE and j,
            what="the job's first attempt to fail",
        )
    [error] = job.errors
    assert (error.type, error.kind) == ("HandlerCancelled", "transient")
    assert "without the worker asking it to stop" in error.message


def test_the_lease_keeper_outlives_a_failure_and_still_times_out_the_job(
    app: errands.App, worker_factory, caplog: pytest.LogCaptureFixture
) -> None:
    """Fault injection: the keeper's timeout action raises once (as a helper thread that
    cannot start did). The keeper logs it and goes on: the job is timed out all the
    same, and heartbeats go on. The thread died before, and every lease of the worker
    ran out while its handlers ran on."""

    @app.job(name="timeout.keeper_fault", timeout=0.2, retries=1, backoff=60)
    def busy(ctx: errands.Context) -> None:
        while not ctx.cancelled:
            time.sleep(0.01)

    handle = busy.enqueue()
    with worker_factory(concurrency=1) as worker:
        keeper = worker.leases
        real = keeper.on_timeout
        failed: list[int] = []

        def once_raising(attempt: Any) -> None:
            if not failed:
                failed.append(attempt.id)
                raise RuntimeError("injected: cannot start new thread")
            real(attempt)

        keeper.on_timeout = once_raising
        job = wait_until(
            lambda: (j := handle.job()).state is JobState.RETRYABLE and j,
            what="the job to be timed out after the keeper's failure",
        )
        assert keeper._thread.is_alive()
    assert failed == [handle.id]
    assert [e.type for e in job.errors] == ["JobTimeout"]
    assert any("the lease keeper failed" in r.getMessage() for r in caplog.records)


def test_a_handler_stuck_in_a_sqlite_statement_is_abandoned_and_the_write_lock_freed(
    app: errands.App, worker_factory
) -> None:
    """SQLite: a handler abandoned inside a long statement of ctx.transaction() (which
    holds the store's write lock): the statement is interrupted and the transaction
    rolled back at once, so every other writer goes on; the worker's keeper never waits
    for the statement (tests/postgres/test_abandoned_transaction.py: the same on
    PostgreSQL)."""

    @app.job(name="timeout.sqlite_stuck", timeout=0.3, retries=1, backoff=60)
    def stuck(ctx: errands.Context) -> None:
        ctx.transaction().execute(
            "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c "
            "WHERE x < 10000000000) SELECT count(*) FROM c"
        )

    @app.job(name="timeout.sqlite_after")
    def after() -> str:
        return "written"

    handle = stuck.enqueue()
    with worker_factory(concurrency=2, abandon_after=0.5):
        job = wait_until(
            lambda: (j := handle.job()).state is JobState.RETRYABLE and j,
            what="the stuck handler to be abandoned",
            timeout=15,
        )
        assert "abandoned" in job.errors[-1].message
        assert after.enqueue().result(timeout=10) == "written"  # the write lock is free


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_the_timeout_covers_decoding_the_payload_not_only_the_handler(
    app: errands.App, worker_factory, kind: str
) -> None:
    """A payload validator that hangs while the worker decodes the stored arguments held
    the slot and a heartbeated lease for ever: the deadline began after decoding (and an
    async job's covered only its handler). It runs from the attempt's start now."""
    from typing import Annotated

    from pydantic import AfterValidator

    slow = threading.Event()

    def check(value: int) -> int:
        while slow.is_set():  # hangs in the worker only (not at enqueue)
            time.sleep(0.01)
        return value

    Checked = Annotated[int, AfterValidator(check)]
    if kind == "sync":

        @app.job(name="timeout.decode_sync", timeout=0.3, retries=1, backoff=60)
        def job(n: Checked) -> None: ...

    else:

        @app.job(name="timeout.decode_async", timeout=0.3, retries=1, backoff=60)
        async def job(n: Checked) -> None: ...

    handle = job.enqueue(n=1)
    slow.set()
    try:
        with worker_factory(concurrency=1):
            failed = wait_until(
                lambda: (j := handle.job()).state is JobState.RETRYABLE and j,
                what="the attempt to time out while its payload was decoded",
            )
    finally:
        slow.clear()
    assert failed.errors[-1].type == "JobTimeout"


def test_a_handler_abandoned_with_a_half_read_cursor_leaves_no_write_lock_behind(
    app: errands.App, worker_factory
) -> None:
    """SQLite: abandoned while a cursor of its ctx.transaction() was half read (its
    statement open, not running): an interrupt sent first stayed in effect and made the
    ROLLBACK fail, so the write lock stayed until the handler let go of the cursor. The
    ROLLBACK goes first now."""

    @app.job(name="timeout.half_read", timeout=0.2, retries=1, backoff=60)
    def half_read(ctx: errands.Context) -> None:
        cur = ctx.transaction().execute(
            "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 1000) "
            "SELECT x FROM c"
        )
        cur.fetchone()
        time.sleep(3)  # a C call: the interrupt lands only after it

    @app.job(name="timeout.after_half_read")
    def after() -> str:
        return "written"

    handle = half_read.enqueue()
    with worker_factory(concurrency=2, abandon_after=0.5):
        _abandoned(handle)
        assert after.enqueue().result(timeout=2) == "written"  # no write lock held


def test_a_handler_abandoned_before_it_opened_its_transaction_cannot_open_one(
    app: errands.App, worker_factory
) -> None:
    """Abandoned in a C call before it called ctx.transaction(): when it wakes, the call
    raises (it opened a transaction nobody would ever end, holding SQLite's write lock)."""
    seen: list[str] = []

    @app.job(name="timeout.late_tx", timeout=0.2, retries=1, backoff=60)
    def late(ctx: errands.Context) -> None:
        time.sleep(1.5)
        try:
            ctx.transaction()
            seen.append("opened")
        except errands.TransactionEnded as exc:
            seen.append(str(exc))

    @app.job(name="timeout.after_late_tx")
    def after() -> str:
        return "written"

    handle = late.enqueue()
    with worker_factory(concurrency=2, abandon_after=0.5):
        _abandoned(handle)
        wait_until(lambda: seen, what="the abandoned handler to wake", timeout=15)
        assert "the attempt has ended" in seen[0]
        assert after.enqueue().result(timeout=5) == "written"


def test_an_abandoned_handlers_next_statement_on_its_transaction_is_refused(
    app: errands.App, worker_factory
) -> None:
    """Once its attempt let go of ctx.transaction(), the handler's next statement on it
    raises and nothing it wrote commits (on SQLite a write after the rollback would have
    committed on its own)."""
    seen: list[str] = []

    @app.job(name="timeout.write_after", timeout=0.2, retries=1, backoff=60)
    def writer(ctx: errands.Context) -> None:
        tx = ctx.transaction()
        tx.execute("CREATE TABLE IF NOT EXISTS late_writes (n INTEGER)")
        tx.execute("INSERT INTO late_writes VALUES (1)")
        time.sleep(1.5)  # a C call: abandoned meanwhile
        try:
            tx.execute("INSERT INTO late_writes VALUES (2)")
            seen.append("written")
        except errands.TransactionEnded as exc:
            seen.append(str(exc))

    handle = writer.enqueue()
    with worker_factory(concurrency=1, abandon_after=0.5):
        _abandoned(handle)
        wait_until(lambda: seen, what="the abandoned handler to wake", timeout=15)
    assert "the attempt has ended" in seen[0]
    import sqlite3

    with contextlib.closing(sqlite3.connect(app.url.removeprefix("sqlite:///"))) as conn:
        tables = conn.execute("SELECT name FROM sqlite_master WHERE name = 'late_writes'")
        assert tables.fetchall() == []  # rolled back: the table and both rows


def _abandoned(handle: errands.JobHandle) -> None:
    """Wait for the handler of ``handle`` to be abandoned past its timeout (retryable)."""
    wait_until(
        lambda: handle.job().state is JobState.RETRYABLE,
        what="the handler to be abandoned",
        timeout=15,
    )


class _SlowTimeoutWarning(logging.Handler):
    """Fault injection: delay the worker's "ran past its timeout" log line.

    It widens the window between the worker telling the handler to stop and the worker
    recording the timeout, so a handler that returns at once always falls into it.
    """

    def __init__(self, handler_returned: threading.Event) -> None:
        super().__init__(logging.WARNING)
        self.handler_returned = handler_returned

    def emit(self, record: logging.LogRecord) -> None:
        if "past its" in record.getMessage():
            self.handler_returned.wait(5)
            threading.Event().wait(0.1)  # let the returned handler's done-callback run


def test_sync_handler_returning_as_soon_as_it_sees_its_timeout_is_still_recorded_as_timed_out(
    app: errands.App, worker_factory
) -> None:
    returned = threading.Event()

    @app.job(name="timeout.sync_quick_to_stop", timeout=0.2, retries=1, backoff=60)
    def quick_to_stop(ctx: errands.Context) -> str:
        while not ctx.cancelled:
            threading.Event().wait(0.005)
        returned.set()
        return "partial work"

    slow_log = _SlowTimeoutWarning(returned)
    worker_log = logging.getLogger("errands.worker")
    worker_log.addHandler(slow_log)
    try:
        handle = quick_to_stop.enqueue()
        with worker_factory():
            job = wait_until(
                lambda: (j := handle.job()).state.value in ("retryable", "completed") and j,
                what="the attempt to be recorded",
            )
    finally:
        worker_log.removeHandler(slow_log)

    assert returned.is_set()
    assert job.state is JobState.RETRYABLE, f"recorded as {job.state.value}: {job.result!r}"
    assert [e.type for e in job.errors] == ["JobTimeout"]
    assert job.result is None


@pytest.mark.parametrize("ends", ["returns", "raises"])
def test_async_handler_that_catches_its_timeouts_cancel_and_ends_is_recorded_as_timed_out(
    app: errands.App, worker_factory, monkeypatch: pytest.MonkeyPatch, ends: str
) -> None:
    """An async handler catches the CancelledError of its timeout and returns (or raises
    an error of its own) at once. Its task was cancelled by its ``asyncio.timeout``; the
    lease keeper marks the attempt timed out at the same deadline, from another thread.
    When the handler ended first, its return was recorded as a completion past its
    timeout (and its error as an ordinary failure), its ctx.transaction() committed or
    rolled back under a thread the handler may have left running. Whatever the keeper's
    timing, it is a timeout. Fault injection: the keeper marks it only once the handler
    ended."""
    from errands.worker.execution import Attempt

    ended = threading.Event()
    time_out = Attempt.time_out

    def late_time_out(self: Attempt, now: float) -> bool:
        ended.wait(5)
        threading.Event().wait(0.2)  # the handler's outcome is decided meanwhile
        return time_out(self, now)

    monkeypatch.setattr(Attempt, "time_out", late_time_out)

    @app.job(name="timeout.async_gives_up", timeout=0.3, retries=1, backoff=60)
    async def gives_up() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            ended.set()
            if ends == "raises":
                raise ValueError("cleaning up failed") from None
            return "partial work"
        return "slept"

    handle = gives_up.enqueue()
    with worker_factory():
        job = wait_until(
            lambda: (j := handle.job()).state.value in ("retryable", "completed") and j,
            what="the attempt to be recorded",
        )

    assert ended.is_set()
    assert job.state is JobState.RETRYABLE, f"recorded as {job.state.value}: {job.result!r}"
    assert [e.type for e in job.errors] == ["JobTimeout"]
    assert job.result is None


def test_async_handler_that_swallows_its_cancel_is_abandoned_with_job_timeout_and_its_slot_freed(
    app: errands.App, worker_factory
) -> None:
    """Given an async handler that catches CancelledError and goes on, when its timeout
    passes, then ``abandon_after`` later the timeout is recorded (charged, retryable) and
    its slot serves other jobs. It ran on for good: its lease renewed, never rescued, and
    at the worker's stop released uncharged, to run again at every start."""
    let_go = threading.Event()
    cancels: list[str] = []

    @app.job(name="timeout.async_stubborn", timeout=0.3, retries=1, backoff=60)
    async def stubborn() -> None:
        while not let_go.is_set():
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                cancels.append("swallowed")

    @app.job(name="timeout.async_served")
    async def served() -> str:
        return "served"

    handle = stubborn.enqueue()
    try:
        with worker_factory(concurrency=1, abandon_after=0.5):
            job = wait_until(
                lambda: (j := handle.job()).state is JobState.RETRYABLE and j,
                what="the stubborn async job to be abandoned at its timeout",
            )
            assert served.enqueue().result(timeout=10) == "served"
    finally:
        let_go.set()

    assert cancels  # it was asked to stop, and went on
    assert job.attempt == 1
    [error] = job.errors
    assert error.type == "JobTimeout"
    assert error.message.startswith("timed out after 0.3 s; the handler went on")
    assert handle.status() is JobState.RETRYABLE  # its late return was not recorded


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_job_past_its_timeout_when_the_worker_stops_is_recorded_as_its_timeout_not_released(
    app: errands.App, worker_factory, kind: str
) -> None:
    """Given a handler past its timeout that has not stopped yet (between the cancel and
    its abandonment), when the worker stops, then its timeout is recorded (charged): it
    was released uncharged, and a job that never stops at its timeout ran again at every
    start, never reaching the dead-letter queue."""
    let_go = threading.Event()
    contexts: list[errands.Context] = []

    if kind == "sync":

        @app.job(name="timeout.stop_sync", timeout=0.2, retries=1, backoff=60)
        def stuck(ctx: errands.Context) -> None:
            contexts.append(ctx)
            let_go.wait(30)  # blocked in C: the interrupt does not reach it

    else:

        @app.job(name="timeout.stop_async", timeout=0.2, retries=1, backoff=60)
        async def stuck(ctx: errands.Context) -> None:
            contexts.append(ctx)
            while not let_go.is_set():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(0.05)

    handle = stuck.enqueue()
    try:
        with worker_factory(concurrency=1, abandon_after=60, grace=0.5):
            wait_until(
                lambda: contexts and contexts[0].cancelled, what="the handler's timeout to pass"
            )
    finally:
        let_go.set()

    job = handle.job()
    assert job.state is JobState.RETRYABLE, job.errors
    assert job.attempt == 1
    assert [e.type for e in job.errors] == ["JobTimeout"]


def test_an_async_handler_blocking_the_event_loop_is_reported_with_its_job(
    app: errands.App, worker_factory, caplog: pytest.LogCaptureFixture, monkeypatch
) -> None:
    """An ``async def`` handler that calls blocking code stops the loop every async job
    of the worker shares (their timeouts too), and nothing said so. The loop's watchdog
    logs it, naming the job's task, and again once the loop turns."""
    from errands.worker import runners

    monkeypatch.setattr(runners, "BLOCKED_AFTER", 0.5)
    caplog.set_level(logging.WARNING, logger="errands.worker")

    @app.job(name="loop.blocker", retries=0)
    async def blocker() -> str:
        time.sleep(3)  # blocking: the mistake this reports
        return "done"

    handle = blocker.enqueue()
    with worker_factory(concurrency=2):
        assert handle.result(timeout=30) == "done"
        wait_until(
            lambda: any("turns again" in r.getMessage() for r in caplog.records),
            what="the loop's recovery to be logged",
        )
    [stalled] = [r.getMessage() for r in caplog.records if "has not turned" in r.getMessage()]
    assert f"in job {handle.id} loop.blocker" in stalled
    assert "asyncio.to_thread" in stalled
