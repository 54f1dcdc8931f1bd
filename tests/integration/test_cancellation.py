"""Cancellation of pending and running jobs (DESIGN §7, F19).

Running jobs learn of a cancel through the heartbeat; ``lease=1`` makes the heartbeat run
every third of a second so these tests stay fast.
"""

import asyncio
import sys
import threading
import time

import pytest

import errands
from errands import JobState

from .helpers import run_script, wait_until


def test_cancelling_a_pending_job_cancels_it_at_once_and_it_never_runs(
    app: errands.App, worker_factory
) -> None:
    ran: list[int] = []

    @app.job(name="cancel.pending")
    def pending(n: int) -> int:
        ran.append(n)
        return n

    doomed = pending.enqueue(n=1)
    later = pending.enqueue(n=2, delay=60)
    result = doomed.cancel(actor="ops")
    assert (result.previous_state, result.state) == ("available", "cancelled")
    assert later.cancel().previous_state == "scheduled"
    assert doomed.status() is JobState.CANCELLED

    with worker_factory():
        assert pending.enqueue(n=3).result(timeout=10) == 3
        with pytest.raises(errands.JobCancelled):
            doomed.result(timeout=1)

    assert ran == [3]
    assert later.status() is JobState.CANCELLED
    job = doomed.job()
    assert job.attempt == 0
    assert job.finished_at is not None
    [event] = app.audit(job_id=doomed.id)
    assert (event.action, event.actor, event.detail) == (
        "cancel",
        "ops",
        {"previous_state": "available"},
    )


def test_cancelling_a_running_async_job_cancels_its_task_and_the_job_ends_cancelled(
    app: errands.App, worker_factory
) -> None:
    started = threading.Event()
    saw: list[str] = []

    @app.job(name="cancel.async_waiter", lease=1, retries=3, backoff=0.01)
    async def waiter() -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            saw.append("CancelledError")
            raise

    handle = waiter.enqueue()
    with worker_factory():
        assert started.wait(10)
        result = handle.cancel()
        assert (result.previous_state, result.state) == ("running", "running")
        wait_until(lambda: handle.status() is JobState.CANCELLED, what="the job to be cancelled")
        with pytest.raises(errands.JobCancelled):
            handle.result(timeout=1)

    assert saw == ["CancelledError"]
    job = handle.job()
    assert job.attempt == 1
    assert job.finished_at is not None


def test_cancelling_a_running_sync_job_sets_ctx_cancelled_and_it_never_runs_again_even_if_it_raises(
    app: errands.App, worker_factory
) -> None:
    started = threading.Event()
    runs: list[int] = []
    reasons: list[str] = []

    @app.job(name="cancel.sync_poller", lease=1, retries=3, backoff=0.01)
    def poller(ctx: errands.Context) -> None:
        runs.append(ctx.attempt)
        started.set()
        for _ in range(1000):
            if ctx.cancelled:
                reasons.append(ctx.cancel_reason)
                # a handler that reacts by raising would normally be retried
                raise RuntimeError("stopped half-way")
            threading.Event().wait(0.01)

    @app.job(name="cancel.sentinel")
    def sentinel() -> str:
        return "done"

    handle = poller.enqueue()
    with worker_factory():
        assert started.wait(10)
        assert handle.cancel().state == "running"
        wait_until(lambda: handle.status() is JobState.CANCELLED, what="the job to be cancelled")
        # the retry's backoff (0.01 s) is long over once the worker has run another job
        assert sentinel.enqueue().result(timeout=10) == "done"
        assert handle.status() is JobState.CANCELLED

    assert runs == [1]
    assert reasons == ["cancelled"]
    assert handle.job().attempt == 1


def test_a_handler_without_a_context_cancelled_while_running_ends_cancelled_and_is_reported_so(
    app: errands.App, worker_factory
) -> None:
    """A sync handler that takes no Context gets none (nothing could reach it); its stop
    is still known: cancelled while it runs, then raising, it ends ``cancelled`` with a
    ``cancelled`` event, never retried."""
    started, release = threading.Event(), threading.Event()
    events: list[str] = []
    app.events.subscribe(lambda e: events.append(e.name))

    @app.job(name="cancel.no_ctx", lease=1, retries=3, backoff=0.01)
    def no_ctx() -> None:
        started.set()
        release.wait(10)
        raise RuntimeError("stopped half-way")

    handle = no_ctx.enqueue()
    with worker_factory():
        assert started.wait(10)
        assert handle.cancel().state == "running"
        time.sleep(0.6)  # past a heartbeat (lease 1 s: every 0.33 s), which delivers it
        release.set()
        wait_until(lambda: handle.status() is JobState.CANCELLED, what="the job cancelled")
    assert handle.job().attempt == 1
    assert "errands.job.cancelled" in events and "errands.job.retrying" not in events


def test_an_async_handler_without_a_context_cancelled_while_running_ends_cancelled(
    app: errands.App, worker_factory
) -> None:
    """An async handler that takes no Context gets none either; cancelled while it runs
    (its task cancelled), then raising an error of its own instead of the cancel, it
    ends ``cancelled`` with a ``cancelled`` event, never retried."""
    started = threading.Event()
    events: list[str] = []
    app.events.subscribe(lambda e: events.append(e.name))

    @app.job(name="cancel.async_no_ctx", lease=1, retries=3, backoff=0.01)
    async def async_no_ctx() -> None:
        started.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise RuntimeError("stopped half-way") from None

    handle = async_no_ctx.enqueue()
    with worker_factory():
        assert started.wait(10)
        assert handle.cancel().state == "running"
        wait_until(lambda: handle.status() is JobState.CANCELLED, what="the job cancelled")
    assert handle.job().attempt == 1
    assert "errands.job.cancelled" in events and "errands.job.retrying" not in events


def test_async_job_that_swallows_its_cancellation_and_raises_never_runs_again(
    app: errands.App, worker_factory
) -> None:
    started = threading.Event()
    runs: list[int] = []

    @app.job(name="cancel.async_stubborn", lease=1, retries=3, backoff=0.01)
    async def stubborn(ctx: errands.Context) -> None:
        runs.append(ctx.attempt)
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed while stopping") from None

    @app.job(name="cancel.async_sentinel")
    async def sentinel() -> str:
        return "done"

    handle = stubborn.enqueue()
    with worker_factory():
        assert started.wait(10)
        handle.cancel()
        wait_until(lambda: handle.status() is JobState.CANCELLED, what="the job to be cancelled")
        assert sentinel.enqueue().result(timeout=10) == "done"

    assert runs == [1]
    assert handle.status() is JobState.CANCELLED


@pytest.mark.skipif(sys.platform == "win32", reason="no os.fork on Windows")
def test_a_child_forked_while_another_thread_cancels_a_job_can_cancel_its_own() -> None:
    """The parent forks while another thread holds the module lock of a job's cancel
    (errands.context._CANCEL_LOCK: a timeout or a stop cancelling an attempt takes it).
    The child had the lock copied held, by a thread it does not have: its first cancel
    hung for good. In the child the lock is new (errands.forking.fresh_lock_at_fork, as
    for the other module locks: metrics, tracing, the Django apps, the Tester's fault
    point): the cancel is done. Real os.fork, in a process of its own; the parent kills
    a child still running after 20 s (an alarm set in the child would come too late for
    a hang in an at-fork hook)."""
    script = """
        import logging, os, signal, threading, time
        from errands import context

        def new_context() -> context.Context:
            log = logging.getLogger("forked")
            return context.Context(1, "forked.job", "default", 1, 3, None, "w", log)

        held, forked = threading.Event(), threading.Event()

        def cancelling() -> None:  # the cancel lock held across the fork
            with context._CANCEL_LOCK:
                held.set()
                forked.wait(60)

        threading.Thread(target=cancelling, daemon=True).start()
        assert held.wait(30)
        pid = os.fork()
        if pid == 0:
            try:
                ctx = new_context()
                ctx._request_cancel("timeout")
                print("child cancelled", ctx.cancelled, ctx.cancel_reason, flush=True)
            except BaseException as exc:
                print("child:", type(exc).__name__, exc, flush=True)
                os._exit(1)
            os._exit(0)
        forked.set()
        deadline = time.monotonic() + 20
        while (ended := os.waitpid(pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                print("child hung", flush=True)
                os.kill(pid, signal.SIGKILL)
                ended = os.waitpid(pid, 0)
                break
            time.sleep(0.02)
        print("child exit", os.waitstatus_to_exitcode(ended[1]), flush=True)
        ctx = new_context()
        ctx._request_cancel("shutdown")
        print("parent cancelled", ctx.cancelled, ctx.cancel_reason, flush=True)
        """
    done = run_script(script)
    assert done.returncode == 0, (done.stdout, done.stderr[-3000:])
    for said in ("child cancelled True timeout", "child exit 0", "parent cancelled True shutdown"):
        assert said in done.stdout, (done.stdout, done.stderr[-3000:])
