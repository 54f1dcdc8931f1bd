"""``errands.Context``: what a running handler knows about its own job.

A handler asks for it by annotating a parameter with it::

    @app.job()
    def charge(ctx: errands.Context, order_id: int) -> None:
        ctx.logger.info("charging order %s (attempt %s)", order_id, ctx.attempt)
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from . import offloop
from .errors import ConfigurationError, JobNotFound
from .forking import fresh_lock_at_fork

if TYPE_CHECKING:
    from .worker.runtime import AsyncTransaction, AttemptRuntime, TransactionConnection
    from .workflows import Member, ParentResults, WorkflowStatus

_CANCEL_LOCK = threading.Lock()
fresh_lock_at_fork(globals(), "_CANCEL_LOCK")  # a new one in a forked child


def _on_a_loop() -> bool:
    """Whether the caller runs on an event loop (else: a thread of its own)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@dataclass
class Context:
    job_id: int
    name: str
    queue: str
    attempt: int
    max_attempts: int
    key: str | None
    worker_id: str
    logger: logging.Logger
    _cancel: threading.Event | None = field(default=None, repr=False)  # made on first cancel
    _reason: str = field(default="", repr=False)
    _runtime: AttemptRuntime | None = field(default=None, repr=False)

    def _rt(self) -> AttemptRuntime:
        if self._runtime is None:
            raise RuntimeError("this Context is not attached to a running job")
        return self._runtime

    def step(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` once per job: its JSON result is stored under
        ``name`` as soon as it returns, and every later run of this job (retry, rescue,
        replay) gets the stored result back without calling ``fn`` again.

        The value returned is always the stored JSON form (dicts, lists, numbers,
        strings), the same on the first run and on replays. In an ``async def`` handler,
        ``await ctx.astep(...)``.
        """
        self._not_on_the_loop("ctx.step()", "await ctx.astep()", "reads and writes the store")
        return self._rt().step(name, fn, *args, **kwargs)

    async def astep(
        self, name: str, fn: Callable[..., Awaitable[Any] | Any], *args: Any, **kwargs: Any
    ) -> Any:
        """``ctx.step`` for async handlers: ``fn`` may be a coroutine function.

        Run steps side by side in an ``asyncio.TaskGroup``, not ``asyncio.gather``: a
        step left running when the handler ends holds the attempt until it is over
        (cancelled ``abandon_after`` later), so its retry never runs beside it."""
        return await self._rt().astep(name, fn, *args, **kwargs)

    def wait_for_signal(self, name: str, timeout: float | timedelta | None = None) -> Any:
        """The payload of signal ``name`` sent to this job with ``app.signal``.

        When it has not arrived yet, the job is *suspended*: this run ends here (the
        handler unwinds; ``finally`` blocks run), the job goes to state ``waiting``
        holding no lease and no worker slot, and the attempt is not charged. When the
        signal arrives, the job runs again from the top: steps return their stored
        results and this call returns the payload (stored as step ``signal:<name>``, so
        every later run gets the same one). A signal sent before the wait is kept and
        returned at once. Past ``timeout`` (seconds or a timedelta; None: no limit) the
        wait is a failed attempt (kind ``signal_timeout``): retried with backoff, then
        dead. In an ``async def`` handler, ``await`` it; called from a thread of its own
        (``asyncio.to_thread``), it waits there as in a sync handler.

        .. versionadded:: 0.2
        """
        runtime = self._rt()
        definition = runtime.attempt.definition
        if definition is not None and definition.is_async and _on_a_loop():
            return runtime.await_signal(name, timeout)
        # A sync handler, or a sync helper of an async one on a thread: an awaitable
        # handed there was never awaited, and, truthy, read as the payload: the job went
        # on without the signal. Suspended travels out through asyncio.to_thread.
        return runtime.wait_for_signal(name, timeout)

    def progress(self, fraction: float, message: str = "") -> None:
        """Report how far this run is: ``fraction`` from 0.0 to 1.0, and a short message.

        Kept in memory and stored with the worker's next heartbeat (no write of its own,
        however often it is called); ``handle.progress()``, ``errands jobs show`` and the
        dashboard show the latest, and the ``errands.job.progress`` event announces it.
        A new attempt starts with none.

        .. versionadded:: 0.2
        """
        self._rt().progress(fraction, message)

    def transaction(self) -> TransactionConnection:
        """A connection inside the transaction that will also complete this job.

        Writes made through it commit together with the completion, or roll back with a
        failure, timeout or lost lease. On SQLite it holds the database's write lock until
        the handler returns: open it late and keep the rest of the handler short. In an
        ``async def`` handler, ``await ctx.atransaction()``.

        .. versionchanged:: 0.2 In an ``async def`` handler, on its event loop, it raises
           ``ConfigurationError`` (it ran there, and its opening and statements waited
           for locks on the loop every async job of the worker shares).
        """
        self._not_on_the_loop(
            "ctx.transaction()",
            "`tx = await ctx.atransaction()` and `await tx.execute(...)`",
            "opens a transaction of the store (waiting for SQLite's write lock or a pool "
            "connection) and returns a connection whose statements block (a row lock)",
        )
        return self._rt().transaction()

    async def atransaction(self) -> AsyncTransaction:
        """:meth:`transaction` for async handlers: the same transaction, committed with
        this job's completion or rolled back with its failure, opened on a thread of its
        own (waiting there for SQLite's write lock or a pool connection), whose statements
        are awaited and run on that thread: ``await tx.execute(...)``, ``await
        cur.fetchall()``. The event loop, and every async job of the worker on it, runs on
        meanwhile. Called again in one run, it returns the same transaction.

        .. versionadded:: 0.2
        """
        return await self._rt().atransaction()

    def enqueue(self, job: Any, *args: Any, **options: Any) -> None:
        """Enqueue a child job, inserted with this job's completion (never on a failed or
        rescued attempt). Takes the same arguments as ``job.enqueue``, or a ``job.bind()``.
        In an ``async def`` handler, ``await ctx.aenqueue(...)``."""
        self._not_on_the_loop(
            "ctx.enqueue()",
            "await ctx.aenqueue()",
            "runs the app's before_insert hooks, user code that may block",
        )
        self._rt().enqueue(job, *args, **options)

    async def aenqueue(self, job: Any, *args: Any, **options: Any) -> None:
        """:meth:`enqueue` for async handlers: the arguments are checked at the call (an
        ``InvalidPayload`` is raised there), and the app's ``before_insert`` hooks, user
        code that may block, run in a worker thread when any is installed, so the event
        loop (every async job of the worker) runs on meanwhile.

        .. versionadded:: 0.2
        """
        await self._rt().aenqueue(job, *args, **options)

    # -- workflows (docs/workflows.md) ---------------------------------------------------
    @property
    def workflow_id(self) -> int | None:
        """The workflow this job is a member of (or, for a callback, fired by); None for
        a job outside workflows."""
        return self._rt().workflow_id()

    def workflow(self) -> WorkflowStatus:
        """The status of this job's workflow: counts by outcome, and for a callback such
        as ``on_settled``, the final ones. ``ctx.workflow_members()`` lists the members.
        In an ``async def`` handler, ``await ctx.aworkflow()``."""
        self._not_on_the_loop("ctx.workflow()", "await ctx.aworkflow()")
        workflow_id = self._workflow_required("ctx.workflow()")
        with self._workflow_gone(workflow_id):
            return self._rt().app.workflow_status(workflow_id)

    async def aworkflow(self) -> WorkflowStatus:
        """:meth:`workflow` for async handlers: read in a worker thread, so the event loop
        (every async job of the worker) runs on meanwhile.

        .. versionadded:: 0.2
        """
        workflow_id = self._workflow_required("ctx.aworkflow()")
        with self._workflow_gone(workflow_id):
            return await offloop.run(self._rt().app.workflow_status, workflow_id)

    def workflow_members(self) -> list[Member]:
        """Every member of this job's workflow with its node, state and outcome (the
        failed ones of a batch are those whose ``outcome`` is ``dead`` or ``cancelled``).
        In an ``async def`` handler, ``await ctx.aworkflow_members()``."""
        self._not_on_the_loop("ctx.workflow_members()", "await ctx.aworkflow_members()")
        workflow_id = self._workflow_required("ctx.workflow_members()")
        with self._workflow_gone(workflow_id):
            return self._rt().app.workflow_members(workflow_id)

    async def aworkflow_members(self) -> list[Member]:
        """:meth:`workflow_members` for async handlers (read in a worker thread).

        .. versionadded:: 0.2
        """
        workflow_id = self._workflow_required("ctx.aworkflow_members()")
        with self._workflow_gone(workflow_id):
            return await offloop.run(self._rt().app.workflow_members, workflow_id)

    def parent_results(
        self, *, after: int = 0, limit: int = 100, max_bytes: int = 1_000_000
    ) -> ParentResults:
        """The results of the parents this member ran after, a page at a time: up to
        ``limit`` parents with ids above ``after``, and at most ``max_bytes`` of results
        (a result that would pass it is left out, marked ``truncated``; read it with
        ``app.get_job``). ``page.next_after`` is the ``after=`` of the next page. In an
        ``async def`` handler, ``await ctx.aparent_results()``."""
        self._not_on_the_loop("ctx.parent_results()", "await ctx.aparent_results()")
        return self._rt().parent_results(after, limit, max_bytes)

    async def aparent_results(
        self, *, after: int = 0, limit: int = 100, max_bytes: int = 1_000_000
    ) -> ParentResults:
        """:meth:`parent_results` for async handlers (read in a worker thread).

        .. versionadded:: 0.2
        """
        return await offloop.run(self._rt().parent_results, after, limit, max_bytes)

    def _not_on_the_loop(
        self, what: str, instead: str, does: str = "reads the store and blocks"
    ) -> None:
        """Raise ConfigurationError when an ``async def`` handler calls ``what``, which
        ``does`` something that may block (a read of the store, user code), on the event
        loop it runs on: the worker's one loop, whose every async job stalled meanwhile (a
        locked row, a pool with no connection free, a slow before_insert hook)."""
        definition = self._rt().attempt.definition
        if definition is None or not definition.is_async:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # a thread of its own (asyncio.to_thread): it may block
            return
        raise ConfigurationError(
            f"{what} {does}; job {self.job_id} ({self.name}) is an "
            f"async def handler, on the event loop that runs every async job of the "
            f"worker, which it would stall meanwhile: use {instead} instead"
        )

    def add_to_workflow(self, job: Any) -> None:
        """Add a member (a ``job.bind(...)``) to this job's own workflow, inserted with
        this job's completion and before it leaves the workflow's pending set: the
        workflow cannot settle in between, and a failed attempt adds nothing. In an
        ``async def`` handler, ``await ctx.aadd_to_workflow(...)``."""
        self._not_on_the_loop(
            "ctx.add_to_workflow()",
            "await ctx.aadd_to_workflow()",
            "runs the app's before_insert hooks, user code that may block",
        )
        self._workflow_required("ctx.add_to_workflow()")
        self._rt().add_to_workflow(job)

    async def aadd_to_workflow(self, job: Any) -> None:
        """:meth:`add_to_workflow` for async handlers: the app's ``before_insert`` hooks
        run in a worker thread when any is installed, so the event loop (every async job
        of the worker) runs on meanwhile.

        .. versionadded:: 0.2
        """
        self._workflow_required("ctx.aadd_to_workflow()")
        await self._rt().aadd_to_workflow(job)

    @contextmanager
    def _workflow_gone(self, workflow_id: int) -> Iterator[None]:
        """A read of this job's workflow that finds none says why it can be gone: the
        message was only "no workflow with id N" (a member replayed from the dead-letter
        queue after its workflow was pruned)."""
        try:
            yield
        except JobNotFound as exc:
            raise JobNotFound(
                f"job {self.job_id} ({self.name}): its workflow {workflow_id} is gone: a "
                "settled workflow is pruned after the App's retention, and a member "
                "replayed from the dead-letter queue after that runs on its own, without "
                "it (read ctx.workflow_id before relying on the workflow, or discard the "
                "job instead of replaying it)"
            ) from exc

    def _workflow_required(self, what: str) -> int:
        workflow_id = self.workflow_id
        if workflow_id is None:
            raise ConfigurationError(
                f"{what}: job {self.job_id} ({self.name}) is not in a workflow; enqueue it "
                "with app.enqueue_workflow"
            )
        return workflow_id

    @property
    def idempotency_key(self) -> str:
        """``"<job name>:<key or id>"``: the same on every attempt, rescue and replay.

        Pass it to external APIs that accept idempotency keys (payment providers,
        webhook receivers), so a retried attempt cannot charge twice.
        """
        return f"{self.name}:{self.key if self.key is not None else self.job_id}"

    @property
    def cancelled(self) -> bool:
        """True once the job should stop: cancelled, timed out, lease lost or shutdown.

        Long-running sync handlers should check it between units of work; async handlers
        are cancelled with ``asyncio.CancelledError`` instead.
        """
        cancel = self._cancel
        return cancel is not None and cancel.is_set()

    @property
    def cancel_reason(self) -> str:
        return self._reason

    @property
    def is_last_attempt(self) -> bool:
        return self.attempt >= self.max_attempts

    def _request_cancel(self, reason: str) -> None:
        with _CANCEL_LOCK:
            if self._cancel is None:
                self._cancel = threading.Event()
            if self._cancel.is_set():
                return
            self._reason = reason
            self._cancel.set()
