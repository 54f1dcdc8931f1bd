"""Waiting for results without polling: the store wakes the waiters.

One :class:`ResultHub` per App multiplexes every waiter of the process (sync and async
alike) over a single watcher of the store, started on the first wait:

- PostgreSQL: one LISTEN connection on ``errands_done_<schema>``; each statement that
  ends jobs sends one NOTIFY carrying their ids (``*`` when too many): an attempt's end
  in its own statement, every other end through a row trigger (schema 17). So a waiter
  is woken by the commit of its job's outcome, not by a poll.
- SQLite: a thread reads ``PRAGMA data_version`` every few milliseconds (it changes when
  any other connection commits, in this process or another); on a change the hub reads
  the states of every watched job in one query and wakes those that are over.

::

    handle.result()  ──register──> ResultHub ──(first waiter)──> watcher (LISTEN / data_version)
         │  read the job; over? return                               │ ids that ended
         └── wait on its flag <────────── wake(ids) <────────────────┘

A waiter registers *before* it reads its job, and the watcher is listening before that
read (the hub waits for it): a completion is either seen by the read or wakes the waiter.
When the watcher loses its connection, every waiter is woken, reads, and polls with
backoff while it is away; when it reconnects, every waiter is woken to read again
(notifications sent while it was away are lost). Polling stays as the fallback: with
``listen=false`` (PgBouncer in transaction mode), an in-memory SQLite store, or a
watcher that is down, waiters poll with backoff as before; even a healthy watcher's
waiters read again every ``SAFETY_RECHECK`` seconds.

The waits themselves (``handle.result()``, ``as_completed``, ``wait_all`` and their async
forms) run in errands.waiting, paced by :class:`Pacer`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import math
import numbers
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from . import offloop
from .backends.base import DEADLINE_FLOOR, calls_until
from .errors import ConfigurationError, ResultTimeout, is_transient
from .forking import fresh_lock_at_fork, reset_at_fork
from .jobs import TERMINAL_STATES, JobRow

if TYPE_CHECKING:
    from .app import App

log = logging.getLogger("errands.results")
T = TypeVar("T")

READY_WAIT = 2.0  # seconds the first waiter waits for the watcher to listen, then polls
START_RETRY = 5.0  # seconds before a wait tries again to start a watcher that failed
SAFETY_RECHECK = 30.0  # a pushed waiter reads its job again at least this often
STATES_CHUNK = 500  # job ids per states query
# An async read is awaited this long past the time left, so that a store call bounded by
# the deadline itself (a pool's checkout: PoolTimeout, which says more) ends it first.
AWAIT_MARGIN = 0.1
# A sync wait's reads left behind at its deadline, still running in errands' threads
# (each holds a thread of the process's client_executor and a connection): past this many,
# a sync wait reads in the caller's thread again, as before such reads were offloaded
# (bounded only by its connection wait), so that a caller retrying its wait while the
# jobs table stays locked cannot take every thread and connection.
LEFT_BEHIND_MAX = 4
_left_behind = 0
_left_behind_lock = threading.Lock()
# Set while a wait's read runs: a read made inside it (a workflow's nested member's
# result) runs in the same thread, within the outer read's deadline, instead of taking a
# second thread of the pool and waiting for it (32 waits on nested workflows filled it).
_IN_READ: contextvars.ContextVar[bool] = contextvars.ContextVar("errands_in_read", default=False)
TERMINAL = frozenset(s.value for s in TERMINAL_STATES)


# The watchers a forked child let go of (its parent's): kept referenced for the child's
# life, never stopped nor collected there (see ResultHub._forked).
_INHERITED: list[Any] = []


class Waiter:
    """One waiter for one or more jobs: woken from the watcher's thread, waited on from a
    thread (``wait``) or a task (``await_wake``)."""

    __slots__ = ("_async", "_flag", "_lock", "_loop", "_read_all", "job_ids", "rows")

    def __init__(self, job_ids: frozenset[int], loop: asyncio.AbstractEventLoop | None) -> None:
        self.job_ids = job_ids
        self.rows: dict[int, JobRow] = {}  # read for it by the hub when it woke it
        # woken without its rows (the watcher reconnected, the hub's read failed): the
        # waiter reads its jobs itself
        self._read_all = False
        self._lock = threading.Lock()
        self._flag = threading.Event()
        self._loop = loop
        self._async = asyncio.Event() if loop is not None else None

    def must_read_all(self) -> None:
        """The next wake brings no rows: the waiter reads its jobs itself."""
        with self._lock:
            self._read_all = True

    def take_read_all(self) -> bool:
        """Whether a wake since the last call brought no rows."""
        with self._lock:
            flag, self._read_all = self._read_all, False
        return flag

    def wake(self) -> None:
        self._flag.set()
        if self._loop is not None and self._async is not None:
            with suppress(RuntimeError):  # the loop is closed: its waiter is gone
                self._loop.call_soon_threadsafe(self._async.set)

    def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds``; True when woken (False: the time ran out)."""
        woken = self._flag.wait(max(seconds, 0.0))
        self._flag.clear()
        return woken

    async def await_wake(self, seconds: float) -> bool:
        """:meth:`wait` for a task: the event loop runs meanwhile. (asyncio.timeout: a
        wait_for woken as its task is cancelled loses the cancel on Python 3.11.)"""
        assert self._async is not None
        try:
            async with asyncio.timeout(max(seconds, 0.0)):
                await self._async.wait()
            woken = True
        except TimeoutError:
            woken = False
        self._async.clear()
        self._flag.clear()
        return woken


class ResultHub:
    """Every waiter of one App, woken by one watcher of its store."""

    def __init__(self, app: App) -> None:
        self.app = app
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()
        self._by_job: dict[int, set[Waiter]] = {}
        self._watcher: Any = None
        self._started = False
        self._retry_at = float("-inf")  # monotonic: when a watcher that failed may start
        self.wakeups = 0  # waiters woken by the watcher (tests, bench)
        reset_at_fork(self)  # it starts afresh in a forked child (_forked)

    def _forked(self) -> None:
        """In a child forked from the process that started the watcher: the watcher's
        thread does not exist here, yet its ``listening`` flag was copied set, so every
        wait of the child took the store for pushing and slept until its recheck (30 s)
        or its timeout. The child starts a watcher of its own at its first wait. The
        parent's is left alone (stopping it would cancel on the parent's LISTEN
        connection), and so are the parent's waiters (their threads are not the child's);
        the locks start afresh (one held by another thread at the fork stays held)."""
        if self._watcher is not None:
            _INHERITED.append(self._watcher)
        self._watcher, self._started = None, False
        self._retry_at = float("-inf")
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()
        self._by_job = {}

    # -- the watcher -----------------------------------------------------------------------
    def _start(self) -> Any:
        """The watcher, started on the first call (the others wait for that start). One
        that could not start (the store away at the first wait) is tried again at a wait
        START_RETRY seconds later: it was given up on for the App's life, and every wait
        polled."""
        with self._start_lock:
            if not self._started and time.monotonic() >= self._retry_at:
                try:
                    watcher = self.app.backend.result_listener(
                        self._on_done, self._wake_all, self._wake_all
                    )
                    if watcher is not None:
                        watcher.start()
                except Exception as exc:
                    self._retry_at = time.monotonic() + START_RETRY
                    log.warning(
                        "cannot watch the store for finished jobs (%s); waiters poll, and a "
                        "wait tries again in %g s", exc, START_RETRY,
                    )  # fmt: skip
                    return None
                self._watcher, self._started = watcher, True
            return self._watcher

    def ready(self, wait: float = READY_WAIT) -> bool:
        """Start the watcher (once) and, that first time, wait up to ``wait`` s for it to
        listen: True when waiters are woken by the store, False when they must poll. (A
        waiter that polls is woken to read again once the watcher listens.) Later calls
        never wait: while the watcher reconnects, each result() waited READY_WAIT before
        its own timeout even began (result(timeout=0.2) took 2.2 s)."""
        first = not self._started
        watcher = self._start()
        if watcher is None:
            return False
        return watcher.listening.wait(wait) if first else watcher.listening.is_set()

    @property
    def pushing(self) -> bool:
        watcher = self._watcher
        return (
            watcher is not None
            and watcher.listening.is_set()
            and watcher.self_test_passed is not False
        )

    def close(self) -> None:
        with self._start_lock:
            watcher, self._watcher, self._started = self._watcher, None, False
        if watcher is not None:
            watcher.stop()
        # Waiters asleep until their recheck (30 s) read now: what they wait for is read
        # from the store (opened again) or fails, not learnt half a minute late.
        self._wake_all()

    def _wake_all(self) -> None:
        """Every waiter reads its jobs now. Called when the watcher (re)connects (what
        ended while it was away sent no word) and when it stops listening (its connection
        lost: a waiter asleep until its SAFETY_RECHECK would see a job that ends meanwhile
        up to 30 s late; they poll with backoff, ``pushing`` False, until it is back)."""
        self._wake(None)

    def _on_done(self, ids: Iterable[int] | None) -> None:
        if ids is not None:
            self._wake(ids, read=True)
            return
        with self._lock:  # SQLite, or too many ids: ask the store which watched jobs ended
            watched = list(self._by_job)
        ended: list[int] = []
        for start in range(0, len(watched), STATES_CHUNK):
            chunk = watched[start : start + STATES_CHUNK]
            try:
                states = self.app.backend.job_states(chunk)
            except Exception as exc:
                log.debug("reading watched jobs' states failed (%s); waking them all", exc)
                ended.extend(chunk)
                continue
            ended.extend(i for i in chunk if states.get(i, "pruned") in TERMINAL | {"pruned"})
        if ended:
            self._wake(ended, read=True)

    def _wake(self, ids: Iterable[int] | None, *, read: bool = False) -> None:
        """Wake the waiters of ``ids`` (None: every waiter). ``read``: the jobs ended, so
        read their rows here, in one query per chunk, and hand each waiter its job's: ten
        thousand waiters woken at once then cost a few queries, not one read each."""
        with self._lock:
            if ids is None:
                groups = {0: {w for group in self._by_job.values() for w in group}}
            else:
                groups = {i: set(self._by_job.get(i, ())) for i in ids}
        woken = [i for i, group in groups.items() if group]
        if read and ids is not None:
            rows: dict[int, JobRow] = {}
            for start in range(0, len(woken), STATES_CHUNK):
                try:
                    found = self.app.backend.job_get_many(woken[start : start + STATES_CHUNK])
                except Exception as exc:  # each waiter reads its own job instead
                    log.debug("reading ended jobs failed (%s); waiters read their own", exc)
                    break
                rows.update((row.id, row) for row in found)
            for job_id, group in groups.items():
                if job_id in rows:
                    for waiter in group:
                        waiter.rows[job_id] = rows[job_id]
                else:
                    for waiter in group:
                        waiter.must_read_all()
        else:
            for group in groups.values():
                for waiter in group:
                    waiter.must_read_all()
        waiters = {w for group in groups.values() for w in group}
        self.wakeups += len(waiters)
        for waiter in waiters:
            waiter.wake()

    # -- waiters -----------------------------------------------------------------------------
    @contextmanager
    def watch(
        self, job_ids: Iterable[int], loop: asyncio.AbstractEventLoop | None = None
    ) -> Iterator[Waiter]:
        """Register a waiter for ``job_ids`` for the block (call :meth:`ready` first)."""
        waiter = Waiter(frozenset(job_ids), loop)
        with self._lock:
            for job_id in waiter.job_ids:
                self._by_job.setdefault(job_id, set()).add(waiter)
        try:
            yield waiter
        finally:
            with self._lock:
                for job_id in waiter.job_ids:
                    group = self._by_job.get(job_id)
                    if group is not None:
                        group.discard(waiter)
                        if not group:
                            del self._by_job[job_id]

    def waiting(self) -> int:
        """How many jobs are watched now."""
        with self._lock:
            return len(self._by_job)

    def waiters(self) -> int:
        """How many waiters are registered now (one per wait, however many jobs it has)."""
        with self._lock:
            return len({w for group in self._by_job.values() for w in group})


def _wait_seconds(value: float | timedelta | None, option: str) -> float | None:
    """A wait's ``timeout`` or ``poll``: a number of seconds or a timedelta (a timeout
    of 0 or less is up at once; None: no limit). NaN waited for ever, a timedelta was a
    TypeError from deep inside, and a poll of 0 spun on the store."""
    if value is None:
        return None
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != value:
        raise ConfigurationError(
            f"{option}={value!r}: give a number of seconds or a datetime.timedelta, as in "
            f"{option}=30 (timeout=None waits without a limit)"
        )
    return float(value)  # (a numpy number too)


def store_unreadable(exc: BaseException) -> bool:
    """Whether a read failed for want of the store (a lost or refused connection, a pool
    with none free, a busy file, no answer in time) and may succeed if made again; not
    an answer (JobNotFound), a schema to migrate, or a closed App (PoolClosed)."""
    if isinstance(exc, ResultTimeout):  # a wait's own answer (a nested workflow's result)
        return False
    return is_transient(exc) and type(exc).__name__ != "PoolClosed"


class Pacer:
    """How long a waiter waits before reading again: until woken, or SAFETY_RECHECK, while
    the store pushes; exponential backoff from ``first`` up to ``poll`` while it must poll
    (``hub`` None: nothing pushes, as for a workflow's wait) or after a read failed.

    It also makes the wait's reads (:meth:`read`, :meth:`aread`), so that the timeout
    holds while the store cannot be read: a read waits for a connection no longer than
    the time left, a read that fails is made again after the pause until the deadline,
    and the ResultTimeout then says the store could not be read (its error as the
    cause), rather than a pool's PoolTimeout 30 s after the deadline."""

    def __init__(
        self,
        hub: ResultHub | None,
        poll: float | timedelta,
        timeout: float | timedelta | None,
        first: float = 0.01,
    ) -> None:
        self.hub = hub
        every = _wait_seconds(poll, "poll")
        if every is None or not 0 < every < math.inf:
            raise ConfigurationError(
                f"poll={poll!r}: give the longest pause between reads, in seconds (> 0), "
                "as in poll=0.05"
            )
        self.poll: float = every
        self.delay = min(every, first)
        self.timeout = _wait_seconds(timeout, "timeout")
        self.deadline = None if self.timeout is None else time.monotonic() + self.timeout
        self.error: Exception | None = None  # why the last read failed (None: it did not)

    def left(self) -> float | None:
        """Seconds until the deadline (None: no timeout), 0 or less once it passed."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    def ready_wait(self) -> float:
        """How long the first wait for the watcher may take: READY_WAIT, within the
        timeout (whose clock runs from the start of the wait, not after it)."""
        if self.deadline is None:
            return READY_WAIT
        return max(min(READY_WAIT, self.deadline - time.monotonic()), 0.0)

    def next(self, what: str) -> float:
        """Seconds to wait; ResultTimeout (naming ``what``) once the time is up."""
        if self.hub is not None and self.hub.pushing and self.error is None:
            pause = SAFETY_RECHECK
        else:
            pause, self.delay = self.delay, min(self.delay * 2, self.poll)
        left = self.left()
        if left is None:
            return pause
        if left <= 0:
            raise self.timed_out(what)
        return min(pause, left)

    def timed_out(self, what: str) -> ResultTimeout:
        """The ResultTimeout of a wait for ``what``: when the last read failed, it says
        the store could not be read, with that error as its cause."""
        words = f"{what} after {self.timeout} s"
        error = self.error
        if error is not None:
            detail = (str(error).strip().splitlines() or [""])[0]
            name = "TimeoutError" if isinstance(error, _Expired) else type(error).__name__
            said = f"{name}: {detail}" if detail else name
            words += f": the store could not be read ({said})"
        timeout = ResultTimeout(words)
        timeout.__cause__ = error
        return timeout

    def read(self, call: Callable[[], T]) -> T | None:
        """``call()``, a read of the store, waiting for a connection no longer than the
        time left. None when the store could not be read (the error is kept for the
        timeout's message, and the next pause backs off as a poll does); any other error
        raises.

        With a deadline the read runs in one of errands' threads (errands.offloop) and
        is waited for until the deadline at most, as :meth:`aread` awaits it: a read
        that hangs on the server (the jobs table locked by a long ALTER or a `LOCK
        TABLE`, a server that stopped answering) is left to end in its thread and
        counts as failed, so ``result(timeout=0.5)`` raises ResultTimeout at its
        deadline. It waited for as long as the lock was held. Without a deadline it runs
        here: there is no time to keep."""
        with self._reading():
            left = self.left()
            if left is None or _IN_READ.get() or _left_behind >= LEFT_BEHIND_MAX:
                return self._until_deadline(call)
            context = contextvars.copy_context()  # the caller's (a job's log context...)
            try:
                future = offloop.client_executor().submit(context.run, self._until_deadline, call)
            except RuntimeError:  # the interpreter is exiting (an atexit hook's wait)
                return self._until_deadline(call)
            limit = _limit(left)
            try:
                return future.result(timeout=limit)
            except TimeoutError:
                if future.done():  # it answered as the wait gave up, or raised its own
                    return future.result()
                if not future.cancel():  # running: left to end in its thread, counted
                    _leave_behind(future)
                raise _Expired(f"no answer within the {limit:.2f} s left") from None
        return None

    async def aread(self, call: Callable[[], T]) -> T | None:
        """:meth:`read` in a task: ``call`` runs in a thread, awaited until the deadline
        at most; a read still running then (a server that does not answer) is left to end
        in its thread, and counts as failed."""
        with self._reading():
            return await self.within(offloop.run(self._until_deadline, call))
        return None

    async def within(self, awaitable: Awaitable[T]) -> T:
        """``awaitable``, given the time left (at least DEADLINE_FLOOR) and AWAIT_MARGIN:
        TimeoutError after that. (asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the
        result of an awaitable that ends as the task is cancelled, and the cancel is
        lost: a cancelled await_all waited on until its timeout.)"""
        left = self.left()
        limit = None if left is None else _limit(left)
        scope = asyncio.timeout(limit)
        try:
            async with scope:
                return await awaitable
        except TimeoutError:
            if not scope.expired():
                raise  # the awaitable's own
            raise _Expired(f"no answer within the {limit:.2f} s left") from None

    async def bounded(self, awaitable: Awaitable[T], what: Callable[[], str]) -> T:
        """``awaitable`` (a call in a thread, left to end there) given the time left, as
        :meth:`within`; past it, the wait's ResultTimeout, naming ``what()``."""
        try:
            return await self.within(awaitable)
        except _Expired:
            raise self.timed_out(what()) from None

    async def opened(self, app: App, what: str) -> None:
        """The App's store opened (App.abackend) within the time left, else
        ResultTimeout naming ``what``."""
        try:
            await self.within(app.abackend())
        except TimeoutError as exc:
            self.error = exc
            raise self.timed_out(what) from exc

    def _until_deadline(self, call: Callable[[], T]) -> T:
        # Its connection only: a wait's reads meet no lock but a whole table's (LOCK
        # TABLE, a migration's DDL), and bounding their lock waits too would cost each
        # read of a polling waiter two more round trips (base.calls_until).
        inside = _IN_READ.set(True)
        try:
            with calls_until(self.deadline, lock_waits=False):
                return call()
        finally:
            _IN_READ.reset(inside)

    @contextmanager
    def _reading(self) -> Iterator[None]:
        """Keep a read's store error (others raise); forget it once a read succeeds."""
        try:
            yield
        except Exception as exc:
            if not store_unreadable(exc):
                raise
            if self.error is None:
                log.warning("a wait could not read the store (%s); reading again", exc)
            self.error = exc
        else:
            self.error = None

    @staticmethod
    def recheck_due(since: float) -> bool:
        """Whether a waiter that last read every job at ``since`` (time.monotonic()) must
        read them all again: the safety recheck, also while other jobs' ends wake it."""
        return time.monotonic() - since >= SAFETY_RECHECK


def _limit(left: float) -> float:
    """How long a read with ``left`` seconds to its wait's deadline is waited for."""
    return max(left, DEADLINE_FLOOR) + AWAIT_MARGIN


def _leave_behind(future: concurrent.futures.Future[Any]) -> None:
    """Count a sync wait's read left running at its deadline, until it ends."""
    global _left_behind
    with _left_behind_lock:
        _left_behind += 1
    future.add_done_callback(_read_ended)


def _read_ended(_: concurrent.futures.Future[Any]) -> None:
    global _left_behind
    with _left_behind_lock:
        _left_behind -= 1


def _forget_left_behind() -> None:
    """In a forked child: the parent's reads left behind are not its threads'."""
    global _left_behind
    _left_behind = 0


fresh_lock_at_fork(globals(), "_left_behind_lock")
os.register_at_fork(after_in_child=_forget_left_behind)


class _Expired(TimeoutError):
    """A wait's own deadline passed (not a TimeoutError of what it awaited); messages
    name it TimeoutError, the class users catch."""
