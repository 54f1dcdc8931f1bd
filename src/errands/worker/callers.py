"""Store calls on helper threads, waited for no longer than they can help.

A store call can hang without an error: a network partition that drops packets (no RST)
leaves a PostgreSQL client waiting for its TCP timeouts (a minute by default), a lock
another session holds keeps a statement waiting on the server, SQLite's write lock keeps
a writer waiting up to its ``write_timeout``. A thread that must act in time (the lease
keeper's heartbeats, the maintenance leader's election) makes such calls on a helper
thread and waits for the answer only as long as it is of use: past that, the call counts
as failed (TimeoutError), its helper waits it out, and the next call goes to another
helper (a new one while fewer than ``most`` hang). A stopping worker makes its last
calls (the leadership's resignation, leaving the registry) the same way, each on a
helper of its own (:func:`call_within`), so that a store that stops answering cannot
hold its stop.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class Caller:
    """A daemon thread running database calls one at a time (one thread, so one SQLite
    connection, for the life of its owner)."""

    def __init__(self, name: str = "errands-heartbeat") -> None:
        self.busy = False
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self.busy = True
        self._calls.put((fn, future))
        return future

    def stop(self) -> None:
        self._calls.put(None)

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            fn, future = item
            try:
                result = fn()
            except BaseException as exc:
                self.busy = False
                future.set_exception(exc)
            else:
                self.busy = False
                future.set_result(result)


class Callers:
    """Up to ``most`` :class:`Caller` threads named ``name``, started on need; used from
    one thread at a time (its owner's)."""

    def __init__(self, name: str, most: int) -> None:
        self.name = name
        self.most = most
        self._callers: list[Caller] = []

    def call(self, fn: Callable[[], T], wait: float, what: str) -> T:
        """``fn()`` on an idle helper, its answer waited for at most ``wait`` seconds:
        TimeoutError naming ``what`` when none comes by then (the call goes on in its
        helper, its answer unread), or at once when every helper still waits for one."""
        caller = next((c for c in self._callers if not c.busy), None)
        if caller is None:
            if len(self._callers) >= self.most:
                raise TimeoutError(f"{self.most} earlier {what}s still wait for an answer")
            caller = Caller(self.name)
            self._callers.append(caller)
        call = caller.submit(fn)
        try:
            return call.result(timeout=wait)
        except TimeoutError:
            if call.done():  # fn's own TimeoutError
                raise
            raise TimeoutError(f"no answer to the {what} within {wait:.2f} s") from None

    def stop(self) -> None:
        """End the helpers once their call in hand (if any) is over."""
        for caller in self._callers:
            caller.stop()


def call_within(fn: Callable[[], T], wait: float, what: str, name: str) -> T:
    """``fn()`` on a helper thread of its own (named ``name``), its answer waited for at
    most ``wait`` seconds: TimeoutError naming ``what`` when none comes by then (the call
    goes on in its helper, which ends once it is over). For a call made once, from any
    thread."""
    callers = Callers(name, 1)
    try:
        return callers.call(fn, wait, what)
    finally:
        callers.stop()
