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
- every exception is logged with the callable's name, never raised into the worker;
- a close (``App.close()``, or the stop of the App's last running worker) ends the lanes'
  threads and the watchdog (the process's backoff lane, shared by its Apps, once no
  worker of any App runs): the calls queued before it run within its bound, then each
  thread leaves. A call still queued at the bound is dropped (logged; its future raises
  :class:`LaneClosed`); a call still running then is abandoned (logged once with its
  name, its thread left as a daemon: Python cannot kill a thread) and not waited for,
  nor is a thread already stopped at its limit and replaced. The next call starts the
  lane again (an App may be used after ``close()``). Before, nothing ever ended them:
  every App a process made and closed kept its lanes' threads and a watchdog for good.
- in a child forked from the process, every lane (of an App's runner, and of the
  process's) starts afresh, as one never used: its locks new, its first call starting
  its thread and the watchdog (see :meth:`Lane._forked`). Copied as they were, a lock
  held at the fork by a lane's thread and a busy lane's queue, served by threads the
  child does not have, hung the child's first call through that lane.

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

from .forking import fresh_lock_at_fork, reset_at_fork
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


class LaneClosed(TimeoutError):
    """The call was queued on a lane that closed before it ran (its bound passed): it
    never ran."""


class _Call:
    __slots__ = ("args", "fn", "future", "what")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], what: str) -> None:
        self.fn = fn
        self.args = args
        self.what = what
        self.future: Future[Any] = Future()


class _Crew:
    """One generation of a lane's threads and the queue they serve. A close ends it: a
    mark after its last call, then its threads leave as they reach the mark; the next
    call to the lane starts a new crew. So a call is served by the crew it was queued
    to, and a thread left behind (abandoned in a hung call) never serves a later one."""

    __slots__ = ("ended", "queue", "threads")

    def __init__(self) -> None:
        # Unbounded: the lane counts its room itself, and a close's mark always fits.
        self.queue: queue.Queue[_Call | None] = queue.Queue()
        self.threads: set[threading.Thread] = set()
        self.ended = False  # its close's bound is over: nothing more runs, none is started


class Lane:
    """One ordered, bounded, time-limited runner of user callables (see the module doc)."""

    def __init__(
        self,
        name: str,
        time_limit: float,
        capacity: int = CAPACITY_DEFAULT,
        *,
        on_start: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.time_limit = time_limit
        self.capacity = capacity
        self._on_start = on_start  # told when a crew starts (the runner's watchdog)
        self._lock = threading.Lock()
        self._crew: _Crew | None = None  # serving now; None: not started, or closed
        self._crews: dict[int, _Crew] = {}  # thread ident -> the crew it serves
        self._current: dict[int, tuple[_Call, float]] = {}  # thread ident -> (call, started)
        self._retired: set[int] = set()  # stopped at the limit and replaced: not timed
        self._leaving: set[int] = set()  # replaced, timed again: leave after the call
        # retired while in locking library code (errands.interrupts.in_locking_code),
        # where no interrupt may land: interrupted once out of it (at a later look)
        self._unaimed: set[int] = set()
        self._naming: dict[int, str] = {}  # thread ident -> what its Lane.timed() body runs
        self._threads = 0
        self.dropped = 0
        self.timed_out = 0
        self.abandoned = 0  # calls still running when a close's bound passed

    def _forked(self) -> None:
        """In a child forked from this process, right after the fork, on its only thread
        (os.register_at_fork, through its HookRunner; no I/O, no logging): the lane's
        threads are not in the child, and its lock (and its crew's queue's) may have been
        copied held by one of them (a hook running, or taking its next call): the child's
        first call through the lane hung for good. The lane starts afresh, as one never
        used: a new lock, no crew (the next call starts one, and its thread), nothing
        running. The calls queued in the parent are the parent's to run (its lane runs
        them): the child forgets them, as it forgets its threads."""
        self._lock = threading.Lock()
        self._crew = None
        self._crews = {}
        self._current = {}
        self._retired = set()
        self._leaving = set()
        self._unaimed = set()
        self._naming = {}

    def _thread_for(self, crew: _Crew) -> threading.Thread:
        """A new thread of ``crew`` (call under the lock; start it after)."""
        self._threads += 1
        name = f"errands-{self.name}-{self._threads}"
        thread = threading.Thread(target=self._loop, args=(crew,), name=name, daemon=True)
        crew.threads.add(thread)
        return thread

    def _spawn(self, crew: _Crew | None = None) -> None:
        """One more thread for ``crew`` (default: the one serving now, started if none);
        none for a crew whose close is over."""
        with self._lock:
            if crew is None:
                crew = self._crew = self._crew or _Crew()
            if crew.ended:
                return
            thread = self._thread_for(crew)
        self._start(thread, crew)

    def _start(self, thread: threading.Thread, crew: _Crew) -> None:
        try:
            thread.start()
        except RuntimeError:  # no thread to be had (the process is at its limit)
            log.exception("could not start a thread for the %s lane", self.name)
            with self._lock:
                crew.threads.discard(thread)
                if any(t.is_alive() and t.ident not in self._retired for t in crew.threads):
                    return  # one still serves it
                # None does: its calls are dropped, and the next call tries again.
                if self._crew is crew:
                    self._crew = None
                calls = self._take_queued(crew)
                crew.queue.put_nowait(None)  # a stuck thread of it leaves once back
            self._drop(calls, "no thread could be started for it")
            return
        if self._on_start is not None:
            self._on_start()

    def submit(self, fn: Callable[..., Any], *args: Any, what: str = "") -> Future[Any] | None:
        """Queue ``fn(*args)``; None (logged) when the lane is ``capacity`` calls behind.
        The first call after a close (or ever) starts the lane's threads."""
        call = _Call(fn, args, what or describe(fn))
        thread = None
        with self._lock:
            crew = self._crew
            if crew is None:
                crew = self._crew = _Crew()
                thread = self._thread_for(crew)
            full = crew.queue.qsize() >= self.capacity
            if not full:
                crew.queue.put_nowait(call)
        if thread is not None:
            self._start(thread, crew)
        if full:
            self.dropped += 1
            log.error(
                "%s lane is %d calls behind (a slow or hung %s?); dropped %s",
                self.name,
                self.capacity,
                self.name,
                call.what,
            )
            return None
        return call.future

    @contextlib.contextmanager
    def timed(self, what: str = "") -> Iterator[None]:
        """Give the body its own time limit: a call that runs several user callables one
        after another (a death's on_dead hooks) wraps each in ``timed()``, so each has
        the whole limit, and one stopped at its limit does not leave the next untimed.
        The body's HookTimeout is raised from the ``with`` (at the latest from its exit),
        never after it. ``what``: the callable the body runs, named in the logs of its
        stop (or abandonment at a close) rather than the call's. A no-op off the lane's
        threads."""
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
                if what:
                    self._naming[me] = what
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
                self._naming.pop(me, None)
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
                ident not in self._retired
                and self._crews.get(ident) is self._crew
                and now - started > self.time_limit
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

    def _loop(self, crew: _Crew) -> None:
        me = threading.get_ident()
        with self._lock:
            self._crews[me] = crew
        try:
            with contextlib.suppress(HookTimeout):  # aimed at it as it retired: nothing to stop
                self._serve(crew, me)
        finally:  # (no interrupt is aimed at it any more: it is out of _current)
            with self._lock:
                self._crews.pop(me, None)
                crew.threads.discard(threading.current_thread())

    def _serve(self, crew: _Crew, me: int) -> None:
        while True:
            try:
                call = crew.queue.get()
            except HookTimeout:  # aimed at the call that just ended: nothing to stop
                continue
            if call is None:  # the crew's close: the mark stays for its other threads
                crew.queue.put_nowait(None)
                return
            with self._lock:
                late = crew.ended  # taken as its close dropped the rest: dropped too
                if not late:
                    self._current[me] = (call, time.monotonic())
            if late:
                self._drop([call], "its lane closed")
                continue
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
            self._naming.pop(me, None)
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
            self._naming.pop(me, None)
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
                crew = self._crews.get(ident)
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
                what = self._naming.get(ident) or call.what
                aimed.append((what, ident not in self._leaving, crew))
        for what, replace, crew in aimed:
            self.timed_out += 1
            log.error(
                "%s ran longer than its %g s limit; interrupting it and moving on (it may "
                "still be running)",
                what,
                self.time_limit,
            )
            if replace and crew is not None:  # (none for a crew whose close is over)
                self._spawn(crew)

    def backlog(self) -> int:
        crew = self._crew
        return 0 if crew is None else crew.queue.qsize()

    def idle(self) -> bool:
        """Nothing queued, and no call running on the crew serving now (a thread stopped
        at its limit, or abandoned by a close, is not waited for)."""
        with self._lock:
            crew = self._crew
            busy = any(i not in self._retired and self._crews.get(i) is crew for i in self._current)
        return not busy and (crew is None or crew.queue.empty())

    # -- closing -----------------------------------------------------------------------
    def close(self, timeout: float) -> bool:
        """End the lane's threads (see the module doc): the calls queued before this run
        within ``timeout`` seconds, then the threads leave; what is still queued then is
        dropped, what still runs is abandoned (both logged). The next call starts the
        lane again. True when every call ran and every thread left."""
        crew = self._close_begin()
        if crew is None:
            return True
        self._close_wait(crew, time.monotonic() + timeout)
        return self._close_end(crew, timeout)

    def _close_begin(self) -> _Crew | None:
        """Stop queueing to the crew serving now (a later call starts a new one) and mark
        the end of its queue: its threads leave once they reach the mark."""
        with self._lock:
            crew, self._crew = self._crew, None
            if crew is not None:
                crew.queue.put_nowait(None)
        return crew

    def _close_wait(self, crew: _Crew, deadline: float) -> None:
        """Wait until ``deadline`` for the threads of ``crew`` to leave, but not for one
        stopped at its limit and replaced (its replacement serves the calls behind it),
        nor for the caller (a hook that closes its own App)."""
        me = threading.current_thread()
        while True:
            with self._lock:
                serving = [
                    t
                    for t in crew.threads
                    if t is not me and t.is_alive() and t.ident not in self._retired
                ]
            left = deadline - time.monotonic()
            if not serving or left <= 0:
                return
            serving[0].join(min(left, WATCH_INTERVAL))

    def _close_end(self, crew: _Crew, timeout: float) -> bool:
        """The bound is over: drop what is still queued, abandon what still runs."""
        me = threading.current_thread()
        with self._lock:
            crew.ended = True
            calls = self._take_queued(crew)
            crew.queue.put_nowait(None)
            running = []  # (thread, what it runs, whether stopped at its limit already)
            for thread in crew.threads:
                ident = thread.ident
                if thread is me or not thread.is_alive() or ident not in self._current:
                    continue
                what = self._naming.get(ident) or self._current[ident][0].what
                running.append((thread, what, ident in self._retired))
            between = [  # past their last call: they leave at the mark, running nothing
                t
                for t in crew.threads
                if t is not me and t.is_alive() and t.ident not in self._current
            ]
            self.abandoned += len(running)
        for thread in between:
            thread.join(1.0)
        for thread, what, stopped in running:
            log.error(
                "%s still ran when the %s lane closed (%s); abandoned: its thread %s is "
                "left running as a daemon (a thread cannot be killed) and not waited for",
                what,
                self.name,
                "past its limit, its interrupt not landed yet"
                if stopped
                else f"{timeout:g} s after the close began",
                thread.name,
            )
        if calls:
            log.warning(
                "the %s lane closed with %d call(s) still queued after %g s; dropped: %s%s",
                self.name,
                len(calls),
                timeout,
                ", ".join(c.what for c in calls[:5]),
                ", ..." if len(calls) > 5 else "",
            )
            self._drop(calls, f"its lane closed before it ran ({timeout:g} s)")
        return not calls and not running

    @staticmethod
    def _take_queued(crew: _Crew) -> list[_Call]:
        """The calls still queued to ``crew``, taken out (the mark too)."""
        calls: list[_Call] = []
        while True:
            try:
                call = crew.queue.get_nowait()
            except queue.Empty:
                return calls
            if call is not None:
                calls.append(call)

    def _drop(self, calls: list[_Call], why: str) -> None:
        for call in calls:
            if not call.future.done():
                call.future.set_exception(LaneClosed(f"{call.what} never ran: {why}"))


class HookRunner:
    """The lanes of one App: ``events`` (subscribers), ``dead`` (``on_dead`` hooks) and
    ``backoff`` (policies called with a deadline), and the watchdog that times them."""

    def __init__(self, hook_timeout: float = HOOK_TIMEOUT_DEFAULT) -> None:
        self.hook_timeout = hook_timeout
        self._lanes: dict[str, Lane] = {}
        self._lock = threading.Lock()
        # running now, with what stops it; None: not started, or stopped by close()
        self._watchdog: tuple[threading.Thread, threading.Event] | None = None
        reset_at_fork(self)  # its lanes start afresh in a forked child (_forked)

    def _forked(self) -> None:
        """In a child forked from this process (os.register_at_fork; no I/O, no logging):
        its lock starts afresh, and so does each lane (:meth:`Lane._forked`); the
        watchdog's thread is not in the child, so it is started again with a lane's
        first thread there."""
        self._lock = threading.Lock()
        self._watchdog = None
        for lane in list(self._lanes.values()):
            lane._forked()

    def lane(self, name: str) -> Lane:
        """The lane ``name``; its threads (and the watchdog) start with its first call."""
        lane = self._lanes.get(name)
        if lane is None:
            with self._lock:
                lane = self._lanes.get(name)
                if lane is None:
                    limit = BACKOFF_TIMEOUT if name == "backoff" else self.hook_timeout
                    lane = self._lanes[name] = Lane(name, limit, on_start=self._start_watchdog)
        return lane

    def _start_watchdog(self) -> None:
        """A lane started threads: the watchdog runs (again, after a close)."""
        with self._lock:
            if self._watchdog is not None:
                return
            stop = threading.Event()
            thread = threading.Thread(
                target=self._watch, args=(stop,), name="errands-hooks-watchdog", daemon=True
            )
            self._watchdog = (thread, stop)
        thread.start()

    def _watch(self, stop: threading.Event) -> None:
        while not stop.wait(WATCH_INTERVAL):
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

    def close(self, timeout: float) -> bool:
        """End every lane's threads and the watchdog (see the module doc): the calls
        queued before this run within ``timeout`` seconds (all lanes at once), then the
        threads leave; a call still queued then is dropped, one still running abandoned
        (logged). A later call starts its lane again. True when every call ran and every
        thread left."""
        deadline = time.monotonic() + timeout
        closing = []
        for lane in list(self._lanes.values()):
            crew = lane._close_begin()
            if crew is not None:
                closing.append((lane, crew))
        for lane, crew in closing:  # the watchdog still stops a call past its limit
            lane._close_wait(crew, deadline)
        clean = all([lane._close_end(crew, timeout) for lane, crew in closing])
        with self._lock:
            watchdog = None
            if all(lane._crew is None for lane in self._lanes.values()):  # none started again
                watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            thread, stop = watchdog
            stop.set()
            if thread is not threading.current_thread():
                thread.join(1.0)
        return clean


_shared: HookRunner | None = None
_shared_lock = threading.Lock()
# a new one in a forked child; each runner is told of the fork itself (HookRunner._forked)
fresh_lock_at_fork(globals(), "_shared_lock")


def shared_runner() -> HookRunner:
    """The process's runner for lanes not tied to one App (backoff policies)."""
    global _shared
    if _shared is None:
        with _shared_lock:
            if _shared is None:
                _shared = HookRunner()
    return _shared


def close_shared(timeout: float) -> bool:
    """End the threads of the process's runner (:func:`shared_runner`: the backoff lane
    and its watchdog) as :meth:`HookRunner.close` ends an App's: the calls queued before
    it run within ``timeout``; the next call starts the lane again. Its caller decides
    that no worker of the process needs it now (App.close(), the stop of the last
    worker: see ``App._close_process_lanes``). True when nothing was left."""
    runner = _shared
    return True if runner is None else runner.close(timeout)
