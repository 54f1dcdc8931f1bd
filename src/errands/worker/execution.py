"""One attempt of one job: from a claimed row to a fenced outcome.

``Attempt`` holds what the worker knows about a job it runs. An attempt's outcome is
decided exactly once — by the handler returning or raising, by its timeout, or by a
shutdown release — whichever comes first; the losers are ignored.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import clock
from ..backends.base import FinishParams, FinishState
from ..context import Context
from ..errors import ConfigurationError, InvalidPayload, StepError, TransactionEnded
from ..errortext import clip, clip_trace, format_trace, scrub
from ..jobs import JobRow
from ..jsontext import loads_stored
from ..outcomes import Permanent, Retry
from ..retry import DELAY_LIMIT, retry_delay
from .process_pool import ChildFailure
from .runners import Call

if TYPE_CHECKING:
    from ..definition import JobDefinition
    from .runtime import AttemptRuntime

# Why a worker asks a handler to stop (``ctx.cancel_reason``), other than a timeout:
CANCELLED = "cancelled"  # an operator cancelled the job: it ends ``cancelled``
LEASE_LOST = "lease lost"  # another worker may run it now: the outcome is fenced out
LEASE_UNRENEWED = "lease could not be renewed"  # self-fenced: store unreachable
SHUTDOWN = "shutdown"  # graceful stop past the grace period: the job is released


class Interrupted(Exception):
    """The worker stopped the handler (raised in an async task; recorded for a sync
    handler that returned after being asked to stop): never a completion."""

    def __init__(self, reason: str) -> None:
        super().__init__(
            reason if reason != CANCELLED else "cancelled by an operator while running"
        )
        self.reason = reason

    @property
    def kind(self) -> str:
        """The error entry's kind: ``cancelled``, or ``lease_lost`` for a lease problem."""
        return "cancelled" if self.reason == CANCELLED else "lease_lost"


class JobTimeout(Exception):
    """The handler ran past its ``timeout``."""


class HandlerCancelled(Exception):
    """An async handler raised ``asyncio.CancelledError`` though the worker never asked it
    to stop (a task or future it awaited was cancelled): a transient failure, retried."""


class Suspended(BaseException):
    """Raised by ``ctx.wait_for_signal`` when the signal is not there yet: the handler
    unwinds (a BaseException, so ``except Exception`` does not swallow it), and the
    attempt ends as a suspension: the job waits, holding no lease and no slot."""

    def __init__(self, signal: str, timeout: float | None) -> None:
        super().__init__(signal)
        self.signal = signal
        self.timeout = timeout


@dataclass
class FenceSteps:
    """How a self-fenced attempt is stopped before its lease runs out (see
    :func:`errands.worker.timeouts.on_fence`): at the fence ``ctx.cancelled`` turned true
    (an async task was cancelled, a child process killed); a sync handler's thread then
    gets HandlerInterrupt at ``interrupt_at``, and at ``abandon_at`` its job is given back
    (released, uncharged) and the thread left to finish alone."""

    interrupt_at: float | None = None  # monotonic; None: done, or nothing to interrupt
    abandon_at: float | None = None  # monotonic; None: done, or nothing to abandon

    def next_at(self) -> float | None:
        """When the next step is due (None: no step left)."""
        steps = [t for t in (self.interrupt_at, self.abandon_at) if t is not None]
        return min(steps) if steps else None


@dataclass(eq=False)
class Attempt:
    row: JobRow
    definition: JobDefinition[Any, Any] | None
    lease_seconds: float
    started: float = field(default_factory=clock.now)  # errands.clock, as every time here
    ctx: Context | None = None
    kwargs: dict[str, Any] | None = None
    deadline: float | None = None  # errands.clock
    lease_valid_until: float = 0.0  # errands.clock: our lease surely holds until then
    # Call: a sync handler on the thread pool; Task: an async one (on the loop)
    future: Future[Any] | Call | asyncio.Task[Any] | None = None
    task: asyncio.Task[Any] | None = None
    decided: bool = False
    # Its outcome is being built, decided (a ctx.transaction() commit may wait on a lock):
    # a graceful stop waits for it as for a running handler
    writing: bool = False
    released: bool = False
    ended: float = 0.0  # errands.clock time the outcome was decided
    runtime: AttemptRuntime | None = None
    kill: Callable[[BaseException], object] | None = None  # process pool: end the child
    child: Future[Any] | None = None  # process pool, isolated suspect: the child's answer
    timed_out: bool = False
    timeout_at: float = 0.0  # errands.clock time the timeout fired
    ran: float | None = None  # seconds the handler's own call took, once it returned or raised
    interrupted: bool = False
    waiting: bool = False  # prefetched: queued for a handler thread (a loop slot), not begun
    # One of the handlers' slots (HandlerSlots): an async handler's, or in a worker with
    # both kinds of handler any one's; given back once (drop_slot)
    holds_slot: bool = False
    express: bool = False  # on the worker's express lane (a fair key with nothing running)
    stop_reason: str | None = None  # the first interrupt's reason (kept before a ctx exists)
    fence: FenceSteps | None = None  # self-fenced (its lease could not be renewed): its steps
    reported: int = 0  # "still running" lines written for it so far
    progress: tuple[float, str] | None = None  # ctx.progress, latest
    progress_stored: tuple[float, str] | None = None  # ... as the last heartbeat stored it
    # A graceful stop took the attempt over at the end of its grace period (see
    # stop_for_shutdown): the stop decides its outcome (a release, or its timeout)
    stopping: bool = False
    # ... and its handler has ended since (its own outcome refused): its timeout, which
    # can no longer be the handler's, never fires (see time_out)
    ended_at_stop: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # The two ends after which the attempt's objects are let go of (see unlink)
    _written: bool = field(default=False, repr=False)
    _handler_over: bool = field(default=False, repr=False)

    def drop_slot(self) -> bool:
        """Whether it held a slot, which it holds no more: the caller gives it back. Once
        an attempt, whichever thread asks first (its handler's end, an abandonment)."""
        with self._lock:
            held, self.holds_slot = self.holds_slot, False
        return held

    def outcome_written(self) -> None:
        """Its outcome is stored (or refused, or lost): one of unlink's two ends."""
        self._reach("_written")

    def handler_over(self) -> None:
        """Its handler's thread is done with it (the call and its outcome's handling
        returned), or its task is done without a thread of its own left running: the
        other of unlink's two ends."""
        self._reach("_handler_over")

    def _reach(self, end: str) -> None:
        with self._lock:
            setattr(self, end, True)
            both = self._written and self._handler_over
        if both:
            self.unlink()

    def unlink(self) -> None:
        """Drop what points back at the attempt: its Context and runtime (which hold
        it), its handler's call or task (a failed task's traceback holds frames that
        hold it). Left, each such job was a cycle for the garbage collector, and a busy
        worker spent its CPU in full collections. Called once both ends came, in either
        order (:meth:`outcome_written`, :meth:`handler_over`): until then a timeout, a stop
        or a lost lease still reaches the handler through them, and readers on other
        threads read each of them once (it may turn None between two reads). An attempt
        whose handler never ends here (abandoned; a task stopped while a thread of its own
        may run on) keeps them: the collector frees those. A thread the handler started
        that still holds its ``ctx`` keeps what it uses alive. (A sync handler's call lets
        go of the attempt as soon as it ran: :meth:`errands.worker.runners.Call.release`.)"""
        self.ctx = None
        self.runtime = None
        self.future = None
        self.task = None

    def __post_init__(self) -> None:
        self.lease_valid_until = self.started + self.lease_seconds

    @property
    def id(self) -> int:
        return self.row.id

    @property
    def token(self) -> str:
        return self.row.lease_token or ""

    def decide(self, *, over_stop: bool = False) -> bool:
        """True for the first caller only: it owns this attempt's outcome.

        Once a graceful stop took the attempt over (:meth:`stop_for_shutdown`), the
        handler's end is not its outcome: False, and the handler is marked as ended
        (``ended_at_stop``, its deadline disarmed), in the same step as the stop's claim
        is checked. A handler that returned as the grace period ended was recorded
        ``completed`` after the stop had let go of (rolled back) its ctx.transaction().
        ``over_stop``: a decision the stop leaves to its maker: the timeout of a handler
        that still runs (it lets go of the transaction, never commits in it), or an
        outcome a process-pool child has already stored."""
        with self._lock:
            if self.decided:
                return False
            if self.stopping and not over_stop:
                self.ended_at_stop = True
                self.deadline = None
                return False
            # writing with it: a stop that sees it decided waits for its outcome's write
            self.decided = self.writing = True
            return True

    def stop_for_shutdown(self) -> bool:
        """A graceful stop takes the attempt over at the end of its grace period: from now
        on the stop decides its outcome (it gives the job back once its steps are over,
        or records its timeout), and only then asks the handler to stop and lets go of
        its ctx.transaction(). False when its outcome was decided first (the handler's:
        it is written, and its transaction is the handler's to commit)."""
        with self._lock:
            if self.decided or self.released:
                return False
            self.stopping = True
            return True

    def time_out(self, now: float) -> bool:
        """Its deadline passed (the lease keeper): mark it timed out, unless its outcome is
        decided or its handler ended after a graceful stop took it over (False; its
        deadline disarmed): a handler that stopped when the stop asked it was charged a
        timeout that came while the stop waited for another job's step."""
        with self._lock:
            if self.decided or self.ended_at_stop:
                self.deadline = None
                return False
            if not self.timed_out:
                self.timed_out, self.timeout_at = True, now
            return True

    def give_back(self) -> bool:
        """Shutdown takes the attempt's outcome to release it: True when it did, False
        when the handler decided first (its outcome is written, not a release). Set
        apart, a handler finishing at the end of the grace period had its completion
        written after the release (refused by the fence), and the job ran again. False
        too once it was released another way (a prefetched attempt withdrawn before it
        began): its slot is freed already."""
        with self._lock:
            if self.decided or self.released:
                return False
            self.decided = self.released = True
            return True

    def begin(self) -> bool:
        """A handler thread takes the attempt up; False if shutdown withdrew it first."""
        with self._lock:
            self.waiting = False
            return not self.released

    def withdraw(self) -> bool:
        """Take back an attempt still waiting for a thread (shutdown); False once begun."""
        with self._lock:
            if not self.waiting or self.decided:
                return False
            self.waiting = False
            self.released = True
            return True

    def interrupt(self, reason: str, loop: asyncio.AbstractEventLoop | None) -> None:
        """Ask the handler to stop: sets ``ctx.cancelled``; cancels an async task; kills
        the child process of a process-pool attempt."""
        if self.stop_reason is None:
            self.stop_reason = reason
        ctx = self.ctx  # (read once: unlink may clear it meanwhile)
        if ctx is not None:
            ctx._request_cancel(reason)
        if self.kill is not None:
            self.kill(JobTimeout(f"timed out after {self.row.timeout or 0:g} s")
                      if reason == "timeout" else Interrupted(reason))  # fmt: skip
        task = self.task
        if task is not None and loop is not None and not task.done():
            loop.call_soon_threadsafe(task.cancel, reason)


def _texts(value: Any) -> list[str]:
    """A sensitive value's text, and every string inside it (a token in a dict)."""
    found, todo = [str(value)], [value]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, list | tuple | set | frozenset):
            todo.extend(item)
    return found


def _secrets(attempt: Attempt) -> list[str]:
    """Every sensitive argument's text: from the stored JSON (there even when it no longer
    validates) and from the decoded values."""
    definition = attempt.definition
    if definition is None or not definition.sensitive:
        return []
    values: list[Any] = []
    try:
        stored = loads_stored(attempt.row.args)
    except (TypeError, ValueError, RecursionError):  # corrupted, or nested past the stack
        stored = None
    for name in definition.sensitive:
        if isinstance(stored, dict) and name in stored:
            values.append(stored[name])
        if attempt.kwargs is not None and name in attempt.kwargs:
            values.append(attempt.kwargs[name])
    return sorted({t for v in values for t in _texts(v) if len(t) >= 3})


def _safe_text(fn: Callable[[], str], fallback: str) -> str:
    """``fn()``, or ``fallback`` when it raises: a handler's exception is user code, and
    its ``__str__`` (or a frame's repr) may raise too; its record must still be written."""
    try:
        return str(fn())
    except Exception as exc:
        return f"{fallback} ({type(exc).__name__} while formatting it)"


def error_entry(attempt: Attempt, exc: BaseException, worker_id: str, kind: str) -> dict[str, Any]:
    """The record of one failed attempt, with sensitive argument values scrubbed, and its
    message and traceback clipped (errands.errortext: scrubbed first, so a cut never
    leaves part of a secret)."""
    type_name = exc.type_name if isinstance(exc, ChildFailure) else type(exc).__qualname__
    secrets = _secrets(attempt)

    def clean(text: str) -> str:
        return scrub(text, secrets)

    if isinstance(exc, ChildFailure):
        trace = clip_trace(clean(exc.trace))  # (its child scrubbed and clipped its parts)
    else:
        trace = _safe_text(lambda: format_trace(exc, clean), "traceback unavailable")
    message = clean(_safe_text(lambda: str(exc), type_name))
    return {
        "attempt": attempt.row.attempt,
        "type": type_name,
        "message": clip(message) or type_name,
        "traceback": trace,
        "worker": worker_id,
        "kind": kind,
        "lease_token": attempt.token,  # which attempt wrote it (errands.landed)
    }


def outcome_for(
    attempt: Attempt,
    exc: BaseException | None,
    result_json: str | None,
    worker_id: str,
    poison_after: int = 3,
) -> FinishParams:
    """Classify an attempt's end (DESIGN §5) into the fenced write that records it, with
    what a fair queue's fold needs: whether the job has a fair key (none: the write skips
    the fold) and the seconds its handler ran (see :func:`handler_seconds`)."""
    return _classify(attempt, exc, result_json, worker_id, poison_after)


def handler_seconds(attempt: Attempt) -> float:
    """What a fair key is charged for the attempt: the seconds its handler's call took,
    without the claim before it or the write after it (nor the decoding of its arguments
    and the encoding of its result). A handler still running when its outcome was decided
    (a timeout, a process-pool child) counts from its start to that moment."""
    if attempt.ran is not None:
        return attempt.ran
    ended = attempt.ended or clock.now()
    return max(ended - attempt.started, 0.0)


def _classify(
    attempt: Attempt,
    exc: BaseException | None,
    result_json: str | None,
    worker_id: str,
    poison_after: int = 3,
) -> FinishParams:
    """Classify an attempt's end (DESIGN §5) into the fenced write that records it.

    A child process that died running the job (an isolated suspect, or the process pool)
    counts like a lost worker toward the poison limit: ``poison_after`` deaths on one job
    (rescues and crashes) make it dead, reason ``poison``.
    """
    row = attempt.row
    # Built once per attempt, with what a fair queue's fold and a workflow's fan-in need
    # (dataclasses.replace on top of it cost a second object and a field walk per job).
    finish = functools.partial(
        FinishParams,
        row.id,
        attempt.token,
        fair=row.fair_key is not None,
        ran=handler_seconds(attempt),
        member=row.workflow_id is not None,
    )
    if exc is None:
        return finish("completed", result_json=result_json)
    if isinstance(exc, Suspended) or (isinstance(exc, ChildFailure) and exc.kind == "suspend"):
        signal = exc.signal if isinstance(exc, Suspended) else str(exc)
        timeout = exc.timeout if isinstance(exc, Suspended) else exc.after
        return finish("waiting", wait_signal=signal, wait_timeout=timeout)
    definition = attempt.definition
    permanent = definition.permanent if definition is not None else ()
    if (
        # ConfigurationError: the handler misused errands (a child job without its required
        # key=, say); the same code fails the same way on every retry. TransactionEnded:
        # its writes were committed outside the completion; a retry would repeat them.
        isinstance(
            exc, InvalidPayload | Permanent | StepError | ConfigurationError | TransactionEnded
        )
        or (permanent and isinstance(exc, permanent))
        or (isinstance(exc, ChildFailure) and exc.kind == "permanent")
    ):
        return finish("dead", error=error_entry(attempt, exc, worker_id, "permanent"))
    if isinstance(exc, Interrupted) and exc.reason == CANCELLED:
        return finish(
            "cancelled",
            error=error_entry(attempt, exc, worker_id, "cancelled"),
        )
    kind = "timeout" if isinstance(exc, JobTimeout) else "transient"
    if isinstance(exc, Interrupted):
        kind = exc.kind
    if isinstance(exc, ChildFailure) and exc.kind == "crash":
        deaths = row.rescues + _crashes(row) + 1
        if deaths >= poison_after:
            exc = ChildFailure(
                exc.type_name, f"poison: worker died {deaths} times on this job; last: {exc}", "",
                "crash",
            )  # fmt: skip
            return finish("dead", error=error_entry(attempt, exc, worker_id, "poison"))
        kind = "crash"
    if isinstance(exc, Retry) or (isinstance(exc, ChildFailure) and exc.kind == "retry"):
        # at most a year, as a backoff's (after=1e12 was stored as year ~33,700, and
        # every listing of the store failed to read it back)
        delay, kind = min(exc.after or 0.0, DELAY_LIMIT), "retry"  # type: ignore[union-attr]
    else:
        policy = definition.backoff if definition is not None else None
        delay = retry_delay(policy, row.attempt, job=row.name)
    state: FinishState = "retryable" if row.attempt < row.max_attempts else "dead"
    return finish(state, error=error_entry(attempt, exc, worker_id, kind), delay=delay)


def _crashes(row: JobRow) -> int:
    """Earlier attempts of this job whose child process died."""
    if '"crash"' not in row.errors:
        return 0
    try:
        return sum(
            1 for e in json.loads(row.errors) if isinstance(e, dict) and e.get("kind") == "crash"
        )
    except (TypeError, ValueError, RecursionError):
        return 0


def context_key(row: JobRow) -> str | None:
    """The key ``ctx.idempotency_key`` is made from, None for the job's id.

    A key enqueued with ``unique_for`` is released when that period ends, and a later
    enqueue may take it for a new job: such a job's idempotency key is built from its id,
    so it never changes between attempts and is never shared with another job. A key
    without ``unique_for`` stays the job's for as long as its row exists.
    """
    return row.idempotency_key if row.unique_until is None else None


def context_for(
    row: JobRow, definition: JobDefinition[Any, Any], worker_id: str, runtime: AttemptRuntime
) -> Context:
    """The ``Context`` a handler receives for this attempt."""
    return Context(
        job_id=row.id,
        name=row.name,
        queue=row.queue,
        attempt=row.attempt,
        max_attempts=row.max_attempts,
        key=context_key(row),
        worker_id=worker_id,
        logger=definition.logger,
        _runtime=runtime,
    )
