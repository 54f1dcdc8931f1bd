"""A suspect child whose worker is killed leaves without a traceback.

The children inherit the worker's stderr (and, under ``--processes``, the supervisor's):
a traceback there reads as a crash of errands itself when only the parent died.
"""

from __future__ import annotations

import threading
from multiprocessing import Pipe
from typing import Any

import pytest

from errands.worker import process_child


def _serve_in_thread(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, threading.Thread, list]:
    monkeypatch.setattr("errands.loading.load_app", lambda *a, **k: object())
    # child_main sets its signal dispositions, which only the main thread may do.
    monkeypatch.setattr("signal.signal", lambda *a, **k: None)
    parent, child = Pipe()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            process_child.child_main("unused:app", "sqlite://", child)
        except BaseException as exc:  # what would have been printed as a traceback
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return parent, thread, errors


def test_a_child_whose_worker_was_killed_with_its_ready_message_unread_leaves_quietly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parent, thread, errors = _serve_in_thread(monkeypatch)
    assert parent.poll(5), "the child never said it was ready"
    # The worker dies without reading READY: closing a socket with unread data resets
    # the peer's end, so the child's recv raises ConnectionResetError, not EOFError.
    parent.close()
    thread.join(5)
    assert not thread.is_alive()
    assert errors == []


def test_a_child_whose_worker_closed_the_pipe_cleanly_leaves_quietly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parent, thread, errors = _serve_in_thread(monkeypatch)
    assert parent.recv() == process_child.READY
    parent.close()
    thread.join(5)
    assert not thread.is_alive()
    assert errors == []


def test_a_child_whose_worker_died_while_its_job_ran_leaves_quietly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker_gone = threading.Event()

    def run_one(app: Any, row: Any, worker_id: str, reporter: Any, app_path: str) -> str:
        assert worker_gone.wait(5)
        return "an outcome nobody is left to read"

    monkeypatch.setattr(process_child, "JobRow", lambda *fields: fields)
    monkeypatch.setattr(process_child, "_run_one", run_one)
    parent, thread, errors = _serve_in_thread(monkeypatch)
    assert parent.recv() == process_child.READY
    parent.send(("a job",))
    parent.close()
    worker_gone.set()
    thread.join(5)
    assert not thread.is_alive()
    assert errors == []


# A worker (this script) starts a child that watches it, then dies at once (os._exit: no
# atexit, which would terminate the child itself). argv[1]: "running" or "idle".
_ORPHAN = """
import multiprocessing, os, sys, threading, time
from errands.worker import process_child

def child(running):
    event = threading.Event()
    if running:
        event.set()
    process_child._leave_with_the_worker(event)
    time.sleep(30)

if __name__ == "__main__":
    process = multiprocessing.get_context("fork").Process(
        target=child, args=(sys.argv[1] == "running",), daemon=True
    )
    process.start()
    print(process.pid, flush=True)
    os._exit(0)
"""


@pytest.mark.parametrize("state", ["idle", "running"])
def test_a_child_whose_worker_dies_leaves_at_once_and_speaks_only_if_it_had_a_job(
    tmp_path: Any, state: str
) -> None:
    """Real processes: the child of a worker that dies exits within seconds (code 3); it
    says so on stderr only when it was running a job (idle, or still starting, there is
    nothing to report: a graceful stop with a spare child starting printed it before)."""
    import subprocess
    import sys

    script = tmp_path / "orphan.py"
    script.write_text(_ORPHAN)
    done = subprocess.run(
        [sys.executable, str(script), state], capture_output=True, text=True, timeout=20
    )  # returns once the child, which holds the pipes too, has left
    child = int(done.stdout.split()[0])
    lines = done.stderr.splitlines()
    if state == "idle":
        assert lines == []
    else:
        assert len(lines) == 1 and f"of child {child} is gone" in lines[0], lines
