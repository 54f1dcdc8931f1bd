"""A suspect child whose worker is killed leaves without a traceback.

The children inherit the worker's stderr (and, under ``--processes``, the supervisor's):
a traceback there reads as a crash of errands itself when only the parent died.
"""

from __future__ import annotations

import threading
from multiprocessing import Pipe
from typing import Any

import pytest

from errands.worker import process_pool


def _serve_in_thread(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, threading.Thread, list]:
    monkeypatch.setattr("errands.loading.load_app", lambda *a, **k: object())
    # child_main sets its signal dispositions, which only the main thread may do.
    monkeypatch.setattr("signal.signal", lambda *a, **k: None)
    parent, child = Pipe()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            process_pool.child_main("unused:app", "sqlite://", child)
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
    assert parent.recv() == process_pool.READY
    parent.close()
    thread.join(5)
    assert not thread.is_alive()
    assert errors == []


def test_a_child_whose_worker_died_while_its_job_ran_leaves_quietly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker_gone = threading.Event()

    def run_one(app: Any, row: Any, worker_id: str, reporter: Any) -> str:
        assert worker_gone.wait(5)
        return "an outcome nobody is left to read"

    monkeypatch.setattr(process_pool, "JobRow", lambda *fields: fields)
    monkeypatch.setattr(process_pool, "_run_one", run_one)
    parent, thread, errors = _serve_in_thread(monkeypatch)
    assert parent.recv() == process_pool.READY
    parent.send(("a job",))
    parent.close()
    worker_gone.set()
    thread.join(5)
    assert not thread.is_alive()
    assert errors == []
