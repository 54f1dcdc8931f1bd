"""One attempt of one job: from a claimed row to a fenced outcome.

``Attempt`` holds what the worker knows about a job it runs. An attempt's outcome is
decided exactly once — by the handler returning or raising, by its timeout, or by a
shutdown release — whichever comes first; the losers are ignored.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import traceback as tb
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..backends.base import FinishParams, FinishState
from ..context import Context
from ..errors import ConfigurationError, InvalidPayload, StepError
from ..jobs import JobRow
from ..outcomes import Permanent, Retry
from ..retry import DEFAULT_BACKOFF
from .process_pool import ChildFailure
from .runners import Call

if TYPE_CHECKING:
    from ..definition import JobDefinition
    from .runtime import AttemptRuntime

TRACEBACK_LIMIT = 16_000


class Interrupted(Exception):
    """Raised inside an async handler's task when the worker stops it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class JobTimeout(Exception):
    """The handler ran past its ``timeout``."""


@dataclass(eq=False)
class Attempt:
    row: JobRow
    definition: JobDefinition[Any, Any] | None
    lease_seconds: float
    started: float = field(default_factory=time.monotonic)
    ctx: Context | None = None
    kwargs: dict[str, Any] | None = None
    deadline: float | None = None  # monotonic
    lease_valid_until: float = 0.0  # monotonic: our lease surely holds until then
    future: Future[Any] | Call | None = None  # Call: a sync handler on the thread pool
    task: asyncio.Task[Any] | None = None
    decided: bool = False
    released: bool = False
    ended: float = 0.0  # monotonic time the outcome was decided
    runtime: AttemptRuntime | None = None
    kill: Callable[[BaseException], None] | None = None  # process pool: end the child
    timed_out: bool = False
    timeout_at: float = 0.0  # monotonic time the timeout fired
    interrupted: bool = False
    waiting: bool = False  # prefetched: queued for a handler thread, not begun
    stop_reason: str | None = None  # the first interrupt's reason (kept before a ctx exists)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.lease_valid_until = self.started + self.lease_seconds

    @property
    def id(self) -> int:
        return self.row.id

    @property
    def token(self) -> str:
        return self.row.lease_token or ""

    def decide(self) -> bool:
        """True for the first caller only: it owns this attempt's outcome."""
        with self._lock:
            if self.decided:
                return False
            self.decided = True
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
        if self.ctx is not None:
            self.ctx._request_cancel(reason)
        if self.kill is not None:
            self.kill(JobTimeout(f"timed out after {self.row.timeout or 0:g} s")
                      if reason == "timeout" else Interrupted(reason))  # fmt: skip
        task = self.task
        if task is not None and loop is not None and not task.done():
            loop.call_soon_threadsafe(task.cancel, reason)


def scrub(text: str, secrets: list[str]) -> str:
    for secret in sorted(secrets, key=len, reverse=True):  # longest first: one may hold another
        text = text.replace(secret, "***")
    # PostgreSQL cannot store NUL: an error quoting one would wedge the outcome write
    return text.replace("\x00", "\\x00")


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
        stored = json.loads(attempt.row.args)
    except (TypeError, ValueError, RecursionError):  # corrupted, or nested past the stack
        stored = None
    for name in definition.sensitive:
        if isinstance(stored, dict) and name in stored:
            values.append(stored[name])
        if attempt.kwargs is not None and name in attempt.kwargs:
            values.append(attempt.kwargs[name])
    return sorted({t for v in values for t in _texts(v) if len(t) >= 3})


def error_entry(attempt: Attempt, exc: BaseException, worker_id: str, kind: str) -> dict[str, Any]:
    """The record of one failed attempt, with sensitive argument values scrubbed."""
    trace = exc.trace if isinstance(exc, ChildFailure) else "".join(tb.format_exception(exc))
    if len(trace) > TRACEBACK_LIMIT:
        trace = "...\n" + trace[-TRACEBACK_LIMIT:]
    secrets = _secrets(attempt)
    return {
        "attempt": attempt.row.attempt,
        "type": exc.type_name if isinstance(exc, ChildFailure) else type(exc).__qualname__,
        "message": scrub(str(exc), secrets) or type(exc).__qualname__,
        "traceback": scrub(trace, secrets),
        "worker": worker_id,
        "kind": kind,
    }


def outcome_for(
    attempt: Attempt, exc: BaseException | None, result_json: str | None, worker_id: str
) -> FinishParams:
    """Classify an attempt's end (DESIGN §5) into the fenced write that records it."""
    row = attempt.row
    if exc is None:
        return FinishParams(row.id, attempt.token, "completed", result_json=result_json)
    definition = attempt.definition
    permanent = definition.permanent if definition is not None else ()
    if (
        # ConfigurationError: the handler misused errands (a child job without its required
        # key=, say); the same code fails the same way on every retry.
        isinstance(exc, InvalidPayload | Permanent | StepError | ConfigurationError)
        or (permanent and isinstance(exc, permanent))
        or (isinstance(exc, ChildFailure) and exc.kind == "permanent")
    ):
        return FinishParams(
            row.id, attempt.token, "dead", error=error_entry(attempt, exc, worker_id, "permanent")
        )
    if isinstance(exc, Interrupted) and exc.reason == "cancelled":
        return FinishParams(
            row.id,
            attempt.token,
            "cancelled",
            error=error_entry(attempt, exc, worker_id, "cancelled"),
        )
    kind = "timeout" if isinstance(exc, JobTimeout) else "transient"
    if isinstance(exc, Retry) or (isinstance(exc, ChildFailure) and exc.kind == "retry"):
        delay, kind = exc.after, "retry"  # type: ignore[union-attr]
    else:
        backoff = definition.backoff if definition is not None else DEFAULT_BACKOFF
        delay = backoff.delay(row.attempt)
    state: FinishState = "retryable" if row.attempt < row.max_attempts else "dead"
    return FinishParams(
        row.id, attempt.token, state, error=error_entry(attempt, exc, worker_id, kind), delay=delay
    )
