"""Where handlers run: a thread pool for plain functions, an event loop for ``async def``.

A handler thread past its timeout is first *interrupted*: :class:`HandlerInterrupt` is
raised inside it asynchronously (``PyThreadState_SetAsyncExc``), which stops pure-Python
code at its next bytecode and runs its ``finally`` blocks; code blocked in a C call (a
long ``time.sleep``, a socket read) sees it only when that call returns. A thread that
still has not stopped can be *abandoned*: Python cannot kill a thread, so the pool starts
a replacement and lets the stuck one retire whenever its handler returns.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import contextvars
import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any

from .. import offloop
from ..errors import ConfigurationError
from ..interrupts import Interrupt, aim, aim_unless_shielded, drop_pending
from . import stepwork

Done = Callable[[BaseException | None, Any], None]

log = logging.getLogger("errands.worker")

_STOP = object()
SHIELD_RETRY = 0.01  # seconds: an interrupt deferred by a shield is tried again after
SHIELD_RETRY_MAX = 0.1  # seconds: ... doubling up to this
_NUDGE = object()  # queued behind an urgent call: wakes an idle thread to look for it
BLOCKED_AFTER = 2.0  # seconds the async handlers' loop may stand still before it is logged
PROBE_EVERY = 0.5  # seconds between the loop watchdog's probes
OWN_THREADS_SPARE = 4  # errands' own threads of a loop beyond one per slot


class HandlerInterrupt(Interrupt):
    """Raised inside a handler thread to stop it (timeout). A BaseException, so a handler's
    ``except Exception`` does not swallow it; its ``finally`` blocks still run."""


def _spent() -> None:
    raise RuntimeError("this handler call has already run")


def _spent_done(exc: BaseException | None, result: Any) -> None:
    pass


class Call:
    """One handler call queued on a :class:`ThreadRunner`.

    Lighter than a ``concurrent.futures.Future`` (no condition variable, no lock): the
    runner hands the outcome straight to ``on_done`` in the handler thread, which is
    all the worker needs; ``finished`` tells whether the call has returned.
    """

    __slots__ = ("finished", "fn", "on_done")

    def __init__(self, fn: Callable[[], Any], on_done: Done) -> None:
        self.fn = fn
        self.on_done = on_done
        self.finished = False

    def done(self) -> bool:
        return self.finished

    def release(self) -> None:
        """Drop the call's closures once it has run. They hold the job's attempt, which
        holds this call (``attempt.future``): a cycle only the garbage collector frees.
        Broken, a finished job's objects go by reference counting when the worker
        forgets it; left, every job left ~16 objects to the collector, and the full
        collections that found them took ~40 % of a busy worker's CPU."""
        self.fn = _spent
        self.on_done = _spent_done


class ThreadRunner:
    def __init__(self, size: int, name: str = "errands-job") -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._urgent: collections.deque[Call] = collections.deque()  # taken before the queue
        self._name = name
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._retire: set[int] = set()
        self._running: dict[int, Call] = {}  # thread ident -> its current call
        self._aimed: set[int] = set()  # threads an interrupt was aimed at
        self._counter = 0
        self.abandoned = 0
        try:
            for _ in range(size):
                self._spawn()
        except RuntimeError as exc:  # "can't start new thread": the machine's limit
            started = len(self._threads)
            self.shutdown()  # the threads started end: none left running
            raise ConfigurationError(
                f"could not start {size:,} handler threads ({exc}, after {started:,}; "
                "those are stopped): the machine's thread limit (ulimit -u, memory). Lower "
                "-c (or --express), and run more worker processes for more jobs at once"
            ) from None

    def _spawn(self) -> None:
        with self._lock:
            self._counter += 1
            thread = threading.Thread(
                target=self._loop, name=f"{self._name}-{self._counter}", daemon=True
            )
            self._threads.add(thread)
        try:
            thread.start()
        except BaseException:
            with self._lock:
                self._threads.discard(thread)
            raise

    def _loop(self) -> None:
        while True:
            try:
                if not self._step():
                    break
            except HandlerInterrupt:  # delivered just after its handler ended: nothing to stop
                continue
        with self._lock:
            self._threads.discard(threading.current_thread())

    def _step(self) -> bool:
        """Run one call; False when this thread should end."""
        me = threading.get_ident()
        try:
            call = self._urgent.popleft()
        except IndexError:
            call = self._queue.get()
            if call is _STOP:
                return False
            if call is _NUDGE:  # its urgent call was taken by a thread already
                return True
        with self._lock:
            self._running[me] = call
        exc: BaseException | None = None
        result: Any = None
        try:
            try:
                # Each call in a context of its own, as an async job's task has: what it
                # set (the job's log context, its span, the user's context variables) is
                # gone after it, even if an interrupt landed between a set and its reset.
                result = contextvars.copy_context().run(call.fn)
            except BaseException as failure:  # the handler's failure is its outcome
                exc = failure
            with self._lock:  # no interrupt can be aimed at this thread once popped
                self._running.pop(me, None)
                if me in self._aimed:
                    self._aimed.discard(me)
                    drop_pending()  # drop one aimed too late
                retire = me in self._retire
                self._retire.discard(me)
        except HandlerInterrupt as late:  # landed between the handler's end and the pop
            with self._lock:
                self._running.pop(me, None)
                self._aimed.discard(me)
                retire = me in self._retire
                self._retire.discard(me)
            exc, result = late, None
        call.finished = True
        try:
            call.on_done(exc, result)
        except Exception:  # the worker's bookkeeping failed: say so, keep the thread
            log.exception("handling a handler's outcome failed")
        finally:
            call.release()
            # A failure's traceback holds this frame, whose locals hold the failure: a
            # cycle left to the garbage collector for every failed job, unless unbound.
            exc = result = None
        return not retire

    def submit(
        self,
        fn: Callable[[], Any],
        on_done: Done,
        *,
        urgent: bool = False,
        made: Callable[[Call], None] | None = None,
    ) -> Call:
        """Run ``fn`` in a pool thread; ``on_done(exc, result)`` is called there after.

        An ``urgent`` call goes ahead of the calls already queued: the next thread free
        takes it. ``made(call)`` is called before the call is queued: what must know the
        call (to interrupt it) knows it before it can start (assigned after this returned,
        a timeout or a stop that came first found no call to interrupt).
        """
        call = Call(fn, on_done)
        if made is not None:
            made(call)
        if urgent:
            self._urgent.append(call)
            self._queue.put(_NUDGE)
        else:
            self._queue.put(call)
        return call

    def interrupt(self, call: Call, retry: float = SHIELD_RETRY) -> bool:
        """Raise HandlerInterrupt inside the thread running ``call``; False if none is.
        Held back while the thread is inside a shield or locking library code
        (:func:`errands.interrupts.aim_unless_shielded`): tried again after ``retry``
        seconds, then twice that, up to SHIELD_RETRY_MAX, for as long as the call runs
        (abandoned too: it must not run on unstopped once out of the shield)."""
        with self._lock:
            for ident, running in self._running.items():
                if running is call:
                    if aim_unless_shielded(ident, functools.partial(aim, ident, HandlerInterrupt)):
                        self._aimed.add(ident)
                    else:  # inside a shield or a lock-taking call: once it is out
                        later = min(retry * 2, SHIELD_RETRY_MAX)
                        timer = threading.Timer(retry, self.interrupt, (call, later))
                        timer.daemon = True
                        timer.start()
                    return True
        return False

    def abandon(self, call: Call) -> None:
        """Give up on a running call: its thread retires when it returns; a new one replaces it."""
        with self._lock:
            idents = [ident for ident, c in self._running.items() if c is call]
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


class HandlerSlots:
    """The slots handlers run in: at most ``size`` begin and run at once; the others wait
    in order (urgent ones first), as prefetched sync jobs wait for a handler thread.

    Taken by the async handlers on the event loop (:meth:`take`), and, in a worker with
    both sync and async handlers, by the sync ones on their threads (:meth:`take_blocking`)
    in the same order: each kind's own bound (the thread pool's ``-c`` threads, the loop's
    ``-c`` slots) let such a worker run up to twice ``-c`` handlers once it prefetched, so
    it never prefetched, and a worker of an app with one async job among sync ones claimed
    ``-c`` jobs a round: 0.66 x the rate of the same worker without it on no-op jobs, and
    twice the server's CPU a job. Given back from any thread (:meth:`give`); a slot handed
    to a waiting task crosses to its loop, and passes on if the task was cancelled
    meanwhile. :meth:`open` ends every wait at a stop (the waiters, withdrawn, never
    begin): nothing is counted from then on."""

    def __init__(self, size: int) -> None:
        self.free = size
        self._lock = threading.Lock()
        self._open = False
        # Waiting turns: an asyncio future (a task on the loop) or a threading.Event
        self._urgent: collections.deque[asyncio.Future[None] | threading.Event] = (
            collections.deque()
        )
        self._waiting: collections.deque[asyncio.Future[None] | threading.Event] = (
            collections.deque()
        )

    def _take_now(self) -> bool:
        """Take a free slot when no one waits (call under the lock)."""
        if self._open:
            return True
        if self.free > 0 and not self._urgent and not self._waiting:
            self.free -= 1
            return True
        return False

    async def take(self, urgent: bool = False) -> bool:
        """Wait for a slot on the running loop: True when taken (False: the slots were
        opened, nothing to give back). Cancelled while waiting, it takes none (or hands
        on the one it was given as the cancel came)."""
        turn: asyncio.Future[None]
        with self._lock:
            if self._take_now():
                return not self._open
            turn = asyncio.get_running_loop().create_future()
            line = self._urgent if urgent else self._waiting
            line.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            with self._lock:
                given = turn.done() and not turn.cancelled() and not self._open
                if not given:
                    with contextlib.suppress(ValueError):  # (give() may have taken it)
                        line.remove(turn)
            if given:
                self.give()  # given the slot in the same instant: the next one's
            raise
        return not self._open

    def take_blocking(self, urgent: bool = False) -> bool:
        """Block this thread until it holds a slot: True when taken (False: opened)."""
        with self._lock:
            if self._take_now():
                return not self._open
            turn = threading.Event()
            (self._urgent if urgent else self._waiting).append(turn)
        turn.wait()
        return not self._open

    def give(self) -> None:
        """A handler ended: its slot to the next one waiting, or free."""
        while True:
            with self._lock:
                if self._open:
                    return
                if self._urgent:
                    turn = self._urgent.popleft()
                elif self._waiting:
                    turn = self._waiting.popleft()
                else:
                    self.free += 1
                    return
            if isinstance(turn, threading.Event):
                turn.set()
                return
            if turn.done():  # its task was cancelled while it waited
                continue
            loop = turn.get_loop()
            if _running_loop() is loop:
                turn.set_result(None)
                return
            try:
                loop.call_soon_threadsafe(self._hand, turn)
            except RuntimeError:  # its loop closed: no task waits there any more
                continue
            return

    def _hand(self, turn: asyncio.Future[None]) -> None:
        """On the waiting task's loop: the slot given to ``turn``, or on to the next one
        when its task was cancelled meanwhile."""
        if turn.done():
            self.give()
        else:
            turn.set_result(None)

    def open(self) -> None:
        """A stop: every wait ends now and later ones return at once, none counted."""
        with self._lock:
            self._open = True
            turns = [*self._urgent, *self._waiting]
            self._urgent.clear()
            self._waiting.clear()
        for turn in turns:
            if isinstance(turn, threading.Event):
                turn.set()
            else:
                with contextlib.suppress(RuntimeError):  # (its loop closed)
                    turn.get_loop().call_soon_threadsafe(_settle, turn)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _settle(turn: asyncio.Future[None]) -> None:
    if not turn.done():
        turn.set_result(None)


class LoopRunner:
    """One asyncio event loop in a daemon thread, running every async handler.

    A watchdog thread sees when the loop stops turning: an ``async def`` handler that
    calls blocking code (``time.sleep``, a sync driver) holds every other async job of
    the worker, their timeouts included, and nothing said so. A loop that has not run a
    probe for ``BLOCKED_AFTER`` seconds is logged (WARNING, naming the task it is in,
    whose name is the job's), and how long it stood once it turns again."""

    def __init__(
        self, name: str = "errands-loop", blocked_after: float | None = None, slots: int = 1
    ) -> None:
        self.loop = asyncio.new_event_loop()
        # errands' own calls off the loop (decoding a payload, encoding a result, a step's
        # read and store, a release), in threads of their own: in the loop's default
        # executor (6 threads on a 2-core machine) they queued behind the handlers' own
        # asyncio.to_thread calls, and six handlers awaiting a slow call there held every
        # other async job (one with a 5 s timeout timed out before it began). Sized for
        # every slot's job to have its call running at once, and more: made on need.
        self.own = concurrent.futures.ThreadPoolExecutor(
            max(slots, 1) + OWN_THREADS_SPARE, thread_name_prefix=f"{name}-own"
        )
        offloop.own_executor_for(self.loop, self.own)
        # The handlers' own asyncio.to_thread calls: at least a thread per slot, so that
        # one blocking call per job never waits for another job's (asyncio's default is
        # min(32, cpu + 4) threads: 6 on a 2-core machine, for a worker of -c 50).
        self.default_threads = max(slots, min(32, (os.cpu_count() or 1) + 4))
        self.user = concurrent.futures.ThreadPoolExecutor(
            self.default_threads, thread_name_prefix=f"{name}-to_thread"
        )
        self.loop.set_default_executor(self.user)
        # A step's fn is running for as long as the tasks and threads it started are
        # (a shielded task, an asyncio.to_thread call its cancel left running)
        stepwork.track_steps(self.loop, self.user)
        # Tasks that outlived their cancel at shutdown, held so the garbage collector does
        # not destroy them mid-await (a "Task was destroyed but it is pending!" each).
        self.stubborn: list[asyncio.Task[Any]] = []
        self.blocked_after = BLOCKED_AFTER if blocked_after is None else blocked_after
        self.stalls = 0  # times the loop stood still past blocked_after
        self._turned = time.monotonic()  # when the loop last ran a probe
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True).start()

    def _probe(self) -> None:
        self._turned = time.monotonic()

    def _watch(self) -> None:
        """Post a probe every PROBE_EVERY seconds; report a loop that ran none for
        ``blocked_after`` seconds, once per stall."""
        stalled_since: float | None = None
        while not self._stopped.wait(PROBE_EVERY):
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                self.loop.call_soon_threadsafe(self._probe)
            now = time.monotonic()
            turned = self._turned
            if now - turned < self.blocked_after:
                if stalled_since is not None:
                    log.warning(
                        "the event loop of async handlers turns again after %.1f s",
                        turned - stalled_since,
                    )
                    stalled_since = None
                continue
            if stalled_since is None and not self._stopped.is_set():
                stalled_since = turned
                self.stalls += 1
                task = asyncio.current_task(self.loop) if self.loop.is_running() else None
                log.warning(
                    "the event loop of async handlers has not turned for %.1f s (in %s): an "
                    "async def handler is running blocking code (time.sleep, a sync driver, "
                    "heavy computation), and every async job of this worker waits; run it "
                    "with `await asyncio.to_thread(...)`, or make the handler a plain def",
                    now - turned,
                    task.get_name() if task is not None else "no task: a loop callback",
                )

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
        self._stopped.set()
        if self.loop.is_running():
            with contextlib.suppress(Exception):  # loop stopped meanwhile, or timeout
                self.stubborn = asyncio.run_coroutine_threadsafe(
                    _cancel_all(timeout), self.loop
                ).result(timeout + 1)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        offloop.own_executor_for(self.loop, None)
        # not waited for: a call abandoned with its job (a statement on a lock) ends there
        self.own.shutdown(wait=False)
        self.user.shutdown(wait=False)
        if not self._thread.is_alive() and not self.loop.is_closed():
            self.loop.close()  # its self-pipe sockets; an unclosed loop warns when collected


async def _cancel_all(timeout: float) -> list[asyncio.Task[Any]]:
    """Cancel every other task and wait for them; the ones still running after
    ``timeout`` (handlers that caught the cancel and went on)."""
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current]
    for task in tasks:
        if not task.cancelling():  # one already cancelled may be running its cleanup
            task.cancel()
    if not tasks:
        return []
    _done, pending = await asyncio.wait(tasks, timeout=timeout)
    if pending:
        log.warning(
            "%d async handler task(s) still ran %g s after being cancelled at the worker's "
            "stop; left unfinished",
            len(pending),
            timeout,
        )
    return list(pending)
