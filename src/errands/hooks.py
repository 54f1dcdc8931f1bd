"""User code off the worker's own threads: each kind of user callable runs on a lane.

The worker's completer, claim loop, lease keeper and the maintenance leader must never
wait on user code: a 6 s ``on_dead`` hook on the completer thread would delay every other
outcome by 6 s, and a hung one would stall them for ever while heartbeats keep the leases
alive. So ``on_dead`` hooks, event subscribers and backoff policies called from those
threads run on a :class:`Lane` instead:

- one daemon thread per lane runs its calls in order (events keep their order);
- a bounded queue: when a lane falls ``capacity`` calls behind, a new call is dropped and
  logged at ERROR (the worker never blocks on it);
- a time limit per call: past it the call is logged at ERROR, ``HookTimeout`` is raised
  inside it (pure-Python code stops at its next bytecode; its ``finally`` blocks run), and
  a fresh thread takes the lane over, so the calls behind it go on. At most
  ``STUCK_MAX`` abandoned threads per lane are tolerated; past that the lane stops
  replacing them and its queue fills (and drops), rather than leak threads without bound;
- every exception is logged with the callable's name, never raised into the worker.

::

    completer / leases / maintenance ──submit──> [lane queue] ──> lane thread ──> hook(job)
                                                                      ^
                                                   watchdog ── past the limit: interrupt,
                                                               replace the thread
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from .interrupts import Interrupt, aim, aim_unless_shielded, drop_pending, is_shielded

log = logging.getLogger("errands.hooks")

HOOK_TIMEOUT_DEFAULT = 10.0  # seconds one on_dead hook or event subscriber may run
BACKOFF_TIMEOUT = 1.0  # seconds a backoff policy may take before the default is used
CAPACITY_DEFAULT = 1000
STUCK_MAX = 4
WATCH_INTERVAL = 0.1

_protected = threading.local()


class HookTimeout(Interrupt):
    """Raised inside a user callable that ran past its lane's time limit. A BaseException,
    so an ``except Exception`` in the hook does not swallow it."""


def protect_current_thread(protected: bool = True) -> None:
    """Mark this thread as one of the worker's own (completer, claim loop, lease keeper,
    maintenance): user code reached from it runs on a lane, never inline."""
    _protected.value = protected


def on_protected_thread() -> bool:
    return getattr(_protected, "value", False)


def describe(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


class _Call:
    __slots__ = ("args", "fn", "future", "what")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], what: str) -> None:
        self.fn = fn
        self.args = args
        self.what = what
        self.future: Future[Any] = Future()


class Lane:
    """One ordered, bounded, time-limited runner of user callables (see the module doc)."""

    def __init__(self, name: str, time_limit: float, capacity: int = CAPACITY_DEFAULT) -> None:
        self.name = name
        self.time_limit = time_limit
        self._queue: queue.Queue[_Call | None] = queue.Queue(maxsize=capacity)
        self._lock = threading.Lock()
        self._current: dict[int, tuple[_Call, float]] = {}  # thread ident -> (call, started)
        self._retired: set[int] = set()  # stopped at the limit and replaced: not timed
        self._leaving: set[int] = set()  # replaced, timed again: leave after the call
        # retired while in locking library code (errands.interrupts.in_locking_code),
        # where no interrupt may land: interrupted once out of it (at a later look)
        self._unaimed: set[int] = set()
        self._threads = 0
        self.dropped = 0
        self.timed_out = 0
        self._spawn()

    def _spawn(self) -> None:
        with self._lock:
            self._threads += 1
            number = self._threads
        threading.Thread(
            target=self._loop, name=f"errands-{self.name}-{number}", daemon=True
        ).start()

    def submit(self, fn: Callable[..., Any], *args: Any, what: str = "") -> Future[Any] | None:
        """Queue ``fn(*args)``; None (logged) when the lane is ``capacity`` calls behind."""
        call = _Call(fn, args, what or describe(fn))
        try:
            self._queue.put_nowait(call)
        except queue.Full:
            self.dropped += 1
            log.error(
                "%s lane is %d calls behind (a slow or hung %s?); dropped %s",
                self.name,
                self._queue.maxsize,
                self.name,
                call.what,
            )
            return None
        return call.future

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Give the body its own time limit: a call that runs several user callables one
        after another (a death's on_dead hooks) wraps each in ``timed()``, so each has
        the whole limit, and one stopped at its limit does not leave the next untimed.
        The body's HookTimeout is raised from the ``with`` (at the latest from its exit),
        never after it. A no-op off the lane's threads."""
        me = threading.get_ident()
        with self._lock:
            entry = self._current.get(me)
            if entry is not None:
                if me in self._retired:
                    # The last callable was stopped at its limit and this thread replaced:
                    # it goes on with this call, timed again, and leaves after it.
                    self._retired.discard(me)
                    if me not in self._unaimed:  # aimed: one still on its way was for it
                        drop_pending()
                    self._unaimed.discard(me)
                    self._leaving.add(me)
                self._current[me] = (entry[0], time.monotonic())
        if entry is None:
            yield
            return
        landed = False
        try:
            yield
        except HookTimeout:
            landed = True
            raise
        finally:
            with self._lock:
                # Interrupts are aimed under this lock, at a thread past its limit and
                # not retired: after this none can come for the body. One aimed at it
                # and not landed is dropped (only then: every hook paid for it before).
                stopped = me in self._retired
                if stopped and not landed and me not in self._unaimed:
                    drop_pending()
                self._unaimed.discard(me)
                self._current[me] = (entry[0], time.monotonic())
            if stopped and not landed:  # aimed, not yet landed: land it here
                raise HookTimeout

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float, what: str = "") -> Any:
        """Run ``fn(*args)`` on the lane and wait at most ``timeout`` for its result;
        raises what it raised, or TimeoutError (it may still finish later, unused)."""
        with self._lock:
            stuck = len(self._retired)
            now = time.monotonic()
            serving_stuck = any(
                ident not in self._retired and now - started > self.time_limit
                for ident, (_call, started) in self._current.items()
            )
        if stuck >= STUCK_MAX and serving_stuck:
            # Its serving thread is stuck too, and no more are replaced: the call would
            # only wait out its deadline (every later one as well).
            raise TimeoutError(
                f"the {self.name} lane has {stuck + 1} calls stuck past their limit; not waiting"
            )
        future = self.submit(fn, *args, what=what)
        if future is None:
            raise TimeoutError(f"the {self.name} lane is full")
        return future.result(timeout=timeout)

    def _loop(self) -> None:
        with contextlib.suppress(HookTimeout):  # aimed at it as it retired: nothing to stop
            self._serve()

    def _serve(self) -> None:
        me = threading.get_ident()
        while True:
            try:
                call = self._queue.get()
            except HookTimeout:  # aimed at the call that just ended: nothing to stop
                continue
            if call is None:
                return
            with self._lock:
                self._current[me] = (call, time.monotonic())
            try:
                try:
                    # In a context of its own (see errands.worker.runners): nothing a
                    # hook set stays for the next, interrupted or not.
                    result = contextvars.copy_context().run(call.fn, *call.args)
                except HookTimeout:
                    call.future.set_exception(TimeoutError(f"{call.what} ran too long"))
                except BaseException as exc:
                    log.exception("%s failed", call.what)
                    call.future.set_exception(exc)
                else:
                    call.future.set_result(result)
            except HookTimeout:  # landed between the call's end and here
                if not call.future.done():
                    call.future.set_exception(TimeoutError(f"{call.what} ran too long"))
            try:  # around the call: one landing at _call_ended's entry is caught too
                ended = self._call_ended(me)
            except HookTimeout:
                ended = self._call_ended_late(me)
            if ended:
                return

    def _call_ended(self, me: int) -> bool:
        """The lane's books once a call on thread ``me`` ended; True when the thread must
        leave (replaced while stuck: the new thread has the lane). The watchdog may aim at
        this thread until it is out of ``_current``: the caller catches an interrupt that
        lands here (at the entry, or as the lock is taken) and closes the books with
        :meth:`_call_ended_late` (they were left half done: the thread gone with its id
        counted as stuck; after four, no hook of the lane was ever stopped again)."""
        with self._lock:
            self._current.pop(me, None)
            aimed = me in self._retired and me not in self._unaimed
            self._unaimed.discard(me)
            if me in self._retired or me in self._leaving:
                self._retired.discard(me)
                self._leaving.discard(me)
                if aimed:  # an interrupt not yet delivered has nothing to stop
                    drop_pending()
                return True
            return False

    def _call_ended_late(self, me: int) -> bool:
        """The books of a call whose thread an interrupt reached as it closed the call:
        the thread was replaced, so it leaves."""
        with self._lock:
            self._current.pop(me, None)
            self._retired.discard(me)
            self._leaving.discard(me)
            self._unaimed.discard(me)
        return True

    def watch(self, now: float) -> None:
        """Interrupt and replace a call past the time limit (the watchdog calls this)."""
        with self._lock:
            for ident in list(self._unaimed):  # retired in locking code: out of it now?
                if aim_unless_shielded(ident, functools.partial(aim, ident, HookTimeout)):
                    self._unaimed.discard(ident)
            late = [
                (ident, call)
                for ident, (call, started) in self._current.items()
                if ident not in self._retired and now - started > self.time_limit
            ]
            if not late or len(self._retired) >= STUCK_MAX:
                return
            aimed = []
            for ident, call in late:
                # Not inside errands' own store call (errands.interrupts): the next look
                # interrupts it once it is out. In locking library code, where it may be
                # blocked for good (an Event.wait()), it is replaced now and interrupted
                # once out of it.
                if not aim_unless_shielded(ident, functools.partial(aim, ident, HookTimeout)):
                    if is_shielded(ident):
                        continue
                    self._unaimed.add(ident)
                self._retired.add(ident)  # under the lock: it is still inside that call
                # A thread already replaced (timed again by Lane.timed) is not the
                # lane's: replacing it again left one more thread serving for good.
                aimed.append((call, ident not in self._leaving))
        for call, replace in aimed:
            self.timed_out += 1
            log.error(
                "%s ran longer than its %g s limit; interrupting it and moving on (it may "
                "still be running)",
                call.what,
                self.time_limit,
            )
            if replace:
                self._spawn()

    def backlog(self) -> int:
        return self._queue.qsize()

    def idle(self) -> bool:
        with self._lock:
            busy = any(i not in self._retired for i in self._current)
        return not busy and self._queue.empty()


class HookRunner:
    """The lanes of one App: ``events`` (subscribers), ``dead`` (``on_dead`` hooks) and
    ``backoff`` (policies called with a deadline), and the watchdog that times them."""

    def __init__(self, hook_timeout: float = HOOK_TIMEOUT_DEFAULT) -> None:
        self.hook_timeout = hook_timeout
        self._lanes: dict[str, Lane] = {}
        self._lock = threading.Lock()
        self._watchdog: threading.Thread | None = None

    def lane(self, name: str) -> Lane:
        lane = self._lanes.get(name)
        if lane is None:
            with self._lock:
                lane = self._lanes.get(name)
                if lane is None:
                    limit = BACKOFF_TIMEOUT if name == "backoff" else self.hook_timeout
                    lane = self._lanes[name] = Lane(name, limit)
                    if self._watchdog is None:
                        self._watchdog = threading.Thread(
                            target=self._watch, name="errands-hooks-watchdog", daemon=True
                        )
                        self._watchdog.start()
        return lane

    def _watch(self) -> None:
        while True:
            time.sleep(WATCH_INTERVAL)
            now = time.monotonic()
            for lane in list(self._lanes.values()):
                try:
                    lane.watch(now)
                except Exception:  # pragma: no cover - keep the watchdog alive
                    log.exception("hook watchdog failed")

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for every lane to finish what is queued (a graceful stop
        lets the last on_dead hooks run); True when all are idle."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(lane.idle() for lane in list(self._lanes.values())):
                return True
            time.sleep(0.01)
        return all(lane.idle() for lane in list(self._lanes.values()))


_shared: HookRunner | None = None
_shared_lock = threading.Lock()


def shared_runner() -> HookRunner:
    """The process's runner for lanes not tied to one App (backoff policies)."""
    global _shared
    if _shared is None:
        with _shared_lock:
            if _shared is None:
                _shared = HookRunner()
    return _shared
