"""Graceful stop in-process (DESIGN §7, F4): finish short jobs, release long ones uncharged."""

import asyncio
import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import errands
from errands import JobState
from errands.worker import worker as worker_module

from .helpers import WorkerThread, wait_until


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


@contextlib.contextmanager
def _job_row_held(app: errands.App, job_id: int) -> Iterator[Any]:
    """Another session holds what a release of ``job_id`` needs, until the block ends: on
    PostgreSQL the job's row (SELECT ... FOR UPDATE: the release's UPDATE waits for it,
    with no error and no reply); on SQLite the file's write lock (BEGIN IMMEDIATE).
    Yields the PostgreSQL session's connection (None on SQLite)."""
    backend: Any = app.backend
    if hasattr(backend, "schema"):  # PostgreSQL
        import psycopg

        with psycopg.connect(backend.config.conninfo, autocommit=False) as conn:
            held = conn.execute(
                f'SELECT id FROM "{backend.schema}".errands_jobs WHERE id = %s FOR UPDATE',
                (job_id,),
            ).fetchall()
            assert held == [(job_id,)]
            try:
                yield conn
            finally:
                conn.rollback()
        return
    conn = sqlite3.connect(backend.path, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield None
        finally:
            conn.execute("ROLLBACK")
    finally:
        conn.close()


def _stop_releases_alive() -> bool:
    return any(t.name == "errands-stop-release" for t in threading.enumerate())


def test_a_stop_whose_release_gets_no_answer_exits_within_its_bound_and_the_job_is_rescued(
    each_store_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Given a job still running at the end of the grace period and a store that does not
    answer its release (another session holds the lock it needs: a job's row, SQLite's
    write lock), then the worker's stop gives the release up after its bound (logged,
    naming the job) and exits; the job's lease runs out (nothing renews it) and it is
    rescued, and runs to completion once. The release waited without a bound: on
    PostgreSQL for as long as the lock was held (here: the test's join gave up), on
    SQLite up to its write_timeout (then failed as the store's own error)."""
    url = each_store_url
    if url.startswith("sqlite"):  # the store's own wait for its write lock: not the bound
        url += "?write_timeout=4"
    monkeypatch.setattr(worker_module, "RELEASE_WAIT", 0.5)
    monkeypatch.setattr(worker_module, "DEREGISTER_WAIT", 0.5)  # (SQLite's lock holds it too)
    runs: list[int] = []

    def define(app: errands.App) -> Any:
        @app.job(name="stop.release_hangs", retries=1, lease=3)
        def release_hangs(ctx: errands.Context) -> str:
            runs.append(ctx.attempt)
            if len(runs) == 1:
                while not ctx.cancelled:  # stops when asked, at the end of the grace
                    time.sleep(0.01)
                return "stopped"
            return "done"

        return release_hangs

    stopping_app = errands.App(url)  # a store of its own: its hung write is its alone
    job = define(stopping_app)
    stopping_app.migrate()
    caplog.set_level(logging.WARNING, logger="errands.worker")
    worker = WorkerThread(stopping_app, grace=0.2, maintenance=False).start()
    later_app = errands.App(url)
    define(later_app)
    try:
        handle = job.enqueue()
        wait_until(lambda: runs == [1], timeout=30, what="the job running")
        with _job_row_held(stopping_app, handle.id) as holder:
            # the hang lasts for ever (PostgreSQL) or 4 s (SQLite); the stop's own bounds
            # add up to a second or two
            worker.stop(timeout=60)
            assert worker.exit_code == 0
            gave_up = [
                r.getMessage()
                for r in caplog.records
                if r.levelno == logging.ERROR and "could not give back" in r.getMessage()
            ]
            assert len(gave_up) == 1, gave_up
            assert f"job(s) {handle.id} " in gave_up[0] and "no answer" in gave_up[0]
            # The process would end here, and with it the session of its release (on
            # SQLite the release gives up at its write_timeout): it never lands.
            if holder is not None:
                holder.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE %s = ANY(pg_blocking_pids(pid))",
                    (holder.info.backend_pid,),
                )
            wait_until(lambda: not _stop_releases_alive(), timeout=60, what="the release over")
        assert handle.status() is JobState.RUNNING  # not given back: its lease runs out

        later = WorkerThread(later_app, maintenance_tick=0.1).start()  # rescues it, runs it
        try:
            assert handle.result(timeout=60) == "done"
        finally:
            later.stop()
    finally:
        if worker.thread.is_alive():
            worker.worker.stop()
        later_app.close()
        stopping_app.close()

    assert runs == [1, 2]  # cut short by the stop, then rescued and run once more
    done = handle.job()
    assert (done.state, done.rescues) == (JobState.COMPLETED, 1)
    assert "released" not in [e.kind for e in done.errors]


def test_a_stop_gives_back_a_job_whose_release_comes_after_one_waiting_for_a_row_lock(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """PostgreSQL: two jobs run as the grace period ends. The release of the first waits
    for its row, which another session holds FOR UPDATE; the second is inside a durable
    step, and given back once the step ends, while the first release still waits. The
    second release is made (its row is free) and lands: that job is available again,
    uncharged; only the first is logged as not given back. The stop's releases shared
    one helper thread: the second failed at once, untried ("1 earlier releases still
    wait for an answer"), and its job, left running, was rescued after its lease and
    charged as lost (a job with retries=0: dead for no fault of its own)."""
    monkeypatch.setattr(worker_module, "RELEASE_WAIT", 1.0)
    monkeypatch.setattr(worker_module, "DEREGISTER_WAIT", 0.5)
    stops = threading.Event()
    in_step = threading.Event()
    finish = threading.Event()
    app = errands.App(pg_url)

    @app.job(name="stop.row_locked", retries=0)
    def row_locked(ctx: errands.Context) -> str:
        stops.set()
        while not ctx.cancelled:  # stops when asked, at the end of the grace period
            time.sleep(0.01)
        return "stopped"

    @app.job(name="stop.in_a_step", retries=0)
    def in_a_step(ctx: errands.Context) -> str:
        def charge() -> str:
            in_step.set()
            with errands.shielded():  # a provider call across the stop
                finish.wait(120)
            return "ch"

        return str(ctx.step("charge", charge))

    caplog.set_level(logging.INFO, logger="errands.worker")
    worker = WorkerThread(
        app, grace=0.2, abandon_after=60, concurrency=2, prefetch=0, maintenance=False
    ).start()
    stopper = threading.Thread(target=worker.stop, kwargs={"timeout": 60})
    try:
        locked = row_locked.enqueue()
        stepping = in_a_step.enqueue()
        assert stops.wait(30) and in_step.wait(30)
        with _job_row_held(app, locked.id) as holder:
            stopper.start()  # like SIGTERM
            # the first job is given back (its release waits for the row), the second held
            wait_until(
                lambda: any("waiting for them to end" in r.getMessage() for r in caplog.records),
                timeout=30,
                what="the stop holding the job in its step",
            )
            time.sleep(0.2)  # (the first release well under way)
            finish.set()  # the step ends: the second job is given back now
            stopper.join(60)
            assert not stopper.is_alive()
            assert holder is not None
            holder.execute(  # (the first release would never land: its session ends here)
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE %s = ANY(pg_blocking_pids(pid))",
                (holder.info.backend_pid,),
            )
        wait_until(lambda: not _stop_releases_alive(), timeout=60, what="the releases over")
        given_up = [
            r.getMessage()
            for r in caplog.records
            if r.levelno == logging.ERROR and "could not give back" in r.getMessage()
        ]
        assert len(given_up) == 1 and f"job(s) {locked.id} " in given_up[0], given_up
        job = stepping.job()
        assert (job.state, job.attempt) == (JobState.AVAILABLE, 0), job.errors
        assert [e.kind for e in job.errors] == ["released"]
        assert locked.status() is JobState.RUNNING  # not given back: its lease runs out
    finally:
        finish.set()
        if stopper.is_alive():
            stopper.join(60)
        elif stopper.ident is None:
            worker.stop()
        app.close()


def test_a_stops_release_on_sqlite_waits_for_the_write_lock_no_longer_than_the_stop_does(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite: the write lock another connection holds keeps the stop's release from
    being written. The stop gives it up after its bound, and so does the release's helper
    thread (its wait for the lock ends at the same deadline): no release is written
    later, after the worker left the registry, by a helper left waiting up to the
    store's write_timeout (here 30 s). The job is rescued once its lease runs out."""
    monkeypatch.setattr(worker_module, "RELEASE_WAIT", 0.5)
    monkeypatch.setattr(worker_module, "DEREGISTER_WAIT", 0.5)
    app = errands.App(db_url + "?write_timeout=30")
    began = threading.Event()

    @app.job(name="stop.sqlite_locked", retries=0, lease=3)
    def sqlite_locked(ctx: errands.Context) -> str:
        began.set()
        while not ctx.cancelled:
            time.sleep(0.01)
        return "stopped"

    worker = WorkerThread(app, grace=0.2, maintenance=False).start()
    try:
        handle = sqlite_locked.enqueue()
        assert began.wait(30)
        with _job_row_held(app, handle.id):
            worker.stop(timeout=60)
            # well before write_timeout (30 s), the lock still held
            wait_until(lambda: not _stop_releases_alive(), timeout=10, what="the helper over")
        assert handle.status() is JobState.RUNNING  # never given back late
    finally:
        if worker.thread.is_alive():
            worker.worker.stop()
        app.close()


def test_a_stop_while_the_claim_waits_for_a_locked_sqlite_file_ends_without_its_write_timeout(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Another connection holds the SQLite file's write lock (a sqlite3 shell, a caller's
    open transaction) while the worker claims: the claim waits for it. A stop gives that
    wait up at once, and says nothing of a failed claim. The claim waited for the lock
    up to write_timeout (here 600 s; 60 s by default), and the stop with it."""
    app = errands.App(f"sqlite:///{tmp_path}/store.db?write_timeout=600", lease=30)
    app.migrate()
    caplog.set_level(logging.WARNING, logger="errands")
    worker = WorkerThread(app, poll_interval=0.05, maintenance=False).start()
    holder = sqlite3.connect(str(tmp_path / "store.db"), isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        time.sleep(1.0)  # the claim loop now waits for the lock
        started = time.monotonic()
        worker.stop(timeout=60)  # (its other bounded waits: seconds)
        took = time.monotonic() - started
        holder.execute("ROLLBACK")
    finally:
        holder.close()
        app.close()
    assert took < 45, f"the stop waited {took:.0f} s for the locked file"
    assert not [r for r in caplog.records if "claim failed" in r.getMessage()]
