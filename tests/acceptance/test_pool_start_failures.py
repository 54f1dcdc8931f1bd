"""A process-pool worker whose children keep failing to start stops, exit 1, and leaves
its jobs uncharged (a real worker in the test process, real child processes; the
pauses and the give-up are shortened so that it takes a second, not a minute)."""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import secrets
import signal
import sqlite3
import threading
import time
from pathlib import Path

import pytest

import errands
from errands.backends.base import ClaimParams, QueueClaim
from errands.jobs import JobRow
from errands.maintenance.service import Maintenance
from errands.worker import child_starts
from errands.worker.process_pool import ProcessRunner

from .harness import pid_running, wait_until

pytestmark = pytest.mark.acceptance

# The fault's file is named in the module itself: a forkserver started by an earlier test
# has the environment of its own start, not this test's.
FAILING = """
import multiprocessing
import os
import time

import errands

_app = errands.App()


def __getattr__(name):
    if name != "app":
        raise AttributeError(name)
    if multiprocessing.parent_process() is not None and os.path.exists({fault!r}):
        raise RuntimeError("injected: this worker child cannot start")
    return _app


@_app.job(name="pid", retries=0)
def pid() -> int:
    return os.getpid()


@_app.job(name="waits_for", retries=0)
def waits_for(path: str) -> int:
    for _ in range(3000):  # a minute at most
        if os.path.exists(path):
            break
        time.sleep(0.02)
    return os.getpid()
"""


# A job that needs no child: an async def handler runs on the worker's event loop.
ON_THE_LOOP = """

@_app.job(name="on_the_loop", retries=0)
async def on_the_loop() -> int:
    return os.getpid()
"""


def failing_app(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, with_async: bool = False
) -> tuple[str, errands.App]:
    """A module of its own (children import it afresh) on a SQLite store, whose children
    cannot start while ``tmp_path / "child-start-fault"`` exists: its name and its app.
    ``with_async``: it defines an async job too."""
    name = f"failing_app_{secrets.token_hex(4)}"
    fault = tmp_path / "child-start-fault"
    source = FAILING.format(fault=str(fault)) + (ON_THE_LOOP if with_async else "")
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    app: errands.App = importlib.import_module(name).app
    app.url = f"sqlite:///{tmp_path}/store.db"
    return name, app


@pytest.fixture
def refused_threads(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Names of threads whose start fails as when the OS refuses a thread (RLIMIT_NPROC, a
    cgroup's pids.max: the limits that refuse a fork); add a name to refuse its threads."""
    names: set[str] = set()
    start = threading.Thread.start

    def refusing(thread: threading.Thread) -> None:
        if thread.name in names:
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", refusing)
    return names


def claimed(app: errands.App, count: int) -> list[JobRow]:
    """Claim ``count`` jobs of the default queue, oldest first."""
    rows = app.backend.job_claim(ClaimParams([QueueClaim("default", count)], count, "t", 30.0))
    return sorted(rows, key=lambda r: r.id)


class PoolWorker:
    """A process-pool worker in the test process, on a SQLite store, whose children
    cannot start while the file ``fault`` exists; ``codes`` gets its exit code."""

    def __init__(
        self,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        concurrency: int,
        *,
        with_async: bool = False,
    ) -> None:
        self.fault = tmp_path / "child-start-fault"
        name, self.app = failing_app(tmp_path, monkeypatch, with_async=with_async)
        self.worker = self.app.worker(
            concurrency=concurrency, pool="process", app_path=f"{name}:app",
            poll_interval=0.05, grace=1,
        )  # fmt: skip
        self.codes: list[int] = []
        self.thread = threading.Thread(
            target=lambda: self.codes.append(self.worker.run(install_signals=False)),
            daemon=True,
        )

    def __enter__(self) -> PoolWorker:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.worker.stop()
        self.thread.join(30)
        self.app.close()

    def children(self) -> list[int]:
        """The pids of its children, once its process pool has started."""
        return wait_until(
            lambda: self.worker.processes is not None and self.worker.processes.pids(),
            60,
            "the process pool's children",
        )

    def lose_children(self, *pids: int) -> None:
        """From now on children cannot start; ``pids`` are killed."""
        self.fault.touch()
        for child in pids:
            os.kill(child, signal.SIGKILL)
        for child in pids:
            wait_until(lambda child=child: not pid_running(child), 30, "the child to die")


def test_a_worker_whose_children_keep_failing_to_start_stops_with_exit_1_its_job_uncharged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Given a process-pool worker whose children cannot start any more, when a job comes,
    then it is released at each try, and once the failures have lasted GIVE_UP_AFTER
    tries and GIVE_UP_SPAN seconds the worker logs why and stops, exit 1, the job left
    available with its attempt uncharged. It failed the job, and ran on claiming nothing
    it could run, looking alive."""
    monkeypatch.setattr(child_starts, "START_PAUSE", 0.1)
    monkeypatch.setattr(child_starts, "GIVE_UP_AFTER", 3)
    monkeypatch.setattr(child_starts, "GIVE_UP_SPAN", 0.5)
    caplog.set_level(logging.WARNING, "errands.worker")
    with PoolWorker(tmp_path, monkeypatch, concurrency=1) as pool:
        [child] = pool.children()
        pool.lose_children(child)
        handle = pool.app.registry["pid"].enqueue()
        pool.thread.join(30)
        job = pool.app.get_job(handle.id)
    assert pool.codes == [1]
    assert (job.state.value, job.attempt) == ("available", 0)
    [released] = job.errors  # its releases in a row, counted in one entry
    assert released.kind == "released" and released.times >= 3
    assert "cannot run its jobs, so it stops (exit 1)" in caplog.text


def test_a_worker_whose_children_cannot_start_runs_its_async_jobs_meanwhile_and_runs_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Given a process-pool worker serving sync and async jobs whose children cannot start
    any more, when a sync job is released and an async job comes during the pause that
    followed, then the async job runs at once (the pause holds back only the sync job,
    claimed no more meanwhile), and once the failures have lasted long enough to give up
    on the children the worker says so loudly and runs on, its async jobs still running.
    The pause held every claim back, the async job waiting it out, and the give-up
    stopped the worker (exit 1) though its async jobs ran fine."""
    monkeypatch.setattr(child_starts, "START_PAUSE", 5.0)
    monkeypatch.setattr(child_starts, "GIVE_UP_AFTER", 2)
    monkeypatch.setattr(child_starts, "GIVE_UP_SPAN", 0.5)
    caplog.set_level(logging.WARNING, "errands.worker")
    with PoolWorker(tmp_path, monkeypatch, concurrency=1, with_async=True) as pool:
        [child] = pool.children()
        pool.lose_children(child)
        synchronous = pool.app.registry["pid"].enqueue()
        wait_until(lambda: synchronous.job().errors, 30, "the sync job released")
        failures = pool.worker.processes.failures
        pause = failures.pause_left()
        began = time.monotonic()
        assert pool.app.registry["on_the_loop"].enqueue().result(timeout=30) == os.getpid()
        assert time.monotonic() - began < pause  # within the pause, not after it
        assert len(synchronous.job().errors) == 1  # not claimed again meanwhile
        wait_until(
            lambda: failures.in_a_row >= 2 or not pool.thread.is_alive(), 30, "a 2nd failure"
        )
        assert pool.codes == []
        assert pool.app.registry["on_the_loop"].enqueue().result(timeout=30) == os.getpid()
        job = synchronous.job()
    assert pool.codes == [0]
    assert (job.state.value, job.attempt) == ("available", 0)
    assert {e.kind for e in job.errors} == {"released"}
    assert "this worker's sync jobs cannot run" in caplog.text
    assert "exit 1" not in caplog.text


def test_a_child_that_cannot_start_beside_live_ones_leaves_the_job_waiting_for_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Given a process-pool worker (-c 2) whose second child cannot start again, when a
    job comes while the other child is busy, then the job waits for that child (never
    released, its attempt run once), the failed starts pause no claim, and however long
    they last the worker runs on. The job was released at each failed start, each
    pausing every claim, and failures that lasted GIVE_UP_AFTER starts and GIVE_UP_SPAN
    seconds stopped the worker (exit 1) though one child was healthy."""
    monkeypatch.setattr(child_starts, "START_PAUSE", 0.05)
    monkeypatch.setattr(child_starts, "GIVE_UP_AFTER", 3)
    monkeypatch.setattr(child_starts, "GIVE_UP_SPAN", 0.5)
    release = tmp_path / "release"
    caplog.set_level(logging.WARNING, "errands.worker")
    with PoolWorker(tmp_path, monkeypatch, concurrency=2) as pool:
        live, doomed = pool.children()
        pool.lose_children(doomed)
        blocker = pool.app.registry["waits_for"].enqueue(path=str(release))
        wait_until(lambda: blocker.job().state.value == "running", 30, "the blocker to run")
        waiting = pool.app.registry["pid"].enqueue()
        failures = pool.worker.processes.failures
        # five starts missed, 0.05 s apart doubling: 0.75 s, past the give-up's span
        wait_until(
            lambda: failures.total >= 5 or not pool.thread.is_alive(), 30, "five failed starts"
        )
        assert pool.codes == [] and waiting.job().state.value == "running"
        release.touch()
        assert blocker.result(timeout=30) == live
        assert waiting.result(timeout=30) == live
        job = waiting.job()
    assert pool.codes == [0]
    assert (job.attempt, job.errors) == (1, [])
    assert "1 other(s) run: sync jobs wait for them" in caplog.text
    assert "exit 1" not in caplog.text


def test_a_job_whose_thread_to_its_child_cannot_start_is_released_uncharged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused_threads: set[str]
) -> None:
    """Given a process-pool worker that cannot start the thread that hands a job to its
    child (the process's thread limit reached), when a job on its last attempt comes,
    then it is released (its attempt not charged, the reason recorded) and the failure
    counted as a child that cannot start; once threads start again it completes on that
    same attempt. The RuntimeError was the job's failure, charged: dead at once."""
    monkeypatch.setattr(child_starts, "START_PAUSE", 0.1)
    with PoolWorker(tmp_path, monkeypatch, concurrency=1) as pool:
        [child] = pool.children()
        refused_threads.add("errands-child-job")
        handle = pool.app.registry["pid"].enqueue()  # retries=0
        wait_until(lambda: handle.job().errors, 30, "the job's first failure or release")
        counted = pool.worker.processes.failures.total
        refused_threads.clear()
        assert handle.result(timeout=30) == child
        job = handle.job()
    assert counted >= 1
    assert job.attempt == 1 and {e.kind for e in job.errors} == {"released"}
    assert "can't start new thread" in job.errors[0].message


def test_a_job_runs_and_its_child_comes_back_when_the_next_spares_thread_cannot_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused_threads: set[str]
) -> None:
    """Given a runner keeping a spare child whose threads to start spares are refused,
    when a job takes the spare, then it runs, its future is settled and its child goes
    back to the free ones. The refusal ended the thread serving the job after it took the
    child: the job waited for ever (its lease heartbeated), the child lost to the pool."""
    name, app = failing_app(tmp_path, monkeypatch)
    app.registry["pid"].enqueue()
    [row] = claimed(app, 1)
    runner = ProcessRunner(f"{name}:app", app.url, 2, start=False, spare=1)
    try:
        runner.warm()
        wait_until(lambda: runner.idle() == 1, 60, "the spare child")
        refused_threads.add("errands-child-start")
        [spare] = runner.pids()
        assert json.loads(runner.submit(row).result(30).result_json) == spare
        wait_until(lambda: runner.idle() == 1, 30, "the child back among the free ones")
    finally:
        runner.shutdown()
        app.close()


def test_a_spare_whose_thread_cannot_start_gives_its_place_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused_threads: set[str]
) -> None:
    """Given a runner of two children, one kept spare, whose first thread to start the
    spare is refused, when a job runs and another comes, then the other job gets a second
    child. The refused start's place stayed counted as starting for good: the second job
    waited for ever for room the pool no longer had."""
    name, app = failing_app(tmp_path, monkeypatch)
    release = tmp_path / "release"
    app.registry["waits_for"].enqueue(path=str(release))
    app.registry["pid"].enqueue()
    blocker, quick = claimed(app, 2)
    runner = ProcessRunner(f"{name}:app", app.url, 2, start=False, spare=1)
    try:
        refused_threads.add("errands-child-start")
        with contextlib.suppress(RuntimeError):  # (it raised it, too)
            runner.warm()
        refused_threads.clear()
        blocked = runner.submit(blocker)
        second = json.loads(runner.submit(quick).result(30).result_json)
        assert not blocked.done() and second in runner.pids()
        release.touch()
        assert json.loads(blocked.result(30).result_json) != second
    finally:
        release.touch()
        runner.shutdown()
        app.close()


def test_rescued_jobs_run_in_the_worker_once_their_children_keep_failing_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Given a thread-pool worker (-c 2: rescued jobs isolated in child processes) whose
    children cannot load the app (it loads in the worker: a port bound at import, say),
    when a rescued job comes, then it is released uncharged while the children fail, and
    once they have failed long enough to give up on them the worker says so once and
    runs it in its own process, one rescued job at a time; its releases are one entry
    counting them. The job was released every 30 s for as long as the worker lived,
    each release appending an entry to its errors."""
    monkeypatch.setattr(child_starts, "START_PAUSE", 0.1)
    monkeypatch.setattr(child_starts, "GIVE_UP_AFTER", 3)
    monkeypatch.setattr(child_starts, "GIVE_UP_SPAN", 0.5)
    caplog.set_level(logging.WARNING, "errands.worker")
    name, app = failing_app(tmp_path, monkeypatch)
    (tmp_path / "child-start-fault").touch()
    handle = app.registry["pid"].enqueue()
    [row] = claimed(app, 1)
    with contextlib.closing(sqlite3.connect(tmp_path / "store.db")) as conn, conn:
        conn.execute(  # the claim's worker died: its lease ran out
            "UPDATE errands_jobs SET lease_expires_at = 0, max_attempts = 3 WHERE id = ?",
            (row.id,),
        )  # (retried: the job type has retries=0)
    assert Maintenance(app, "test-rescuer").rescue() == 1
    worker = app.worker(concurrency=2, app_path=f"{name}:app", poll_interval=0.05, grace=1)
    assert worker.isolates_suspects
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        assert handle.result(timeout=60) == os.getpid()  # run here, not in a child
    finally:
        worker.stop()
        thread.join(30)
    job = handle.job()
    app.close()
    assert (job.attempt, job.rescues) == (2, 1)
    kinds = [e.kind for e in job.errors]
    assert kinds == ["worker_lost", "released"], job.errors
    releases = caplog.text.count("released 1 job(s): no worker child process")
    assert releases >= 2 and job.errors[1].times == releases
    assert caplog.text.count("rescued jobs run in this worker's process from now on") == 1
