"""Graceful stop in-process (DESIGN §7, F4): finish short jobs, release long ones uncharged."""

import asyncio
import threading

import errands
from errands import JobState

from .helpers import wait_until


def test_graceful_stop_lets_a_running_short_job_finish(app: errands.App, start_worker) -> None:
    started = threading.Event()

    @app.job(name="stop.short")
    def short() -> str:
        started.set()
        threading.Event().wait(0.3)
        return "finished"

    handle = short.enqueue()
    worker = start_worker(grace=10)
    assert started.wait(10)
    worker.stop()

    assert worker.exit_code == 0
    assert handle.status() is JobState.COMPLETED
    assert handle.result(timeout=1) == "finished"
    assert handle.job().attempt == 1


def test_graceful_stop_does_not_claim_new_jobs(app: errands.App, start_worker) -> None:
    started = threading.Event()
    stop_requested = threading.Event()
    ran: list[int] = []

    @app.job(name="stop.one_by_one")
    def one_by_one(n: int) -> None:
        ran.append(n)
        started.set()
        stop_requested.wait(10)

    first = one_by_one.enqueue(n=1)
    worker = start_worker(concurrency=1, grace=10)
    assert started.wait(10)
    second = one_by_one.enqueue(n=2)
    worker.worker.stop()  # like SIGTERM: stop claiming...
    stop_requested.set()  # ...then the slot frees up
    worker.stop()  # and wait for run() to return

    assert ran == [1]
    assert first.status() is JobState.COMPLETED
    assert second.status() is JobState.AVAILABLE


def test_grace_period_over_releases_a_long_job_uncharged_and_it_runs_again_later(
    app: errands.App, start_worker
) -> None:
    started = threading.Event()
    runs: list[int] = []
    first_stop_reason: list[str] = []

    @app.job(name="stop.long", retries=0)
    def long(ctx: errands.Context) -> str:
        runs.append(ctx.attempt)
        if len(runs) == 1:
            started.set()
            for _ in range(1000):  # far longer than the grace period, but polite
                if ctx.cancelled:
                    first_stop_reason.append(ctx.cancel_reason)
                    return "interrupted"
                threading.Event().wait(0.01)
        return "finished"

    handle = long.enqueue()
    worker = start_worker(grace=0.5)
    assert started.wait(10)
    took = worker.stop()

    assert 0.4 <= took < 30, f"stop took {took:.2f} s"  # the grace, not the 10 s job
    job = handle.job()
    assert job.state is JobState.AVAILABLE
    assert job.attempt == 0  # the released attempt is not charged
    [released] = job.errors  # ...but recorded, so the run that follows is explained
    assert (released.kind, released.type, released.attempt) == ("released", "Released", 1)
    assert "not charged" in released.message
    assert job.lease_owner is None and job.result is None
    wait_until(lambda: first_stop_reason, what="the released handler to see ctx.cancelled")
    assert first_stop_reason == ["shutdown"]

    # a later worker (a restarted process) picks it up; with retries=0 a charged attempt
    # would have left none
    later = start_worker()
    assert handle.result(timeout=10) == "finished"
    later.stop()
    assert runs == [1, 1]
    assert handle.job().attempt == 1


def test_grace_period_over_releases_a_long_async_job_uncharged(
    app: errands.App, start_worker
) -> None:
    started = threading.Event()
    interrupted: list[str] = []
    runs: list[int] = []

    @app.job(name="stop.long_async", retries=0)
    async def long_async(ctx: errands.Context) -> str:
        runs.append(ctx.attempt)
        if len(runs) == 1:
            started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                interrupted.append(ctx.cancel_reason)
                raise
        return "finished"

    handle = long_async.enqueue()
    worker = start_worker(grace=0.3)
    assert started.wait(10)
    took = worker.stop()

    assert took < 20, f"stop took {took:.2f} s"  # the grace, not the 30 s job
    job = handle.job()
    assert (job.state, job.attempt) == (JobState.AVAILABLE, 0)
    assert [(e.kind, e.attempt) for e in job.errors] == [("released", 1)]
    assert interrupted == ["shutdown"]

    later = start_worker()
    assert handle.result(timeout=10) == "finished"
    later.stop()
    assert runs == [1, 1]


def test_released_async_handler_finishes_its_cancellation_cleanup_before_the_worker_exits(
    app: errands.App, start_worker
) -> None:
    started = threading.Event()
    cleanup: list[str] = []

    @app.job(name="stop.async_cleanup", retries=0)
    async def with_cleanup(ctx: errands.Context) -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cleanup.append("begun")
            await asyncio.sleep(0.2)  # e.g. closing a connection politely
            cleanup.append("done")
            raise

    handle = with_cleanup.enqueue()
    worker = start_worker(grace=0.2)
    assert started.wait(10)
    worker.stop()

    assert cleanup == ["begun", "done"]
    assert handle.status() is JobState.AVAILABLE
    assert handle.job().attempt == 0


def test_a_transient_store_error_while_starting_is_retried_not_fatal(
    app: errands.App, start_worker, monkeypatch
) -> None:
    """A worker (re)started while the store hiccups (a killed session, a busy file) waits
    it out instead of exiting with a traceback: its startup steps retry transient errors."""
    from errands.errors import DatabaseBusy

    @app.job(name="start.after_hiccup")
    def after_hiccup() -> str:
        return "ran"

    failures = [DatabaseBusy("database is locked"), DatabaseBusy("database is locked")]
    declare = app.backend.job_limit_declare  # what every worker declares as it starts

    def flaky_declare(*args: object, **kwargs: object) -> None:
        if failures:
            raise failures.pop()
        declare(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(app.backend, "job_limit_declare", flaky_declare)
    worker = start_worker(poll_interval=0.05)
    assert after_hiccup.enqueue().result(timeout=10) == "ran"
    worker.stop()
    assert failures == []  # both hiccups were met, and waited out
    assert worker.exit_code == 0
