"""What a handler's Context can do beyond reading: durable steps, the completion
transaction and child jobs (DESIGN §3, effectively-once effects).

- ``ctx.step(name, fn, ...)``: the first run stores fn's JSON result under (job, name) as
  soon as fn returns; every later run of the job (retry, rescue, replay) gets the stored
  result back without calling fn. Two runs racing on one step (a stale attempt) keep the
  first stored result and both return it.
- ``ctx.transaction()``: a connection inside the very transaction that will complete the
  job; the handler's writes commit with the completion, or are rolled back with it. An
  async handler's ``await ctx.atransaction()`` opens it, and runs each of its statements,
  on a thread of its own (:class:`AsyncTransaction`), never on the event loop. The
  calls that would end that transaction early (``commit()``, ``executescript``, a
  ``COMMIT``/``ROLLBACK``/``END`` statement, ...) are refused when made; as a backstop,
  errands opens a savepoint inside the transaction and releases it just before the
  completion: a handler that ended the transaction anyway (through ``tx.raw``, say)
  fails permanently and loudly (``TransactionEnded``).
- ``ctx.enqueue(job, ...)``: children are validated now and inserted in the transaction
  that completes this job; a failed, timed-out or rescued attempt inserts none.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import inspect
import json
import logging
import sqlite3
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic_core import PydanticSerializationError, to_json

from .. import clock, offloop
from ..backends.workflow_store import WORKFLOW_ADD
from ..definition import seconds as checked_seconds
from ..errors import (
    ConfigurationError,
    InvalidPayload,
    StepError,
    TransactionEnded,
    cannot_write_now,
    disk_full,
    is_transient,
)
from ..errortext import scrub
from ..faults import fault_point
from ..interrupts import shielded
from ..jobs import EnqueueRequest
from ..jsontext import loads_stored
from ..observability.logcontext import job_extra
from ..offloop import Lane, LaneClosed
from ..payload import read_back
from . import stepwork
from .execution import LEASE_UNRENEWED, Interrupted, Suspended, _secrets
from .sqltext import ending_statement
from .txmark import from_transaction, mark_connection, mark_from_transaction

if TYPE_CHECKING:
    from ..app import App
    from ..backends.base import Backend
    from ..definition import BoundJob, JobDefinition
    from ..workflows import ParentResults
    from .execution import Attempt

log = logging.getLogger("errands.worker")
T = TypeVar("T")

PROGRESS_MESSAGE_MAX = 500  # characters of a ctx.progress message kept
SIGNAL_NAME_MAX = 200
SIGNAL_STEP = "signal:"  # the step a received signal's payload is stored under


SETTLE_POLL = 0.02  # seconds between looks at the steps an ended handler left running


class StepInFlight:
    """A step called and not over yet: its fn running (or, cut short by a cancel, the work
    it started on the loop: see :mod:`errands.worker.stepwork`), or its result being
    stored."""

    __slots__ = (
        "__weakref__",
        "awaited",
        "counter",
        "cut_short",
        "ended",
        "handed",
        "name",
        "owner",
        "started",
        "task",
        "unseen",
    )

    def __init__(self, name: str, task: asyncio.Task[Any] | None, owner: AttemptRuntime) -> None:
        self.name = name
        self.task = task  # the task of an astep; None: a ctx.step on a thread
        self.owner = owner
        self.ended = threading.Event()
        # an astep's fn run in a thread: its task stopped waiting for it (cancelled)
        self.handed = False
        # An astep's fn: the tasks and threads it started that still run (``started``: a
        # shielded task, an asyncio.to_thread call, which its cancel does not stop;
        # cancelled at settle_steps' cancel point), and whether
        # its frame (or the store of its result) is still going. Under the owner's
        # _flights_lock. What the fn's tasks see (stepwork.STEP) is ``counter``, which
        # refers to the flight weakly: a long-lived task the fn started (a client's
        # refresher) keeps neither the flight nor its attempt alive.
        self.started: set[asyncio.Task[Any] | concurrent.futures.Future[Any]] = set()
        self.counter = _StepCounter(self)
        self.awaited = True
        # Its fn ended by a cancel (a stop's, a timeout's, a wait_for around the step):
        # the work it started may be its effect still going on, so the step is in flight
        # until that work is over. A fn that returned or raised its own error is over at
        # once: what it left running is its own background work.
        self.cut_short = False
        # Its fn was cut short by a cancel on a loop that does not count the work it
        # started (not the worker's, or one whose task factory was replaced: see
        # stepwork.counts_step_work): that work may go on unseen, so the step is held as
        # running for good (a graceful stop keeps its job until abandon_after, as it
        # keeps a hung step's)
        self.unseen = False

    def work_begins(self, work: asyncio.Task[Any] | concurrent.futures.Future[Any]) -> bool:
        """A task or thread started by its fn (stepwork.StepWork): counted until over."""
        return self.owner._work_begins(self, work)

    def work_ends(self, done: asyncio.Task[Any] | concurrent.futures.Future[Any]) -> None:
        self.owner._work_ends(self, done)


class _StepCounter:
    """What stepwork.STEP holds while a step's fn runs: its flight, weakly (see
    StepInFlight.counter)."""

    __slots__ = ("_flight",)

    def __init__(self, flight: StepInFlight) -> None:
        self._flight = weakref.ref(flight)

    def work_begins(self, work: asyncio.Task[Any] | concurrent.futures.Future[Any]) -> bool:
        flight = self._flight()
        return flight is not None and flight.work_begins(work)

    def work_ends(self, done: Any = None) -> None:
        flight = self._flight()
        if flight is not None:
            flight.work_ends(done)


class AttemptRuntime:
    def __init__(self, app: App, attempt: Attempt) -> None:
        self.app = app
        self.attempt = attempt
        self.tx: Any = None
        # the store that opened it, which alone ends it: App.close() under a running
        # worker made app.backend open a new store, whose migration then waited for the
        # write lock this very transaction held (a deadlock of write_timeout)
        self.tx_backend: Backend | None = None
        self.tx_opened = 0.0  # when ctx.transaction() opened it (errands.clock)
        # An async handler's transaction: its opening and its statements run on this
        # thread of its own (ctx.atransaction()); closed when the handler ends
        self.tx_lane: Lane | None = None
        self.tx_warned = False  # the lease keeper warned that it is held long
        self.tx_tried = False  # the handler called ctx.transaction() (opened or not)
        self.children: list[EnqueueRequest] = []
        self._let_go = False  # the attempt ended while the handler ran: no new transaction
        self._ended = threading.Event()  # ... and no statement on the one it had
        self._steps: dict[str, Any] | None = None
        self._used: set[str] = set()
        # Steps whose fn may be running now, on the handler's task or another (see
        # settle_steps); closed: the attempt is ending, and no step starts any more. A
        # lock of their own, held for a set operation only: _lock is held while a
        # transaction is opened (a pool checkout), and the event loop and the lease
        # keeper must never wait for that.
        self._in_flight: set[StepInFlight] = set()
        self._closed = False
        self._flights_lock = threading.Lock()
        self._lock = threading.Lock()
        self._secret_texts: list[str] | None = None  # sensitive arguments, for progress
        # The lease keeper of this process renews the attempt's lease_valid_until (False in
        # a process-pool child: its parent renews it, and stops the child if it is lost).
        self.lease_kept_here = True
        # In a child process: where each progress report goes (the parent stores it)
        self.report_progress: Callable[[tuple[float, str]], None] | None = None

    # -- steps -----------------------------------------------------------------------------
    def _flight_begins(self, name: str, task: asyncio.Task[Any] | None) -> StepInFlight:
        """Count a step in flight from its call until its effect and its store are over;
        raise StepError when the attempt has ended (a task or thread the handler left
        running calls a step after the handler returned or raised: its retry may run)."""
        attempt = self.attempt
        with self._flights_lock:
            if self._closed or attempt.decided or attempt.released:
                if attempt.stop_reason is not None:  # stopped: say why, as _may_run_step
                    stopped = Interrupted(attempt.stop_reason)
                    stopped.add_note(f"step {name!r} of job {attempt.id} was not started")
                    raise stopped
                raise StepError(
                    f"step {name!r} of job {attempt.id} was not started: the attempt it "
                    "belongs to has ended (its handler returned or raised) while a task or "
                    "thread it started went on calling steps; await every step before the "
                    "handler ends (asyncio.TaskGroup, not asyncio.gather, ends sibling "
                    "steps with a failing one)"
                )
            flight = StepInFlight(name, task, self)
            self._in_flight.add(flight)
        return flight

    def _flight_ends(self, flight: StepInFlight, *, with_work: bool = False) -> None:
        """The step's call is over. ``with_work``: its fn was cut short by a cancel (see
        StepInFlight.cut_short): the step stays in flight until the tasks and threads
        its fn started are over too (see :mod:`.stepwork`): the next run calls fn again,
        and must not do so beside a shielded task or a thread the cancel left running.
        (Once its result is stored, the next run never calls it; a fn that raised its
        own error ended its effect itself, as far as errands can tell.)"""
        with self._flights_lock:
            flight.awaited = False
            over = not with_work or (not flight.started and not flight.unseen)
            if over:
                self._flight_over(flight)
        if over:
            flight.ended.set()

    def _flight_over(self, flight: StepInFlight) -> None:
        """(Under _flights_lock.) The flight is over: what its fn started is counted no
        more (its done callbacks find it gone)."""
        self._in_flight.discard(flight)
        flight.started.clear()

    def _work_begins(
        self, flight: StepInFlight, work: asyncio.Task[Any] | concurrent.futures.Future[Any]
    ) -> bool:
        with self._flights_lock:
            if flight not in self._in_flight:  # over: its result stored, or given up on
                return False
            flight.started.add(work)
            return True

    def _work_ends(
        self, flight: StepInFlight, done: asyncio.Task[Any] | concurrent.futures.Future[Any]
    ) -> None:
        with self._flights_lock:
            if done not in flight.started:  # counted no more: the flight is over
                return
            flight.started.discard(done)
            over = not flight.awaited and not flight.started and flight in self._in_flight
            if over:
                self._flight_over(flight)
        if over:
            flight.ended.set()

    def steps_in_flight(self) -> list[str]:
        """The names of the steps called and not over yet (their fn running, or their
        result being stored): a graceful stop gives the job back only once there are
        none (see Worker._give_back_after_steps). Never waits (see _flights_lock)."""
        with self._flights_lock:
            return [flight.name for flight in self._in_flight]

    def close(self) -> list[StepInFlight]:
        """The attempt's handler has ended, or its outcome is being decided: no step and
        no ctx.transaction() starts from now on (from a task or thread the handler left
        running: a transaction opened then was never ended, and on SQLite its write lock
        stalled every writer of the file for good). The steps still in flight, for
        settle_steps. Never waits for a transaction being opened (see _flights_lock)."""
        with self._flights_lock:
            self._closed = True
            lane = self.tx_lane
            flights = list(self._in_flight)
        if lane is not None:  # the statements given already run; a later one is refused
            lane.close()
        return flights

    async def settle_steps(
        self, flights: list[StepInFlight], grace: float, stopped: Callable[[], bool]
    ) -> None:
        """Wait until the steps still in flight when the handler ended are over, before the
        attempt is decided: until then it keeps its slot and its lease, as a sync handler
        does until its thread returns. Its retry read the steps before an orphaned
        step stored its result (asyncio.gather does not cancel the siblings of a step
        that raised) and ran the step's effect again, beside the first.

        A step is let finish (its result stored: the retry does not run it again) for up
        to ``grace`` seconds; then, or at once when the attempt was asked to stop
        (``stopped()``: its timeout, a cancel, a lost lease, the worker stopping; or this
        task is cancelled meanwhile), the tasks running steps are cancelled (a step cut
        short runs again on the retry, as after a crash) and waited for ``grace`` more
        seconds. The work a step cut short still runs (a shielded task it started: see
        StepInFlight.cut_short) is cancelled ``grace`` seconds after the handler ended
        (not at once when asked to stop: shielded, it is what must not be cut in half),
        and waited for until the end of those ``grace`` more seconds, or one poll more. A
        step still running then (its task caught the cancel and went on, or a
        ``ctx.step`` on a thread, or a thread its fn started) is abandoned, logged, as a
        thread past its timeout is."""
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        began = loop.time()
        cancelled_at: float | None = None
        work_cancelled_at: float | None = None
        while pending := [f for f in flights if not f.ended.is_set()]:
            now = loop.time()
            if cancelled_at is None and (now - began >= grace or stopped()):
                cancelled_at = now
                for flight in pending:
                    if flight.task is not None and flight.task is not me:
                        flight.task.cancel(
                            f"job {self.attempt.id}: its handler ended while step "
                            f"{flight.name!r} still ran"
                        )
            if work_cancelled_at is None and now - began >= grace:
                work_cancelled_at = now
                self._cancel_work(pending, grace)
            elif (
                cancelled_at is not None
                and work_cancelled_at is not None
                and now - cancelled_at >= grace
                and now > work_cancelled_at
            ):
                log.error(
                    "job %s: step(s) %s still ran %g s after its handler ended and %g s "
                    "after being cancelled; abandoned (they may still be running beside "
                    "the job's next attempt)",
                    self.attempt.id,
                    ", ".join(repr(f.name) for f in pending),
                    grace,
                    grace,
                    extra=job_extra(self.attempt.row),
                )
                return
            try:
                await asyncio.sleep(SETTLE_POLL)
            except asyncio.CancelledError:
                # The worker stops the attempt (its timeout, a cancel, shutdown): cancel the
                # steps now, and still wait for them (bounded). Its outcome is decided from
                # what stopped it (the recorder reads attempt.timed_out and stop_reason).
                if me is not None:
                    me.uncancel()
                if cancelled_at is None:
                    began = loop.time() - grace

    def _cancel_work(self, flights: list[StepInFlight], grace: float) -> None:
        """Cancel the tasks (and the executor calls not begun yet) that the fns of
        ``flights``, cut short, started and that still run (see settle_steps)."""
        with self._flights_lock:
            started = [(flight.name, work) for flight in flights for work in flight.started]
        for name, work in started:
            if isinstance(work, asyncio.Task):
                work.cancel(
                    f"job {self.attempt.id}: step {name!r} was cut short, and this task it "
                    f"started still ran {grace:g} s after the job's handler ended"
                )
            else:  # a thread cannot be stopped: only a call still queued
                work.cancel()

    def _begin_step(self, name: str) -> tuple[bool, Any]:
        if not isinstance(name, str) or not name:
            raise StepError("ctx.step needs a non-empty string name")
        with self._lock:
            if name in self._used:
                raise StepError(
                    f"step {name!r} was used twice in one run of job {self.attempt.id}; give "
                    "each step its own name (e.g. f'charge:{item_id}')"
                )
            self._used.add(name)
            if self._steps is None:
                self._steps = {s.name: s.result for s in self._store().step_list(self.attempt.id)}
            if name in self._steps:
                return True, self._steps[name]
        self._may_run_step(name)
        return False, None

    def _may_run_step(self, name: str) -> None:
        """Raise Interrupted when this attempt must not start a step's effect now: it was
        asked to stop (cancelled, timed out, its lease lost or unrenewable, the worker
        stopping), or its lease is past due by this worker's clock (a process paused past
        its lease, resumed before the lease keeper noticed). A stale attempt ran a
        stored step's effect again after the newer attempt had run and stored it."""
        attempt = self.attempt
        reason = attempt.stop_reason
        if reason is None and self.lease_kept_here and clock.now() >= attempt.lease_valid_until:
            # as the lease keeper fences it: the job is given back, uncharged
            reason = attempt.stop_reason = LEASE_UNRENEWED
        if reason is not None:
            stopped = Interrupted(reason)  # (its reason decides the outcome: a cancel too)
            stopped.add_note(f"step {name!r} of job {attempt.id} was not started")
            raise stopped

    def _store_step(self, name: str, value: Any) -> Any:
        try:
            encoded = to_json(value).decode("utf-8")
        except (PydanticSerializationError, ValueError, TypeError) as exc:
            raise StepError(
                f"step {name!r} of job {self.attempt.id} returned a {type(value).__name__}, "
                f"which cannot be stored as JSON ({exc}); return JSON-friendly data (dicts, "
                "lists, numbers, strings, pydantic models, dataclasses)"
            ) from None
        # Stored only if it reads back: an int of more than 4,300 digits (stored, then no
        # run could read the job's steps: on PostgreSQL each failed, on SQLite the retry
        # got a string), NaN, infinity or a NUL, refused on both backends, as signal
        # payloads are (SQLite stored NaN as JSON no standard reader takes; PostgreSQL's
        # jsonb refused it with a raw driver error, a transient failure whose retries ran
        # the step's effect again)
        try:
            decoded = read_back(f"step {name!r} of job {self.attempt.id}: its result", encoded)
        except InvalidPayload as problem:
            raise StepError(str(problem)) from None
        with self._lock:
            if self._let_go and self.tx_opened:  # its transaction was let go of
                raise TransactionEnded(
                    f"job {self.attempt.id}: the attempt has ended (timed out and abandoned, "
                    f"or released at shutdown); step {name!r} is not stored outside the "
                    "transaction it belonged to"
                )
            tx, backend = self.tx, self._store()
        gone = sqlite_transaction_gone(tx) if tx is not None else None
        if gone is not None:  # SQLite rolled it back: stored now, it committed on its own
            gone.add_note(f"step {name!r} of job {self.attempt.id} was not stored")
            raise gone
        try:
            stored = backend.step_store(
                self.attempt.id, name, encoded, self.attempt.row.attempt, conn=tx
            )
        except Exception as exc:
            if tx is not None:  # stored in the transaction: its connection's error
                mark_from_transaction(exc)
            raise
        result = decoded if stored == encoded else json.loads(stored)  # (jsonb's form)
        if stored != encoded and result != decoded:
            log.warning(
                "step %r of job %s was already stored by another attempt; using that result",
                name,
                self.attempt.id,
            )
        with self._lock:
            assert self._steps is not None
            self._steps[name] = result
        fault_point(
            "after_step",
            app=self.app,
            job_id=self.attempt.id,
            job=self.attempt.row.name,
            attempt=self.attempt.row.attempt,
            step=name,
        )
        return result

    def step(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        _not_reserved(name)
        flight = self._flight_begins(name, None)
        try:
            done, value = self._begin_step(name)
            if done:
                return value
            self._warn_step_in_transaction(name)
            return self._store_step(name, fn(*args, **kwargs))
        finally:
            self._flight_ends(flight)

    def _warn_step_in_transaction(self, name: str) -> None:
        if self.tx is not None:
            log.warning(
                "job %s: step %r runs inside ctx.transaction(), so its stored result commits "
                "with that transaction: if this attempt fails, the step is forgotten and its "
                "effect runs again on the retry. Call ctx.step before ctx.transaction() for "
                "effects outside the database (a payment, an email)",
                self.attempt.id,
                name,
            )

    async def astep(
        self, name: str, fn: Callable[..., Awaitable[Any] | Any], *args: Any, **kwargs: Any
    ) -> Any:
        _not_reserved(name)
        flight = self._flight_begins(name, asyncio.current_task())
        storing: asyncio.Future[Any] | None = None
        try:
            done, value = await offloop.run(self._begin_step, name)
            if done:
                return value
            self._warn_step_in_transaction(name)
            if _awaits(fn):
                result = await _in_step(flight, lambda: fn(*args, **kwargs))
            else:
                # A plain function runs in a thread (the loop's executor, as the handler's
                # own asyncio.to_thread calls): called on the loop, a blocking one held
                # every async job of the worker for as long as it ran. Its result is
                # stored there as it returns, even if this task is cancelled meanwhile,
                # and the step stays in flight until then, as a coroutine's store.
                storing = self._step_in_a_thread(flight, name, fn, args, kwargs)
                try:
                    result = await asyncio.shield(storing)
                except BaseException:
                    _unawaited_dropped(storing, flight, self)
                    raise
                if not isinstance(result, _Unawaited):
                    return result
                storing = None  # fn returned an awaitable (a lambda around a coroutine)
                result = await _in_step(flight, functools.partial(_given, result.awaitable))
            # The effect is done: its result is stored even if this task is cancelled
            # now (its thread cannot be stopped), and the step stays in flight until then
            storing = asyncio.ensure_future(offloop.run(self._store_step, name, result))
            storing.add_done_callback(lambda stored: self._stored(flight, stored))
            return await asyncio.shield(storing)
        finally:
            if storing is None:  # (cut short: held while the work its fn started runs)
                self._flight_ends(flight, with_work=flight.cut_short)

    def _step_in_a_thread(
        self,
        flight: StepInFlight,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> asyncio.Future[Any]:
        """``fn(*args, **kwargs)`` run and its result stored, in a thread of the loop's
        executor; the step's flight ends when that is over (or, when fn returned an
        awaitable, once the step's task has taken it, or dropped it: see astep)."""
        loop = asyncio.get_running_loop()
        call = functools.partial(
            contextvars.copy_context().run, self._call_and_store, name, fn, args, kwargs
        )
        storing = loop.run_in_executor(None, call)
        flight.handed = False  # astep still waits for it: an awaitable returned is its own

        def over(stored: asyncio.Future[Any]) -> None:
            if (
                stored.cancelled()
                or stored.exception() is not None
                or not isinstance(stored.result(), _Unawaited)
            ):
                self._flight_ends(flight)  # stored, or failed
            elif flight.handed:  # its task is gone: nobody will await it
                _close_awaitable(stored.result().awaitable)
                self._flight_ends(flight)

        storing.add_done_callback(over)
        return storing

    def _call_and_store(
        self, name: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        value = fn(*args, **kwargs)
        if inspect.isawaitable(value):  # awaited on the loop by astep, then stored
            return _Unawaited(value)
        return self._store_step(name, value)

    def _stored(self, flight: StepInFlight, stored: asyncio.Future[Any]) -> None:
        if not stored.cancelled():
            stored.exception()  # retrieved: raised to the step's caller, if it still waits
        self._flight_ends(flight)

    # -- durable signals ---------------------------------------------------------------------
    def wait_for_signal(self, name: str, timeout: float | timedelta | None) -> Any:
        """The payload of signal ``name``: from the step store (a resumed run), or the
        signals sent so far (stored as the step now, so every later run gets the same
        one); else raise Suspended, which ends this run as a suspension."""
        if not isinstance(name, str) or not name or len(name) > SIGNAL_NAME_MAX:
            raise ConfigurationError(
                f"ctx.wait_for_signal needs a signal name of 1 to {SIGNAL_NAME_MAX} characters"
            )
        try:  # at most 100 years: a wait due later could not be read back as a date
            seconds = checked_seconds(timeout, "timeout", f"ctx.wait_for_signal({name!r}): ")
        except ConfigurationError as exc:
            raise ConfigurationError(f"{exc} (or None to wait without a limit)") from None
        if self.tx is not None:
            raise ConfigurationError(
                f"ctx.wait_for_signal({name!r}) inside ctx.transaction(): a suspended job "
                "holds no transaction; wait for the signal before opening it"
            )
        step = SIGNAL_STEP + name
        done, value = self._begin_step(step)
        if done:
            return value
        payload = self._store().signal_get(self.attempt.id, name)
        if payload is not None:
            return self._store_step(step, json.loads(payload))
        raise Suspended(name, seconds)

    async def await_signal(self, name: str, timeout: float | timedelta | None) -> Any:
        return await offloop.run(self.wait_for_signal, name, timeout)

    # -- progress ----------------------------------------------------------------------------
    def progress(self, fraction: float, message: str = "") -> None:
        if isinstance(fraction, bool) or not isinstance(fraction, int | float):
            raise ValueError(f"ctx.progress: fraction must be a number, got {fraction!r}")
        if not 0.0 <= fraction <= 1.0:  # NaN fails this too
            raise ValueError(f"ctx.progress: fraction must be from 0.0 to 1.0, got {fraction!r}")
        if not isinstance(message, str):
            raise ValueError(f"ctx.progress: message must be a string, got {message!r}")
        if self._secret_texts is None:
            self._secret_texts = _secrets(self.attempt)
        # masked before it is cut to size: a sensitive value cut in two is no longer found
        # by the masking where the message is shown
        text = scrub(message.replace("\x00", ""), self._secret_texts)[:PROGRESS_MESSAGE_MAX]
        report = (float(fraction), text.encode("utf-8", "replace").decode())
        self.attempt.progress = report
        if self.report_progress is not None:
            self.report_progress(report)

    # -- the completion transaction ----------------------------------------------------------
    def _not_open_now(self) -> TransactionEnded | None:
        """Why no transaction may be opened for this attempt now (None: it may)."""
        if self._let_go:
            return TransactionEnded(
                f"job {self.attempt.id}: the attempt has ended (timed out and abandoned, "
                "or released at shutdown); its ctx.transaction() is closed and nothing "
                "written in it is committed"
            )
        if self._closed:
            return TransactionEnded(
                f"job {self.attempt.id}: the attempt has ended (its handler returned or "
                "raised) while a task or thread it started went on; ctx.transaction() "
                "is not opened for it. Finish the work that needs it before the handler "
                "returns"
            )
        return None

    def transaction(self) -> TransactionConnection:
        with self._lock:
            refused = self._not_open_now()
            if refused is not None:
                raise refused
            self.tx_tried = True
            if self.tx is None:
                # Shielded until the attempt holds it: an interrupt (a timeout, a
                # self-fence) landing after the store opened the transaction and before
                # it was stored here orphaned it (a PostgreSQL handler-pool connection
                # never given back; on SQLite an open write transaction locking the file)
                with shielded():
                    backend = self.app.backend
                    try:
                        tx = backend.tx_begin()
                    except Exception as exc:  # (a read-only file: the store's own error)
                        mark_from_transaction(exc)
                        raise
                    mark_connection(tx)  # (an enqueue given it as conn= marks its errors)
                    try:
                        tx.execute(OPEN_SAVEPOINT)
                        # (SQLite: what ends its transaction, .raw included, is noted)
                        watch_transaction(tx)
                    except BaseException as exc:
                        mark_from_transaction(exc)
                        backend.tx_rollback(tx)
                        raise
                    # The handler may have ended while it was opened (an async handler's
                    # ctx.atransaction() opens it on a thread its task does not wait for
                    # once cancelled): its outcome, decided with no transaction, would never
                    # end this one (on SQLite its write lock stalled every writer for
                    # good). Kept, or ended here, under the lock close() takes.
                    with self._flights_lock:
                        late = self._closed
                        if not late:
                            self.tx, self.tx_backend, self.tx_opened = tx, backend, clock.now()
                    if late:
                        backend.tx_rollback(tx)
                        raise self._not_open_now() or TransactionEnded("the attempt has ended")
            return TransactionConnection(self.tx, self._ended, self._async_handler())

    def _async_handler(self) -> bool:
        definition = self.attempt.definition
        return definition is not None and definition.is_async

    async def atransaction(self) -> AsyncTransaction:
        """:meth:`transaction` for an async handler: opened on a thread of the
        transaction's own (a lane), where its statements then run too: on the loop, the
        open waited for SQLite's write lock (which another job of this loop held while
        it awaited) or a pool connection, and a statement for a row lock, and every
        async job of the worker stood still meanwhile."""
        with self._flights_lock:
            lane = self.tx_lane
            if lane is None and not self._closed:
                lane = self.tx_lane = Lane(f"errands-tx-{self.attempt.id}")
        try:
            if lane is None:
                raise LaneClosed
            conn = await lane.run(self.transaction)
        except LaneClosed:
            raise self._not_open_now() or TransactionEnded("the attempt has ended") from None
        return AsyncTransaction(conn, lane)

    def check_transaction(self) -> None:
        """Just before the completion is written in it: raise TransactionEnded unless the
        transaction is still the one errands opened (its savepoint is still there)."""
        freeze_watch(self.tx)
        rolled_back = rolled_back_by_sqlite(self.tx)
        if rolled_back is not None:  # SQLite's doing, not the handler's: nothing committed
            raise RuntimeError(
                f"job {self.attempt.id}: the transaction of ctx.transaction() was rolled back "
                f"by SQLite when a statement failed earlier in the handler ({rolled_back}); "
                "nothing of it is committed"
            )
        try:
            self.tx.execute(RELEASE_SAVEPOINT)
        except Exception as exc:
            if _broken(exc):  # the connection broke: not the handler's doing
                raise
            if type(exc).__name__ == "InFailedSqlTransaction":  # aborted, not ended: a
                raise RuntimeError(  # statement failed and the handler carried on
                    f"job {self.attempt.id}: the transaction of ctx.transaction() was aborted "
                    "by a statement that failed earlier in the handler; nothing of it is "
                    "committed"
                ) from exc
            raise TransactionEnded(
                f"job {self.attempt.id}: the transaction of ctx.transaction() was ended by the "
                f"handler before the job completed ({type(exc).__name__}: {exc}); the writes "
                "it made until then may be committed while the job is not. The job fails "
                "for good (its retry would repeat them): never commit, roll back or end that "
                "transaction yourself (raise to roll it back)"
            ) from None

    def transaction_ended(self) -> bool:
        """For a failed attempt: whether the handler ended errands' transaction (its
        savepoint is gone), so writes it made may be committed. Works in an aborted
        transaction too (ROLLBACK TO SAVEPOINT is allowed there)."""
        if self.tx is None:
            return False
        freeze_watch(self.tx)
        if rolled_back_by_sqlite(self.tx) is not None:
            return False  # (SQLite rolled it back itself: it ended nothing of the handler's)
        try:
            self.tx.execute(ROLLBACK_TO_SAVEPOINT)
        except Exception as exc:
            return not _broken(exc)  # a broken connection ended nothing of the handler's
        return False

    def _store(self) -> Backend:
        """The store of the open transaction, if one is: the attempt's reads and writes go
        to the store its transaction holds the lock of (see tx_backend)."""
        return self.tx_backend or self.app.backend

    def take_transaction(self) -> tuple[Backend, Any] | None:
        """The open transaction and its store, now the caller's alone to end (None: none
        is open, or another thread took it)."""
        with self._lock:
            tx, backend, self.tx, self.tx_backend = self.tx, self.tx_backend, None, None
        freeze_watch(tx)
        lane = self.tx_lane
        if lane is not None:  # nothing runs on it any more: its thread ends
            lane.close()
        if tx is None or backend is None:
            return None
        return backend, tx

    def ended_then_failed(self) -> TransactionEnded | None:
        """For a failed attempt: the permanent failure to record instead when the handler
        ended errands' transaction before it failed (its writes may be committed, so a
        retry would repeat them); None when it did not."""
        if not self.transaction_ended():
            return None
        return TransactionEnded(
            f"job {self.attempt.id}: the handler ended the transaction of ctx.transaction() "
            "and then failed; the writes it made until then may be committed, so the job "
            "fails for good instead of running them again"
        )

    def met_unwritable(self, exc: BaseException | None) -> bool:
        """Whether the failure ``exc`` that escaped the handler is the store's: the handler
        called ctx.transaction() (whether it opened or not), and ``exc`` is itself the
        store's error for a write it cannot take now (:func:`errors.cannot_write_now`: a
        full disk, PostgreSQL's class 53, an SQLite file full or read-only), raised by
        errands' own transaction connection:

        - through errands' wrapper of it (its ``execute``/``executemany``, a cursor's), its
          opening, a step stored in it, or an enqueue given it as ``conn=``: marked there
          (:mod:`errands.worker.txmark`);
        - through ``.raw`` on PostgreSQL: that connection is in a failed transaction, and
          ``exc`` is the error its last statement failed with (:func:`failed_with`);
        - through ``.raw`` on SQLite: SQLite rolled errands' transaction back itself (its
          watch saw no statement end it: :func:`rolled_back_by_sqlite`), as it does when
          a statement meets a full disk.

        Any other error is the handler's, whatever its code, and charged as usual: one
        from another database of the handler's own (an sqlite3 file it cannot open, a
        PostgreSQL connection of its own out of disk), or one it raised itself (on
        catching the store's, chained to it or not: the handler decided what that failure
        is). Taken for the store's, such an error had the job run again for ever,
        uncharged (attempt 0, its side effects outside the transaction repeated), never
        reaching dead. A full disk is the exception: whichever connection met it (errands'
        through ``.raw`` in a pipeline, an ``executemany`` or a savepoint block of
        psycopg's, which leave no evidence on the connection; a database of the
        handler's own, most often on the same disk), it is no fault of the job's and it
        passes once room is made: given back, bounded by the backstop. So is not a
        statement of the handler's past a limit of its own
        (QUERY_OWN_LIMITS: temp_file_limit, memory for its sort): class 53 too, but the
        same statement meets it again however long it waits.

        Nothing of the transaction commits; the job is given back uncharged (see
        OutcomeRecorder), as when its COMMIT meets such a store. Ask before
        :meth:`ended_then_failed`, whose ROLLBACK TO SAVEPOINT makes PostgreSQL forget
        the failed statement."""
        if exc is None or not self.tx_tried or not cannot_write_now(exc):
            return False
        if getattr(exc, "sqlstate", None) in QUERY_OWN_LIMITS:
            return False  # the handler's statement, at a limit of its own: charged
        if disk_full(exc):
            return True  # the machine's, whichever connection met it (see above)
        return (
            from_transaction(exc)
            or failed_with(self.tx, exc)
            or rolled_back_by_sqlite(self.tx) is not None
        )

    def rollback(self) -> None:
        self._end_with("tx_rollback", "roll back")

    def let_go(self) -> None:
        """The attempt was decided while its handler may still run (abandoned after its
        timeout, or released at shutdown), on another thread than the handler's. Its
        transaction is never used from here: the handler's thread may be inside a
        statement on it, holding the connection, and a ROLLBACK sent from here waited
        for that statement (from the lease keeper, which heartbeats every job of the
        worker: a handler stuck on a row lock froze them all, and their leases ran out).
        The backend ends it without waiting for the handler (tx_abandon); nothing of it
        is committed, and the handler cannot open another, nor store a step outside it.

        Never waits: the handler's thread holds this runtime's lock while it opens its
        transaction (a pool checkout, SQLite's write lock) or reads its steps, so the
        flag is set at once and the transaction taken on a thread of its own."""
        self._let_go = True  # read under the lock by transaction() and the steps
        self._ended.set()  # the handler's connection refuses its next statement
        threading.Thread(target=self._end_transaction, name="errands-let-go", daemon=True).start()

    def tx_let_go(self) -> bool:
        """Whether the handler's ctx.transaction() was let go of (ended without it, by
        :meth:`let_go`): nothing of it is committed, so the attempt cannot complete."""
        return self._let_go and bool(self.tx_opened)

    def _end_transaction(self) -> None:
        self._end_with("tx_abandon", "end")

    def _end_with(self, end: str, verb: str) -> None:
        """Take the open transaction (if any) and ``end`` it (its store's tx_rollback or
        tx_abandon); a failure is logged, never raised."""
        taken = self.take_transaction()
        if taken is not None:
            backend, tx = taken
            try:
                getattr(backend, end)(tx)
            except Exception:
                log.exception(
                    "could not %s the transaction of job %s",
                    verb,
                    self.attempt.id,
                    extra=job_extra(self.attempt.row),
                )

    # -- workflows -----------------------------------------------------------------------------
    def workflow_id(self) -> int | None:
        meta = self.attempt.row.meta
        if '"workflow' not in meta:  # most jobs: no JSON decoding
            return None
        try:
            data = json.loads(meta)
        except ValueError:
            return None
        found = data.get("workflow") or (data.get("workflow_callback") or {}).get("workflow")
        return int(found) if isinstance(found, int) else None

    def parent_results(self, after: int, limit: int, max_bytes: int) -> ParentResults:
        from ..workflows import ParentResult, ParentResults

        if limit < 1 or max_bytes < 1:
            raise ConfigurationError("ctx.parent_results: limit and max_bytes must be >= 1")
        rows = self._store().workflow_parent_results(self.attempt.id, after, limit + 1)
        more = len(rows) > limit
        items: list[ParentResult] = []
        used = 0
        for row in rows[:limit]:
            truncated = row.result_json is not None and used + row.size > max_bytes
            if truncated and items:
                more = True  # the next page starts here, with a fresh budget
                break
            used += 0 if truncated else row.size
            result = None
            if row.state == "completed" and row.result_json is not None and not truncated:
                result = self._decode_parent(row.job_id, row.result_json)
            items.append(ParentResult(row.job_id, row.node, row.state, result, truncated))
        return ParentResults(items, items[-1].job_id if more and items else None)

    def _decode_parent(self, job_id: int, result_json: str) -> Any:
        try:
            return loads_stored(result_json)
        except ValueError:
            log.warning("job %s: parent %s has an unreadable result", self.attempt.id, job_id)
            return None

    def add_to_workflow(self, job: BoundJob) -> None:
        request = self._member(job)
        self._hooked(request)
        with self._lock:
            self.children.append(request)

    async def aadd_to_workflow(self, job: BoundJob) -> None:
        """:meth:`add_to_workflow` for an async handler: its before_insert hooks run on a
        thread of their own when any is installed (as :meth:`aenqueue`'s)."""
        request = self._member(job)
        await self.app._off_loop(bool(self.app.events.inserters), self._hooked, request)
        with self._lock:
            self.children.append(request)

    def _member(self, job: BoundJob) -> EnqueueRequest:
        """The request of a member this attempt adds to its workflow (hooks not run yet)."""
        from ..definition import BoundJob

        if not isinstance(job, BoundJob):
            raise ConfigurationError(
                f"ctx.add_to_workflow takes job.bind(...), got {type(job).__name__}"
            )
        if '"workflow_callback"' in self.attempt.row.meta:
            # A callback runs once its workflow settled: nothing can join it any more. Its
            # added job was dropped (SQLite) or stored outside the workflow (PostgreSQL).
            row = self.attempt.row
            raise ConfigurationError(
                f"ctx.add_to_workflow: job {row.id} ({row.name}) is a callback of a "
                "workflow that has settled; no member can be added to it. Enqueue a new "
                "workflow (app.enqueue_workflow) or a job (ctx.enqueue) instead"
            )
        return replace(job.request, meta={**job.request.meta, WORKFLOW_ADD: True})

    # -- children ------------------------------------------------------------------------------
    def enqueue(self, job: JobDefinition[Any, Any] | BoundJob, *args: Any, **options: Any) -> None:
        request = self._child(job, *args, **options)
        self._hooked(request)
        with self._lock:
            self.children.append(request)

    async def aenqueue(
        self, job: JobDefinition[Any, Any] | BoundJob, *args: Any, **options: Any
    ) -> None:
        """:meth:`enqueue` for an async handler: the arguments are validated on the loop,
        as ``job.aenqueue`` validates them; the before_insert hooks, user code, run on a
        thread of their own when any is installed (a slow one held the worker's event
        loop, and every async job on it, for as long as it ran)."""
        request = self._child(job, *args, **options)
        await self.app._off_loop(bool(self.app.events.inserters), self._hooked, request)
        with self._lock:
            self.children.append(request)

    def _child(
        self,
        job: JobDefinition[Any, Any] | BoundJob,
        *args: Any,
        key: str | None = None,
        delay: float | timedelta | None = None,
        run_at: datetime | None = None,
        priority: int | None = None,
        queue: str | None = None,
        unique_for: float | timedelta | None = None,
        **kwargs: Any,
    ) -> EnqueueRequest:
        """The request of a child of this attempt, validated (hooks not run yet)."""
        from ..definition import BoundJob, EnqueueOptions, JobDefinition

        if isinstance(job, BoundJob):
            if args or kwargs:
                raise ConfigurationError("ctx.enqueue(job.bind(...)) takes no more arguments")
            request = job.request
        elif isinstance(job, JobDefinition):
            options = EnqueueOptions(key, delay, run_at, priority, queue, unique_for)
            request = job.request(args, kwargs, options)
        else:
            raise ConfigurationError(
                f"ctx.enqueue takes a job (an @app.job function) or job.bind(...), got "
                f"{type(job).__name__}"
            )
        return replace(request, meta=dict(request.meta), parent_id=self.attempt.id)

    def _hooked(self, request: EnqueueRequest) -> None:
        """The app's before_insert hooks on a request the store inserts with this
        attempt's outcome (they never ran: a child got no trace context, so it began a
        trace of its own)."""
        self.app.events.prepare_insert([request], stored_later=True)


class _Unawaited:
    """What a step's plain fn, run in a thread, returned when it is awaitable (a lambda
    around a coroutine call): awaited by astep on the loop, then stored."""

    __slots__ = ("awaitable",)

    def __init__(self, awaitable: Awaitable[Any]) -> None:
        self.awaitable = awaitable


async def _in_step(flight: StepInFlight, call: Callable[[], Awaitable[Any]]) -> Any:
    """Await what ``call()`` returns (a step's fn) with the tasks and threads it starts on
    the worker's loop counted as the step's work (see :mod:`.stepwork`), and note whether
    the fn was cut short by a cancel (StepInFlight.cut_short): it raised CancelledError,
    or another error while its task was being cancelled (a fn turning the cancel into
    an error of its own)."""
    token = stepwork.STEP.set(flight.counter)
    try:
        return await call()
    except (Exception, asyncio.CancelledError) as exc:
        if _cut_short(exc):
            flight.cut_short = True
            # (compared now: a handler or a library may have replaced the loop's task
            # factory since the worker set it, and the fn's tasks went uncounted)
            if not stepwork.counts_step_work(asyncio.get_running_loop()):
                flight.unseen = True
        raise
    finally:
        # (not from a task left pending at the loop's end, closed by the garbage collector
        # in another context: nothing to undo there)
        with contextlib.suppress(ValueError):
            stepwork.STEP.reset(token)


def _cut_short(exc: BaseException) -> bool:
    """Whether a step's fn that raised ``exc`` was cut short by a cancel of its task."""
    if isinstance(exc, asyncio.CancelledError):
        return True
    try:
        task = asyncio.current_task()
    except RuntimeError:  # (no loop running)
        return False
    return task is not None and task.cancelling() > 0


def _given(awaitable: Awaitable[T]) -> Awaitable[T]:
    return awaitable


def _awaits(fn: Any) -> bool:
    """Whether ``fn`` is a coroutine function (a partial or a method of one, or an object
    whose ``__call__`` is one): astep calls it on the loop and awaits it; any other fn
    runs in a thread."""
    if inspect.iscoroutinefunction(fn):
        return True
    if isinstance(fn, type):  # a class: calling it makes an instance
        return False
    call = inspect.getattr_static(type(fn), "__call__", None)
    return call is not None and inspect.iscoroutinefunction(call)


def _close_awaitable(awaitable: Awaitable[Any]) -> None:
    """A coroutine nobody will await, closed (no "never awaited" warning; nothing ran)."""
    if inspect.iscoroutine(awaitable):
        awaitable.close()


def _unawaited_dropped(
    storing: asyncio.Future[Any], flight: StepInFlight, runtime: AttemptRuntime
) -> None:
    """astep's task stopped waiting for its fn's thread (cancelled, or it raised): an
    awaitable the fn returns is awaited by nobody; the flight ends with the thread."""
    flight.handed = True
    if (
        storing.done()
        and not storing.cancelled()
        and storing.exception() is None
        and isinstance(storing.result(), _Unawaited)
    ):
        _close_awaitable(storing.result().awaitable)
        runtime._flight_ends(flight)


def _not_reserved(name: str) -> None:
    """Raise ConfigurationError for a step name the signals' steps use: a step named
    ``signal:<x>`` is what ctx.wait_for_signal(x) returns, without waiting, in every later
    run (and a wait stored first would be returned by the step instead of its fn)."""
    if isinstance(name, str) and name.startswith(SIGNAL_STEP):
        raise ConfigurationError(
            f"ctx.step({name!r}): step names starting with {SIGNAL_STEP!r} are reserved: "
            f"ctx.wait_for_signal(name) stores the payload it returns as step "
            f"'{SIGNAL_STEP}<name>'; give the step another name"
        )


def _broken(exc: BaseException) -> bool:
    """Connection or lock trouble (the store's, not the handler's doing). SQLite reports a
    missing savepoint as an OperationalError too, so its errors are told apart by text."""
    if isinstance(exc, sqlite3.Error):
        text = str(exc).lower()
        return any(word in text for word in ("locked", "busy", "disk i/o", "closed"))
    return is_transient(exc)


SAVEPOINT = "errands_tx"
OPEN_SAVEPOINT = "SAVEPOINT errands_tx"
RELEASE_SAVEPOINT = "RELEASE SAVEPOINT errands_tx"
ROLLBACK_TO_SAVEPOINT = "ROLLBACK TO SAVEPOINT errands_tx"
_REFUSED_CALLS = {"commit", "rollback", "close", "executescript", "set_autocommit"}
# Setting these ends or changes the open transaction (sqlite3 commits when its
# isolation_level becomes None); other attributes (row_factory, ...) may be set.
_REFUSED_SETTINGS = {"autocommit", "isolation_level", "read_only", "deferrable"}


def _statement_text(conn: Any, query: Any) -> str:
    if isinstance(query, str):
        return query
    if isinstance(query, bytes | bytearray | memoryview):
        return bytes(query).decode("utf-8", "replace")
    as_string = getattr(query, "as_string", None)  # psycopg.sql.Composed / SQL
    if as_string is not None:
        try:
            return str(as_string(conn))
        except Exception:
            return ""
    return str(query)


# Set on an SQLite connection of ctx.transaction() whose transaction SQLite rolled back
# itself when a statement of the handler's failed (see watched): why, as text.
ROLLED_BACK_BY_STORE = "errands_rolled_back_by_store"


def store_rolled_back(conn: Any) -> str | None:
    """Why SQLite rolled back the transaction of ctx.transaction() on ``conn`` itself, as
    a statement of the handler's through errands' connection saw it (see :func:`watched`),
    or None."""
    return getattr(conn, ROLLED_BACK_BY_STORE, None)


# PostgreSQL's class-53 errors that a statement meets by itself, not a store that cannot
# write: configuration_limit_exceeded (temp_file_limit), out_of_memory (its own sort or
# hash past the server's memory).
QUERY_OWN_LIMITS = frozenset({"53400", "53200"})

# Set on an SQLite connection of ctx.transaction(): its TransactionWatch
TX_WATCH = "errands_tx_watch"


class TransactionWatch:
    """What ran on the SQLite connection of ctx.transaction() that errands does not see
    otherwise (a statement through ``ctx.transaction().raw``, a call such as
    ``raw.commit()``): the connection's authorizer, which SQLite calls as it prepares
    each statement (the connection caches none: see SQLiteBackend.tx_begin). It notes
    a statement that ends the transaction (COMMIT, END, ROLLBACK, RELEASE of errands'
    savepoint), and one prepared while no transaction is open (run in autocommit mode:
    committed on its own). When the transaction is gone and neither happened, SQLite
    rolled it back itself, on a statement that failed (SQLITE_FULL, an I/O error):
    the store's doing, not the handler's (:func:`rolled_back_by_sqlite`).

    It refers to its connection weakly (no cycle: an abandoned connection is closed as
    its last reference goes), and notes nothing once ``frozen`` (errands' own
    statements as the attempt ends)."""

    __slots__ = ("_conn", "ended_by", "frozen", "outside")

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = weakref.ref(conn)  # (TypeError for a plain sqlite3.Connection)
        self.ended_by: str | None = None
        self.outside = False
        self.frozen = False

    def __call__(self, action: int, arg1: str | None, arg2: str | None, *_: Any) -> int:
        if self.frozen:
            return sqlite3.SQLITE_OK
        try:
            conn = self._conn()
            open_now = conn is not None and conn.in_transaction
            if not open_now:
                self.outside = True
            elif action == sqlite3.SQLITE_TRANSACTION and arg1 != "BEGIN":  # (BEGIN fails)
                self.ended_by = self.ended_by or str(arg1)
            elif (
                action == sqlite3.SQLITE_SAVEPOINT
                and arg1 == "RELEASE"
                and str(arg2).lower() == SAVEPOINT
            ):
                self.ended_by = self.ended_by or f"RELEASE {SAVEPOINT}"
        except Exception:  # (never raised into SQLite: it would deny the statement)
            pass
        return sqlite3.SQLITE_OK


def watch_transaction(conn: Any) -> None:
    """Install a :class:`TransactionWatch` on ``conn`` if it is an SQLite connection of
    errands' own (a plain sqlite3.Connection takes no attributes: none then)."""
    if not isinstance(conn, sqlite3.Connection):
        return
    try:
        watch = TransactionWatch(conn)
        setattr(conn, TX_WATCH, watch)
    except (TypeError, AttributeError):
        return
    conn.set_authorizer(watch)


def freeze_watch(conn: Any) -> None:
    """The handler is over: errands' own statements on ``conn`` are not the handler's."""
    watch = getattr(conn, TX_WATCH, None)
    if watch is not None:
        watch.frozen = True


def rolled_back_by_sqlite(conn: Any) -> str | None:
    """Why SQLite rolled back the transaction of ctx.transaction() on ``conn`` itself (a
    statement failed: SQLITE_FULL, an I/O error), however that statement was sent
    (errands' connection, its cursor, ``.raw``, a step's storage), or None: it did not
    (it is open, or the handler ended it, or ran a statement after it was gone, which
    may have committed on its own: the handler's doing)."""
    if not isinstance(conn, sqlite3.Connection):
        return None
    noted = store_rolled_back(conn)
    watch = getattr(conn, TX_WATCH, None)
    if watch is None:
        return noted
    if watch.ended_by is not None or watch.outside:
        return None
    try:
        if conn.in_transaction:
            return None
    except sqlite3.Error:  # closed
        return None
    return noted or "a statement in it failed (sent through ctx.transaction().raw)"


def sqlite_transaction_gone(conn: Any) -> Exception | None:
    """The error for a statement on the SQLite connection of ctx.transaction() whose
    transaction is no longer open (it would run in autocommit mode, committed on its
    own): RuntimeError when SQLite rolled it back itself, TransactionEnded when the
    handler ended it (through ``.raw``); None while it is open."""
    if not isinstance(conn, sqlite3.Connection):
        return None
    if getattr(conn, TX_WATCH, None) is None and store_rolled_back(conn) is None:
        return None  # (not a connection errands opened the transaction on)
    try:
        open_now = conn.in_transaction
    except sqlite3.Error:  # closed: the call says so
        return None
    if open_now and store_rolled_back(conn) is None:
        return None
    why = rolled_back_by_sqlite(conn)
    if why is not None:
        return RuntimeError(
            "ctx.transaction(): SQLite rolled this transaction back when a statement in it "
            f"failed ({why}); nothing of it commits, and nothing more runs in it "
            "(raise, or let that error through, to end the attempt)"
        )
    return TransactionEnded(
        "ctx.transaction(): its transaction was ended (through .raw: a COMMIT, ROLLBACK "
        "or END, or a statement run after it was gone); nothing more runs on it. Never "
        "end that transaction yourself (raise to roll it back)"
    )


def failed_with(conn: Any, exc: BaseException) -> bool:
    """Whether ``exc`` is the error the last statement on ``conn`` (a psycopg connection of
    ctx.transaction(), a statement sent through ``.raw``) failed with: the connection is
    in a failed transaction (INERROR), and the server's error text it holds for that
    statement is ``exc``'s. Never for an error made by the handler (no server result),
    nor one of another connection while errands' went on (its own error text is gone)."""
    if conn is None or isinstance(conn, sqlite3.Connection):
        return False
    try:
        status = conn.info.transaction_status
        result = getattr(exc, "pgresult", None)
        if getattr(status, "name", None) != "INERROR" or result is None:
            return False
        text = result.error_message
        return bool(text) and text == conn.pgconn.error_message
    except Exception:  # (closed, broken, not psycopg's: no evidence)
        return False


def _materialized(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """executemany's arguments with its rows made a list: a generator of the handler's
    ran inside the driver's call, and an error of its own (its own SQLite file read-only)
    read as one of errands' connection (:func:`watched`)."""
    if not args:
        return args
    rows = args[0]
    if isinstance(rows, list | tuple):
        return args
    return (list(rows), *args[1:])


def watched(conn: Any, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``call(*args, **kwargs)``, a statement of the handler's on the transaction of
    ctx.transaction() (``conn``). Its error is marked as that connection's
    (:func:`mark_from_transaction`): one that says the store cannot write now is the
    store's, not the handler's, when it escapes the handler.

    On SQLite, a statement that fails on a full disk (SQLITE_FULL: the file reached its
    limit), or on I/O, memory or lock trouble, may roll the whole transaction back,
    errands' savepoint with it: SQLite's doing, noted on the connection, so that the
    failure is not taken for the handler ending the transaction itself
    (``TransactionEnded``: the job dead for good, its writes thought committed) and
    nothing more runs on it (it would run in autocommit mode, committed on its own)."""
    before = False
    if isinstance(conn, sqlite3.Connection):
        with contextlib.suppress(sqlite3.Error):  # (closed: the call says so)
            before = conn.in_transaction
    try:
        return call(*args, **kwargs)
    except Exception as exc:
        mark_from_transaction(exc)
        if before and isinstance(exc, sqlite3.Error):
            try:
                ended = not conn.in_transaction
            except sqlite3.Error:
                ended = False
            if ended:
                # (AttributeError: a plain sqlite3.Connection; errands' own take attributes)
                with contextlib.suppress(AttributeError):
                    setattr(conn, ROLLED_BACK_BY_STORE, f"{type(exc).__name__}: {exc}")
        raise


def refuse_ending(conn: Any, query: Any, ended: threading.Event | None = None) -> None:
    """Raise TransactionEnded if ``query`` would end the transaction of ctx.transaction(),
    or if the attempt let go of it (``ended``): nothing more runs on it then (on SQLite a
    write after its rollback would have committed on its own)."""
    if ended is not None and ended.is_set():
        raise TransactionEnded(
            "ctx.transaction(): the attempt has ended (timed out and abandoned, or released "
            "at shutdown); nothing more runs in its transaction, and nothing of it commits"
        )
    gone = sqlite_transaction_gone(conn)
    if gone is not None:  # a statement now would run (and commit) on its own
        raise gone
    # told by the statements' first words, their strings, quoted names, comments and
    # dollar-quoted bodies skipped (split on every ";", `DO $$ BEGIN ...; END $$` was
    # refused as END, and the job was dead)
    verb = ending_statement(
        _statement_text(conn, query),
        "sqlite" if isinstance(conn, sqlite3.Connection) else "postgres",
        SAVEPOINT,
        standard_strings=_standard_strings(conn),
    )
    if verb is not None:
        raise TransactionEnded(
            f"ctx.transaction() connection: {verb} is not allowed; this transaction "
            "commits together with the job's completion (raise to roll it back)"
        )


def _standard_strings(conn: Any) -> bool:
    """Whether a PostgreSQL connection reads backslashes in '...' as themselves (the
    server's standard_conforming_strings, on unless set off)."""
    info = getattr(conn, "info", None)
    status = getattr(info, "parameter_status", None)
    if status is None:
        return True
    try:
        return status("standard_conforming_strings") != "off"
    except Exception:
        return True


def refuse_on_the_loop(what: str) -> None:
    """Raise ConfigurationError when a statement of an async handler's transaction would
    run on an event loop (the worker's, which every async job of it shares): it may wait
    for a lock (a row, SQLite's file) that another job of that loop holds while it awaits."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # a thread of its own: it may block
        return
    raise ConfigurationError(
        f"{what} on the event loop of an async def handler would stall every async job "
        "of the worker while it runs (waiting for a row lock or SQLite's write lock that "
        "another of them holds: for good); use `tx = await ctx.atransaction()` and "
        "`await tx.execute(...)` instead"
    )


class TransactionConnection:
    """The handler's view of the completion transaction: the driver connection, minus the
    calls that would end the transaction early (errands commits it with the job), and
    refusing every statement once the attempt has let go of it (``ended``: abandoned
    past its timeout or released at shutdown; see AttemptRuntime.let_go). Of an async
    handler (``off_loop``), it refuses statements made on an event loop."""

    __slots__ = ("_conn", "_ended", "_off_loop")

    def __init__(
        self, conn: Any, ended: threading.Event | None = None, off_loop: bool = False
    ) -> None:
        self._conn = conn
        self._ended = ended or threading.Event()
        self._off_loop = off_loop

    def __getattr__(self, name: str) -> Any:
        if name in _REFUSED_CALLS:
            raise TransactionEnded(
                f"ctx.transaction() connection: {name} is not allowed; the transaction "
                "commits together with the job's completion (raise to roll it back)"
            )
        return getattr(self._conn, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("_conn", "_ended", "_off_loop"):
            object.__setattr__(self, name, value)
        elif name in _REFUSED_SETTINGS:
            raise TransactionEnded(
                f"ctx.transaction() connection: setting {name} is not allowed (it would end "
                "or change the transaction errands commits with the job)"
            )
        else:
            setattr(self._conn, name, value)

    def execute(self, query: Any, *args: Any, **kwargs: Any) -> GuardedCursor:
        refuse_ending(self._conn, query, self._ended)
        if self._off_loop:
            refuse_on_the_loop("a statement of ctx.transaction()")
        cursor = watched(self._conn, self._conn.execute, query, *args, **kwargs)
        return GuardedCursor(self._conn, cursor, self._ended, self._off_loop)

    def executemany(self, query: Any, *args: Any, **kwargs: Any) -> Any:
        refuse_ending(self._conn, query, self._ended)
        if self._off_loop:
            refuse_on_the_loop("a statement of ctx.transaction()")
        args = _materialized(args)  # (the handler's iterable runs outside the watch)
        result = watched(self._conn, self._conn.executemany, query, *args, **kwargs)
        if result is None:
            return None
        return GuardedCursor(self._conn, result, self._ended, self._off_loop)

    def cursor(self, *args: Any, **kwargs: Any) -> GuardedCursor:
        refuse_ending(self._conn, "", self._ended)
        cursor = self._conn.cursor(*args, **kwargs)
        return GuardedCursor(self._conn, cursor, self._ended, self._off_loop)

    def __enter__(self) -> TransactionConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        return None  # the job's completion commits it; an exception rolls it back

    @property
    def raw(self) -> Any:
        """The underlying sqlite3 or psycopg connection (do not commit it yourself: errands
        checks before the completion, and fails the job if the transaction was ended)."""
        return self._conn


class GuardedCursor:
    """A cursor of the completion transaction: statements that would end it are refused."""

    __slots__ = ("_conn", "_cursor", "_ended", "_off_loop")

    def __init__(
        self,
        conn: Any,
        cursor: Any,
        ended: threading.Event | None = None,
        off_loop: bool = False,
    ) -> None:
        self._conn = conn
        self._cursor = cursor
        self._ended = ended or threading.Event()
        self._off_loop = off_loop

    def __getattr__(self, name: str) -> Any:
        if name == "executescript":
            raise TransactionEnded(
                "ctx.transaction() cursor: executescript is not allowed (it commits first); "
                "the transaction commits together with the job's completion"
            )
        if name == "connection":
            return TransactionConnection(self._conn, self._ended, self._off_loop)
        return getattr(self._cursor, name)

    def execute(self, query: Any, *args: Any, **kwargs: Any) -> GuardedCursor:
        refuse_ending(self._conn, query, self._ended)
        if self._off_loop:
            refuse_on_the_loop("a statement of ctx.transaction()")
        watched(self._conn, self._cursor.execute, query, *args, **kwargs)
        return self

    def executemany(self, query: Any, *args: Any, **kwargs: Any) -> GuardedCursor:
        refuse_ending(self._conn, query, self._ended)
        if self._off_loop:
            refuse_on_the_loop("a statement of ctx.transaction()")
        args = _materialized(args)  # (the handler's iterable runs outside the watch)
        watched(self._conn, self._cursor.executemany, query, *args, **kwargs)
        return self

    def __iter__(self) -> Iterator[Any]:
        return iter(self._cursor)

    def __enter__(self) -> GuardedCursor:
        return self

    def __exit__(self, *exc: object) -> None:
        close = getattr(self._cursor, "close", None)
        if close is not None:
            close()


ROWS_AT_A_TIME = 100  # rows an ``async for`` over an AsyncCursor fetches in one call


def _a_method(value: Any) -> bool:
    """A method of the driver's (which may reach the database), not a value such as a
    row factory (sqlite3.Row, psycopg's dict_row), which is callable too."""
    return inspect.ismethod(value) or inspect.isbuiltin(value)


def _blocking_call(what: str, name: str) -> TypeError:
    return TypeError(
        f"ctx.atransaction() {what}: {name}() reaches the database, and would run on the "
        f"event loop; run it on the transaction's thread: "
        f"`await tx.run_sync(lambda conn: conn.{name}(...))` (conn is the connection of "
        "ctx.transaction(), with the same refusals)"
    )


class AsyncTransaction:
    """What ``await ctx.atransaction()`` returns: the completion transaction of an async
    handler, with the refusals of :class:`TransactionConnection`, whose calls that reach
    the database are awaited: they run on the transaction's own thread, one at a time in
    the order made, never on the event loop (where a statement waiting for a lock held
    every async job of the worker, the one holding that lock included).

    ``await tx.execute(...)`` / ``executemany`` give an :class:`AsyncCursor`
    (``await cur.fetchone()``, ``fetchmany``, ``fetchall``, ``async for row in cur``);
    ``tx.cursor()`` one to run statements on; ``await tx.run_sync(fn, ...)`` calls
    ``fn(conn, ...)`` there with the sync connection (for what else the driver offers);
    ``tx.raw`` is the driver connection (sync: use it from a thread). ``async with tx:``
    does what ``with`` does on the sync one: nothing (the completion commits it; an
    exception rolls it back). Cancelling a task awaiting a statement does not stop the
    statement once it began (it ends on its thread; one not begun yet is dropped).
    """

    __slots__ = ("_conn", "_lane")

    def __init__(self, conn: TransactionConnection, lane: Lane) -> None:
        object.__setattr__(self, "_conn", conn)
        object.__setattr__(self, "_lane", lane)

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return await self._lane.run(fn, *args)
        except LaneClosed:
            raise TransactionEnded(
                "ctx.atransaction(): the attempt has ended (its handler returned or raised, "
                "or it was stopped); no statement runs in its transaction any more, and the "
                "job's outcome has ended it"
            ) from None

    async def execute(self, query: Any, *args: Any, **kwargs: Any) -> AsyncCursor:
        call = functools.partial(self._conn.execute, query, *args, **kwargs)
        return AsyncCursor(await self._run(call), self)

    async def executemany(self, query: Any, *args: Any, **kwargs: Any) -> AsyncCursor | None:
        call = functools.partial(self._conn.executemany, query, *args, **kwargs)
        cursor = await self._run(call)
        return None if cursor is None else AsyncCursor(cursor, self)

    def cursor(self, *args: Any, **kwargs: Any) -> AsyncCursor:
        """A cursor (made at once: no statement runs until ``await cur.execute(...)``)."""
        return AsyncCursor(self._conn.cursor(*args, **kwargs), self)

    async def run_sync(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(conn, *args, **kwargs)`` on the transaction's thread, ``conn`` the sync
        connection of ``ctx.transaction()`` (its refusals apply)."""
        result: T = await self._run(functools.partial(fn, self._conn, *args, **kwargs))
        return result

    @property
    def raw(self) -> Any:
        """The underlying sqlite3 or psycopg connection (sync: call it from a thread; do
        not commit it yourself)."""
        return self._conn.raw

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        value = getattr(self._conn, name)  # (commit, rollback, close ... raise there)
        if _a_method(value):
            raise _blocking_call("connection", name)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._conn, name, value)  # (autocommit, isolation_level ... refused there)

    async def __aenter__(self) -> AsyncTransaction:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None  # the job's completion commits it; an exception rolls it back


class AsyncCursor:
    """A cursor of :class:`AsyncTransaction`: its statements and fetches are awaited, run
    on the transaction's thread; statements that would end the transaction are refused."""

    __slots__ = ("_cursor", "_tx")

    def __init__(self, cursor: GuardedCursor, tx: AsyncTransaction) -> None:
        object.__setattr__(self, "_cursor", cursor)
        object.__setattr__(self, "_tx", tx)

    async def execute(self, query: Any, *args: Any, **kwargs: Any) -> AsyncCursor:
        await self._tx._run(functools.partial(self._cursor.execute, query, *args, **kwargs))
        return self

    async def executemany(self, query: Any, *args: Any, **kwargs: Any) -> AsyncCursor:
        call = functools.partial(self._cursor.executemany, query, *args, **kwargs)
        await self._tx._run(call)
        return self

    async def fetchone(self) -> Any:
        return await self._tx._run(self._cursor.fetchone)

    async def fetchmany(self, *args: Any, **kwargs: Any) -> list[Any]:
        rows: list[Any] = await self._tx._run(
            functools.partial(self._cursor.fetchmany, *args, **kwargs)
        )
        return rows

    async def fetchall(self) -> list[Any]:
        rows: list[Any] = await self._tx._run(self._cursor.fetchall)
        return rows

    async def close(self) -> None:
        await self._tx._run(self._cursor.close)

    @property
    def connection(self) -> AsyncTransaction:
        return self._tx

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._rows()

    async def _rows(self) -> AsyncIterator[Any]:
        while rows := await self.fetchmany(ROWS_AT_A_TIME):
            for row in rows:
                yield row

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        value = getattr(self._cursor, name)  # (executescript raises there)
        if _a_method(value):
            raise _blocking_call("cursor", name)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._cursor, name, value)

    async def __aenter__(self) -> AsyncCursor:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
