"""The handler thread pool: calls run first in, first out, an urgent one ahead of them."""

from __future__ import annotations

import threading
from typing import Any

from errands.worker.runners import ThreadRunner


def test_an_urgent_call_runs_before_the_calls_queued_ahead_of_it() -> None:
    runner = ThreadRunner(1)
    gate = threading.Event()
    order: list[str] = []
    finished = threading.Event()

    def done(exc: BaseException | None, result: Any) -> None:
        assert exc is None
        if len(order) == 5:
            finished.set()

    try:
        runner.submit(lambda: (gate.wait(10), order.append("busy")), done)
        for name in ("first", "second", "third"):
            runner.submit(lambda name=name: order.append(name), done)
        runner.submit(lambda: order.append("urgent"), done, urgent=True)
        gate.set()  # the only thread frees up: it takes the urgent call first
        assert finished.wait(10)
    finally:
        runner.shutdown()

    assert order == ["busy", "urgent", "first", "second", "third"]


def test_an_urgent_call_wakes_an_idle_thread() -> None:
    runner = ThreadRunner(2)
    ran = threading.Event()
    try:
        runner.submit(ran.set, lambda exc, result: None, urgent=True)
        assert ran.wait(10)
    finally:
        runner.shutdown()
