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
"""


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
    fault = tmp_path / "child-start-fault"
    name = f"failing_app_{secrets.token_hex(4)}"  # children import it afresh
    (tmp_path / f"{name}.py").write_text(FAILING.format(fault=str(fault)))
    monkeypatch.syspath_prepend(str(tmp_path))
    app = importlib.import_module(name).app
    app.url = f"sqlite:///{tmp_path}/store.db"
    worker = app.worker(
        concurrency=1, pool="process", app_path=f"{name}:app", poll_interval=0.05, grace=1
    )
    codes: list[int] = []
    thread = threading.Thread(
        target=lambda: codes.append(worker.run(install_signals=False)), daemon=True
    )
    caplog.set_level(logging.WARNING, "errands.worker")
    thread.start()
    try:
        child = app.registry["pid"].enqueue().result(timeout=60)
        fault.touch()
        os.kill(child, signal.SIGKILL)
        wait_until(lambda: not pid_running(child), 30, "the child to die")
        handle = app.registry["pid"].enqueue()
        thread.join(30)
        job = app.get_job(handle.id)
    finally:
        worker.stop()
        thread.join(30)
        app.close()
    assert codes == [1]
    assert (job.state.value, job.attempt) == ("available", 0)
    assert len(job.errors) >= 3 and {e.kind for e in job.errors} == {"released"}
    assert "cannot run its jobs, so it stops (exit 1)" in caplog.text
