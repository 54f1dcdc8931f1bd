"""The work a durable step's fn starts on the worker's event loop: an async step cut short
by a cancel runs until that work is over, not only until its fn's frame is.

An async step cut short by a cancel (a graceful stop's, a timeout's) ends its frame at
once, but what its fn awaited may go on: a task under ``asyncio.shield(...)``, a thread of
``asyncio.to_thread(...)`` or ``loop.run_in_executor(...)`` (a thread cannot be stopped:
the cancel only ends the waiting for it). Counted as over then, the step let its job be
given back (or decided), and the next run, finding no stored result, ran the step's effect
again beside the first.

The loop that runs async handlers (:class:`errands.worker.runners.LoopRunner`) is made to
count that work (:func:`track_steps`): while a step's fn runs, :data:`STEP` names the step
(a context variable: the tasks the fn starts inherit it, and so do theirs), each task
created then (:func:`task_factory`) and each call handed to an executor through
``run_in_executor`` (``asyncio.to_thread`` too) is the step's work. A step whose fn was
cut short by a cancel stays in flight until the last of it is over
(:class:`errands.worker.runtime.StepInFlight`); one whose fn returned or raised its own
error is over at once (what it leaves running is the fn's own background work: a client's
token refresher, a keepalive), and its work is counted no more. What is started outside
the loop (a ``threading.Thread`` of its own, another loop) is not seen. A step's fn cut
short by a cancel on a loop that does not count its work (not the worker's, or one whose
task factory or ``run_in_executor`` was replaced since: :func:`counts_step_work`) is held
as possibly running (see :meth:`errands.worker.runtime.AttemptRuntime.astep`).

Nothing is counted outside a step: the task factory adds a context-variable read to each
task the loop creates, and ``run_in_executor`` outside a step is the loop's own. What
:data:`STEP` holds refers to its step weakly: a long-lived task the fn started keeps
neither the step nor its attempt alive.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import weakref
from collections.abc import Callable, Coroutine, Generator
from typing import Any, Protocol


class StepWork(Protocol):
    """What counts a step's work (:class:`errands.worker.runtime.StepInFlight`)."""

    def work_begins(self, work: asyncio.Task[Any] | concurrent.futures.Future[Any]) -> bool:
        """Count ``work`` (a task, or an executor's future) as the step's until it is over;
        False when the step is over (not counted)."""
        ...

    def work_ends(self, _done: object = None) -> None:
        """One piece of work counted by :meth:`work_begins` is over."""
        ...


_COUNTING: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
_OURS = "__errands_counts_step_work__"  # marks the run_in_executor of track_steps

STEP: contextvars.ContextVar[StepWork | None] = contextvars.ContextVar(
    "errands_step_work", default=None
)


def task_factory(
    loop: asyncio.AbstractEventLoop,
    coro: Coroutine[Any, Any, Any] | Generator[Any, None, Any],
    **kwargs: Any,
) -> asyncio.Task[Any]:
    """The loop's task factory: a plain task, counted as the work of the step whose fn
    created it (if any)."""
    task: asyncio.Task[Any] = asyncio.Task(coro, loop=loop, **kwargs)
    context = kwargs.get("context")
    step = STEP.get() if context is None else context.get(STEP)
    if step is not None and step.work_begins(task):
        task.add_done_callback(step.work_ends)
    return task


def track_steps(
    loop: asyncio.AbstractEventLoop, default_executor: concurrent.futures.Executor
) -> None:
    """Make ``loop`` (new, not running yet) count the work of the steps run on it: its
    tasks through :func:`task_factory`, its ``run_in_executor`` calls (``default_executor``
    when given None, as the loop's own default) through a wrapper of its own."""
    loop.set_task_factory(task_factory)  # type: ignore[arg-type]
    own = loop.run_in_executor

    def run_in_executor(
        executor: concurrent.futures.Executor | None, func: Callable[..., Any], *args: Any
    ) -> asyncio.Future[Any]:
        step = STEP.get()
        if step is None:
            return own(executor, func, *args)
        # As BaseEventLoop.run_in_executor does, keeping the executor's future: it alone
        # says when the thread is over (the loop's future is cancelled with the waiting)
        if loop.is_closed():
            raise RuntimeError("Event loop is closed")
        future = (executor if executor is not None else default_executor).submit(func, *args)
        if step.work_begins(future):
            future.add_done_callback(step.work_ends)
        return asyncio.wrap_future(future, loop=loop)

    setattr(run_in_executor, _OURS, True)
    loop.run_in_executor = run_in_executor  # type: ignore[method-assign, assignment]
    _COUNTING.add(loop)


def counts_step_work(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` counts the work of the steps run on it (:func:`track_steps`), now:
    not once a handler or a library replaced its task factory (``loop.set_task_factory``)
    or its ``run_in_executor``: the tasks or threads started since are not counted."""
    return (
        loop in _COUNTING
        and loop.get_task_factory() is task_factory
        and getattr(loop.run_in_executor, _OURS, False) is True
    )
