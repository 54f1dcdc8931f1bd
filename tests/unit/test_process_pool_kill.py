"""A child killed (timeout, cancel) just as it answered is never handed out again: the
next job it was given failed as a crash of its own ("WorkerProcessDied"), counted toward
that innocent job's poison limit."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import pytest

from errands.worker import process_pool
from errands.worker.process_pool import ProcessRunner, _Slot
from tests.unit.test_fair_outcome import ROW


class FakeProcess:
    def __init__(self) -> None:
        self.killed = False
        self.pid = 4242
        self.exitcode = None

    def kill(self) -> None:
        self.killed = True

    def join(self, timeout: float | None = None) -> None: ...


class AnswerAfterKill:
    """The child's pipe: it answers once the test has killed the child."""

    def __init__(self, killed: threading.Event) -> None:
        self.killed = killed

    def send(self, _: Any) -> None: ...

    def recv(self) -> Any:
        self.killed.wait(10)
        return (True, "answered")


def test_a_child_killed_as_it_answers_is_replaced_not_handed_out_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The fakes have no file descriptors to wait on: read the pipe alone (the child's
    # exit, watched beside it, is the acceptance tests' in test_orphan_children).
    monkeypatch.setattr(process_pool, "_receive", lambda slot: slot.conn.recv())
    runner = ProcessRunner.__new__(ProcessRunner)
    runner._cond = threading.Condition()
    runner._closed = False
    runner._free, runner._slots = [], []
    runner.killed = 0
    killed = threading.Event()
    slot = _Slot(FakeProcess(), AnswerAfterKill(killed))
    fresh = _Slot(FakeProcess(), AnswerAfterKill(killed))
    runner._slots.append(slot)
    replaced: list[_Slot] = []
    runner._spawn = lambda replacing=None: fresh  # type: ignore[method-assign]
    runner._add = lambda new, replacing=None: replaced.append(new)  # type: ignore[method-assign]
    future: Future[Any] = Future()
    slot.busy = future
    worker = threading.Thread(target=runner._run, args=(slot, ROW, future, None))
    worker.start()
    assert runner.kill(future, TimeoutError("timed out"))
    killed.set()  # the child's answer arrives after the kill
    worker.join(10)
    assert slot.process.killed and slot not in runner._free
    assert replaced == [fresh]
    assert isinstance(future.exception(), TimeoutError)
