"""Where handlers run: a thread pool for plain functions, an event loop for ``async def``.

The thread pool can *abandon* a thread whose handler overran its timeout: Python cannot
kill a thread, so the pool starts a replacement and lets the stuck one retire whenever
its handler returns. Capacity stays constant; the stuck thread holds no slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any

log = logging.getLogger("errands.worker")

_STOP = object()


class ThreadRunner:
    def __init__(self, size: int, name: str = "errands-job") -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._name = name
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._retire: set[int] = set()
        self._running: dict[int, Future[Any]] = {}  # thread ident -> its current future
        self._counter = 0
        self.abandoned = 0
        for _ in range(size):
            self._spawn()

    def _spawn(self) -> None:
        with self._lock:
            self._counter += 1
            thread = threading.Thread(
                target=self._loop, name=f"{self._name}-{self._counter}", daemon=True
            )
            self._threads.add(thread)
        thread.start()

    def _loop(self) -> None:
        me = threading.get_ident()
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            future, fn = item
            if not future.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._running[me] = future
            try:
                future.set_result(fn())
            except BaseException as exc:  # the handler's failure is the future's result
                future.set_exception(exc)
            finally:
                with self._lock:
                    self._running.pop(me, None)
                    retire = me in self._retire
                    self._retire.discard(me)
            if retire:
                break
        with self._lock:
            self._threads.discard(threading.current_thread())

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self._queue.put((future, fn))
        return future

    def abandon(self, future: Future[Any]) -> None:
        """Give up on a running call: its thread retires when it returns; a new one replaces it."""
        with self._lock:
            idents = [ident for ident, f in self._running.items() if f is future]
            if not idents:
                return
            self._retire.add(idents[0])
            self.abandoned += 1
        self._spawn()

    def stuck(self) -> int:
        with self._lock:
            return len(self._retire)

    def shutdown(self) -> None:
        with self._lock:
            count = len(self._threads)
        for _ in range(count):
            self._queue.put(_STOP)


class LoopRunner:
    """One asyncio event loop in a daemon thread, running every async handler."""

    def __init__(self, name: str = "errands-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        self.loop.run_forever()

    def submit(self, factory: Callable[[], Coroutine[Any, Any, Any]]) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(factory(), self.loop)

    def call(self, fn: Callable[[], Any]) -> None:
        with contextlib.suppress(RuntimeError):  # loop already closed at shutdown
            self.loop.call_soon_threadsafe(fn)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Cancel the tasks still running, let them unwind (up to ``timeout``), then stop.

        Stopping the loop with tasks pending would destroy them mid-``await`` (their
        cleanup never runs, and they fail when garbage-collected in another context).
        """
        if self.loop.is_running():
            with contextlib.suppress(Exception):  # loop stopped meanwhile, or timeout
                asyncio.run_coroutine_threadsafe(_cancel_all(timeout), self.loop).result(
                    timeout + 1
                )
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive() and not self.loop.is_closed():
            self.loop.close()  # its self-pipe sockets; an unclosed loop warns when collected


async def _cancel_all(timeout: float) -> None:
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current]
    for task in tasks:
        if not task.cancelling():  # one already cancelled may be running its cleanup
            task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)
