"""The handler thread pool: calls run first in, first out, an urgent one ahead of them,
each in a context of its own (so are hooks on their lanes)."""

from __future__ import annotations

import contextvars
import threading
from typing import Any

from errands.hooks import Lane
from errands.observability.logcontext import JobLogContext, current_job
from errands.worker.runners import HandlerInterrupt, ThreadRunner


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


FLAG: contextvars.ContextVar[str] = contextvars.ContextVar("test_runner_flag", default="unset")


def test_each_call_runs_in_a_context_of_its_own_even_when_interrupted_mid_set() -> None:
    """Given one handler thread, when a call sets the job's log context and a context
    variable of its own and is interrupted before it resets them (an interrupt landing
    between ``set`` and the ``try`` that resets), then the next call on that thread sees
    neither: its log lines carried the previous job's id."""
    runner = ThreadRunner(1)
    seen: list[object] = []
    finished = threading.Event()

    def interrupted_mid_set() -> None:
        FLAG.set("left by the first call")
        current_job.set(JobLogContext(1, "first", "default", 1))
        raise HandlerInterrupt()

    def done(exc: BaseException | None, result: Any) -> None:
        seen.append(exc if exc is not None else result)
        if len(seen) == 2:
            finished.set()

    try:
        runner.submit(interrupted_mid_set, done)
        runner.submit(lambda: (FLAG.get(), current_job.get()), done)
        assert finished.wait(10)
    finally:
        runner.shutdown()

    assert isinstance(seen[0], HandlerInterrupt)
    assert seen[1] == ("unset", None)


def test_each_hook_runs_in_a_context_of_its_own() -> None:
    """Given a hook lane of one thread, when a hook sets a context variable and never
    resets it, then the next hook on that thread does not see it."""
    lane = Lane("test", 5.0)  # (its thread is a daemon, as every lane's)
    lane.call(FLAG.set, "left by a hook", timeout=10)
    assert lane.call(FLAG.get, timeout=10) == "unset"


def test_whoever_stops_a_call_knows_it_before_it_can_start() -> None:
    """Given a free thread, when a call is submitted with ``made``, then ``made`` has the
    call before it runs: the worker assigned the attempt's call after submit returned,
    and a thread that started at once could reach the point where it is interrupted (a
    timeout, a stop) with no call known to interrupt (1 run in 30 of a pool test)."""
    runner = ThreadRunner(1)
    held: list[Any] = []
    seen: list[bool] = []
    finished = threading.Event()
    try:
        runner.submit(
            lambda: seen.append(bool(held)),
            lambda exc, result: finished.set(),
            made=held.append,
        )
        assert finished.wait(10)
    finally:
        runner.shutdown()
    assert seen == [True]
