"""A process-pool worker whose children keep failing to start stops, exit 1, and leaves
its jobs uncharged (a real worker in the test process, real child processes; the
pauses and the give-up are shortened so that it takes a second, not a minute)."""

from __future__ import annotations

import importlib
import logging
import os
import secrets
import signal
import threading
from pathlib import Path

import pytest

from errands.worker import child_starts

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


class PoolWorker:
    """A process-pool worker in the test process, on a SQLite store, whose children
    cannot start while the file ``fault`` exists; ``codes`` gets its exit code."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, concurrency: int):
        self.fault = tmp_path / "child-start-fault"
        name = f"failing_app_{secrets.token_hex(4)}"  # children import it afresh
        (tmp_path / f"{name}.py").write_text(FAILING.format(fault=str(self.fault)))
        monkeypatch.syspath_prepend(str(tmp_path))
        self.app = importlib.import_module(name).app
        self.app.url = f"sqlite:///{tmp_path}/store.db"
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
    assert len(job.errors) >= 3 and {e.kind for e in job.errors} == {"released"}
    assert "cannot run its jobs, so it stops (exit 1)" in caplog.text


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
    assert "1 other(s) run: jobs wait for them" in caplog.text
    assert "exit 1" not in caplog.text
