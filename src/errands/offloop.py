"""Where errands' own blocking calls go when async code awaits them: threads of errands'
own, never the event loop's default executor.

``asyncio.to_thread`` runs in the loop's default executor, ``min(32, cpu + 4)`` threads
(6 on a 2-core machine), which the application's own ``asyncio.to_thread`` calls share.
errands' calls queued behind them: six async handlers each awaiting a slow library call
in a thread (what docs/async.md tells them to do) held every other async job's payload
decoding, step reads and result encoding, and a job with a 5 s timeout timed out without
running; ``handle.aresult(timeout=1)`` took 8 s when an application's threads were busy.

- :func:`run`: ``fn(*args)`` in the executor of the running loop: the one a worker
  registered for its own loop (:func:`own_executor_for`, sized to the worker), else the
  process's :func:`client_executor` (``CLIENT_THREADS`` threads, made on first use and
  made again in a forked child). The caller's context variables go with the call, as
  ``asyncio.to_thread`` takes them.
- :class:`Lane`: one thread of its own running calls one at a time, in order (an async
  handler's ``ctx.atransaction()``: its opening, which may wait for a lock, and its
  statements run there, so no other job's work waits behind them, nor they behind it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

CLIENT_THREADS = 32  # the most threads errands' async client calls use in one process

_lock = threading.Lock()
_client: concurrent.futures.ThreadPoolExecutor | None = None
_loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, concurrent.futures.Executor] = (
    weakref.WeakKeyDictionary()
)


def client_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The process's threads for errands' calls from the application's event loops."""
    global _client
    executor = _client
    if executor is None:
        with _lock:
            if _client is None:
                _client = concurrent.futures.ThreadPoolExecutor(
                    CLIENT_THREADS, thread_name_prefix="errands-async"
                )
            executor = _client
    return executor


def own_executor_for(
    loop: asyncio.AbstractEventLoop, executor: concurrent.futures.Executor | None
) -> None:
    """Run errands' calls made on ``loop`` in ``executor`` (None: the client's again)."""
    with _lock:
        if executor is None:
            _loops.pop(loop, None)
        else:
            _loops[loop] = executor


def executor() -> concurrent.futures.Executor:
    """errands' executor for calls made on the running loop."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return client_executor()
    return _loops.get(loop) or client_executor()


async def run(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in errands' threads (see the module's docstring), with the
    caller's context variables, as ``asyncio.to_thread`` runs it in the default executor."""
    loop = asyncio.get_running_loop()
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await loop.run_in_executor(executor(), call)


def _forget_after_fork() -> None:
    """A forked child has none of its parent's threads: its pool is made anew."""
    global _client, _lock
    _client = None
    _lock = threading.Lock()
    _loops.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


class LaneClosed(RuntimeError):
    """A call submitted to a :class:`Lane` after it was closed."""


_STOP = object()


class Lane:
    """One daemon thread, started on the first call, running calls one at a time in the
    order given. :meth:`close` lets the calls already given run, then ends the thread; a
    call given after it raises LaneClosed. A daemon thread: one held in a statement (a
    lock that is never let go) never holds up the end of the process."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = False
        self._closed = False

    def submit(self, fn: Callable[..., T], /, *args: Any) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        context = contextvars.copy_context()
        with self._lock:
            if self._closed:
                raise LaneClosed(f"{self._name} is closed")
            if not self._started:
                threading.Thread(target=self._run, name=self._name, daemon=True).start()
                self._started = True
            self._calls.put((future, context, fn, args))
        return future

    async def run(self, fn: Callable[..., T], /, *args: Any) -> T:
        """``fn(*args)`` on the lane's thread, awaited. Cancelling the awaiting task
        cancels a call that has not begun; one that has goes on to its end there."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._started:
                self._calls.put(_STOP)

    @property
    def closed(self) -> bool:
        return self._closed

    def _run(self) -> None:
        while (call := self._calls.get()) is not _STOP:
            future, context, fn, args = call
            if not future.set_running_or_notify_cancel():
                continue  # cancelled before it began
            try:
                result = context.run(fn, *args)
            except BaseException as exc:  # the caller's to have (as a thread pool's call)
                future.set_exception(exc)
            else:
                future.set_result(result)
            del call, future, context, fn, args  # nothing of it held while idle
