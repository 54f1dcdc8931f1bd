"""What a handler's Context can do beyond reading: durable steps, the completion
transaction and child jobs (DESIGN §3, effectively-once effects).

- ``ctx.step(name, fn, ...)``: the first run stores fn's JSON result under (job, name) as
  soon as fn returns; every later run of the job (retry, rescue, replay) gets the stored
  result back without calling fn. Two runs racing on one step (a stale attempt) keep the
  first stored result and both return it.
- ``ctx.transaction()``: a connection inside the very transaction that will complete the
  job; the handler's writes commit with the completion, or are rolled back with it.
- ``ctx.enqueue(job, ...)``: children are validated now and inserted in the transaction
  that completes this job; a failed, timed-out or rescued attempt inserts none.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from pydantic_core import PydanticSerializationError, to_json

from ..errors import ConfigurationError, StepError
from ..faults import fault_point
from ..jobs import EnqueueRequest
from ..payload import NUL_FIX, holds_nul

if TYPE_CHECKING:
    from ..app import App
    from ..definition import BoundJob, JobDefinition
    from .execution import Attempt

log = logging.getLogger("errands.worker")


class AttemptRuntime:
    def __init__(self, app: App, attempt: Attempt) -> None:
        self.app = app
        self.attempt = attempt
        self.tx: Any = None
        self.children: list[EnqueueRequest] = []
        self._steps: dict[str, Any] | None = None
        self._used: set[str] = set()
        self._lock = threading.Lock()

    # -- steps -----------------------------------------------------------------------------
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
                self._steps = {
                    s.name: s.result for s in self.app.backend.step_list(self.attempt.id)
                }
            if name in self._steps:
                return True, self._steps[name]
        return False, None

    def _store_step(self, name: str, value: Any) -> Any:
        try:
            encoded = to_json(value).decode("utf-8")
        except (PydanticSerializationError, ValueError, TypeError) as exc:
            raise StepError(
                f"step {name!r} of job {self.attempt.id} returned a {type(value).__name__}, "
                f"which cannot be stored as JSON ({exc}); return JSON-friendly data (dicts, "
                "lists, numbers, strings, pydantic models, dataclasses)"
            ) from None
        if holds_nul(encoded):
            raise StepError(
                f"step {name!r} of job {self.attempt.id} returned text holding the NUL "
                f"character (\\x00), which PostgreSQL cannot store; {NUL_FIX}"
            )
        stored = self.app.backend.step_store(
            self.attempt.id, name, encoded, self.attempt.row.attempt, conn=self.tx
        )
        result = json.loads(stored)
        if stored != encoded and result != json.loads(encoded):
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
            job_id=self.attempt.id,
            job=self.attempt.row.name,
            attempt=self.attempt.row.attempt,
            step=name,
        )
        return result

    def step(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        done, value = self._begin_step(name)
        if done:
            return value
        return self._store_step(name, fn(*args, **kwargs))

    async def astep(
        self, name: str, fn: Callable[..., Awaitable[Any] | Any], *args: Any, **kwargs: Any
    ) -> Any:
        done, value = await asyncio.to_thread(self._begin_step, name)
        if done:
            return value
        result = fn(*args, **kwargs)
        if asyncio.iscoroutine(result) or isinstance(result, Awaitable):
            result = await result
        return await asyncio.to_thread(self._store_step, name, result)

    # -- the completion transaction ----------------------------------------------------------
    def transaction(self) -> TransactionConnection:
        with self._lock:
            if self.tx is None:
                self.tx = self.app.backend.tx_begin()
            return TransactionConnection(self.tx)

    def rollback(self) -> None:
        with self._lock:
            tx, self.tx = self.tx, None
        if tx is not None:
            try:
                self.app.backend.tx_rollback(tx)
            except Exception:
                log.exception("could not roll back the transaction of job %s", self.attempt.id)

    # -- children ------------------------------------------------------------------------------
    def enqueue(
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
    ) -> None:
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
        request.parent_id = self.attempt.id
        with self._lock:
            self.children.append(request)


class TransactionConnection:
    """The handler's view of the completion transaction: the driver connection, minus the
    calls that would end the transaction early (errands commits it with the job)."""

    __slots__ = ("_conn",)

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def __getattr__(self, name: str) -> Any:
        if name in ("commit", "rollback", "close", "autocommit", "set_autocommit"):
            raise StepError(
                f"ctx.transaction() connection: {name}() is not allowed; the transaction "
                "commits together with the job's completion (raise to roll it back)"
            )
        return getattr(self._conn, name)

    def __enter__(self) -> TransactionConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        return None  # the job's completion commits it; an exception rolls it back

    @property
    def raw(self) -> Any:
        """The underlying sqlite3 or psycopg connection (do not commit it yourself)."""
        return self._conn
