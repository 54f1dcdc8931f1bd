"""Running an attempt: where its handler runs, and everything user code does around it.

The claim loop only hands attempts over (:meth:`Dispatcher.dispatch`); it never runs user
code itself. Decoding the payload (the model's validators), building the Context, the
handler, and encoding its result (the result's serializers) all run where the handler
runs: a handler thread for a sync handler, the event loop (decoding in a thread) for an
``async def``, a handler thread waiting on a child process for the process pool and for
isolated suspects. So a validator or serializer that hangs holds up one attempt, which
its timeout stops, never the claim loop.

Payload decoding that fails in any way is an invalid payload (dead at once, no retry);
so is a result that cannot be encoded: the handler's work is done, a retry would repeat
its effects.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import logging
import os
import sys
import threading
from collections import Counter
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from .. import clock, offloop
from ..errors import InvalidPayload, UnknownJob
from ..interrupts import shielded
from ..jobs import JobRow
from ..observability.logcontext import JobLogContext, job_context, job_extra, lockless_line
from ..payload import mask
from .execution import (
    LEASE_LOST,
    LEASE_UNRENEWED,
    Attempt,
    HandlerCancelled,
    Interrupted,
    JobTimeout,
    context_for,
)
from .process_pool import ChildStartFailed, ProcessRunner
from .recorder import job_fields
from .runners import HandlerSlots
from .runtime import AttemptRuntime

if TYPE_CHECKING:
    from ..definition import JobDefinition
    from .worker import Worker

log = logging.getLogger("errands.worker")
# An async attempt dispatched, its task not made yet: (attempt, definition, the (queue, fair
# key) it waits under, urgent); see Dispatcher.start_dispatched
_Start = tuple["Attempt", "JobDefinition[Any, Any]", "tuple[str, str] | None", bool]
# An async job's stored arguments up to this size (characters of JSON) whose decoding runs
# no code of the application's are decoded on its event loop (~10 us for a few fields)
INLINE_DECODE_MAX = 65_536


class Dispatcher:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        # The order prefetched jobs wait in for a handler thread (see _goes_first): the
        # jobs waiting in arrival order, by queue, and a prefetching fair queue's waiting
        # jobs by (queue, fair key); how many went ahead since a job in arrival order began.
        self._waiting_queues: Counter[str] = Counter()
        self._waiting_keys: Counter[tuple[str, str]] = Counter()
        self._went_ahead = 0
        self._order_lock = threading.Lock()
        # The handlers' slots: the async ones', and in a worker with both kinds of handler
        # (shares_slots) the sync ones' too (see HandlerSlots)
        self.slots = HandlerSlots(worker.concurrency)
        self.shares_slots = worker.shares_slots
        self._starts: list[_Start] = []  # see start_dispatched

    def _goes_first(self, row: JobRow) -> tuple[tuple[str, str] | None, bool]:
        """Where a job waits for a handler thread (for a slot of the loop, an async
        handler's): the (queue, fair key) it is counted under (None: not a prefetching
        fair queue's) and whether it goes ahead of the jobs waiting (dispatched urgent); a
        job that does not is counted as waiting in arrival order.

        The claim ranks a fair queue's keys fairly, but prefetched jobs wait for a thread
        in arrival order: a quiet tenant's job claimed behind a noisy tenant's prefetched
        ones waited for all of them (issue 19: its dwell p99 was 10x an idle queue's on
        SQLite). So a job whose key has none waiting here goes first, and the next of the
        same key waits its turn behind the others. Bounded: only ahead of its own queue's
        jobs (never ahead of another queue's), and at most ``concurrency`` jobs go ahead
        before the oldest job waiting in arrival order begins."""
        urgent = row.rescues > 0  # rescued jobs start at the next free slot (I9)
        prefetching = self.worker.claimer.prefetching
        if not prefetching:  # no fair queue reorders here: arrival order, nothing counted
            return None, urgent
        key = None
        if row.fair_key is not None and row.queue in prefetching:
            key = (row.queue, row.fair_key)
        with self._order_lock:
            if key is not None:
                alone = key not in self._waiting_keys
                self._waiting_keys[key] += 1
                waiting = self._waiting_queues.total()
                if (
                    alone
                    and not urgent
                    and waiting == self._waiting_queues[row.queue]
                    and (not waiting or self._went_ahead < self.worker.concurrency)
                ):
                    urgent = True
                    self._went_ahead += waiting > 0  # it passed jobs waiting in order
            if not urgent:
                self._waiting_queues[row.queue] += 1
        return key, urgent

    def _begins(self, queue: str, key: tuple[str, str] | None, urgent: bool) -> None:
        """A handler thread takes up a job counted by _goes_first."""
        if not self.worker.claimer.prefetching:
            return
        with self._order_lock:
            if key is not None:
                self._waiting_keys[key] -= 1
                if self._waiting_keys[key] <= 0:
                    del self._waiting_keys[key]
            if not urgent:
                self._went_ahead = 0
                self._waiting_queues[queue] -= 1
                if self._waiting_queues[queue] <= 0:
                    del self._waiting_queues[queue]

    def dispatch(self, attempt: Attempt) -> None:
        """Start ``attempt`` where its handler runs (called on the claim loop's thread)."""
        worker = self.worker
        row, definition = attempt.row, attempt.definition
        if definition is None:
            known = ", ".join(sorted(worker.app.registry)) or "none"
            error = UnknownJob(
                f"no handler registered for job {row.name!r} in this worker; it knows: {known}. "
                "Deploy the code that defines it (a newer worker may know it)"
            )
            worker.recorder.decided(attempt, error, None)
            return
        children = worker.child_runner_for(attempt)
        if children is not None:  # a thread waits for the child: the lane's, on the lane
            attempt.waiting = True
            worker.threads_for(attempt).submit(
                lambda: self._run_in_child(attempt, children),
                functools.partial(self._thread_returned, attempt),
                urgent=True,
                made=functools.partial(setattr, attempt, "future"),
            )
            return
        if not definition.is_async:
            # A sync handler: the thread that runs it also prepares it (payload, Context),
            # while the claim loop is already waiting on the next claim.
            key, urgent = self._goes_first(row)

            def run() -> Any:
                if self.shares_slots and not attempt.express:
                    self._wait_for_slot(attempt, urgent)  # prefetched: waits here, in order
                self._begins(row.queue, key, urgent)
                return self._run_in_thread(attempt, definition)  # (its slot: _thread_returned)

            attempt.waiting = True
            worker.threads_for(attempt).submit(
                run,
                functools.partial(self._thread_returned, attempt),
                urgent=urgent,
                made=functools.partial(setattr, attempt, "future"),
            )
            return
        # An async handler: its task waits on the loop for a slot (prefetched), in the
        # order a thread would take it.
        worker.loop_runner_started()
        key, urgent = self._goes_first(row)
        attempt.waiting = True
        self._starts.append((attempt, definition, key, urgent))

    def start_dispatched(self) -> None:
        """Hand the async attempts dispatched since the last call to the event loop, all
        in one wake-up of the loop (one a job cost a no-op async job half its time).
        Called on the claim loop's thread after each claim's dispatch."""
        starts, self._starts = self._starts, []
        if not starts:
            return
        loop = self.worker.loop
        try:
            if loop is None:
                raise RuntimeError("the worker's event loop is not running")
            loop.call_soon_threadsafe(self._start_each, starts)
        except Exception as exc:  # the loop closed (a stop): never lose a claimed job
            for start in starts:
                self._not_begun(*start, exc)

    def _start_each(self, starts: list[_Start]) -> None:
        for start in starts:
            try:
                self._start_async(*start)
            except Exception as exc:  # never lose a claimed job (nor the rest of the batch)
                self._not_begun(*start, exc)

    def _start_async(
        self,
        attempt: Attempt,
        definition: JobDefinition[Any, Any],
        key: tuple[str, str] | None,
        urgent: bool,
    ) -> None:
        """On the loop: the attempt's task, its outcome recorded as it ends."""
        task = asyncio.get_running_loop().create_task(
            self._run_async(attempt, definition, key, urgent)
        )
        attempt.future = task
        task.add_done_callback(lambda f: self._async_done(attempt, f))

    def _not_begun(
        self,
        attempt: Attempt,
        definition: JobDefinition[Any, Any],
        key: tuple[str, str] | None,
        urgent: bool,
        exc: Exception,
    ) -> None:
        """An async attempt whose task could not be started: it never ran, so its job is
        given back uncharged (prefetched: nothing recorded on it), its slot freed."""
        log.error(
            "job %s: could not start it (%s: %s); giving it back",
            attempt.id,
            type(exc).__name__,
            exc,
            extra=job_extra(attempt.row),
        )
        self._begins(attempt.row.queue, key, urgent)
        if attempt.give_back():  # (else a stop or the fence took it: they release it)
            self.worker.slot_freed(attempt)
            self.worker.release_in_background(
                [attempt], "released %d job(s) that could not start", prefetched=True
            )

    # -- preparing ---------------------------------------------------------------------------
    def prepare(self, attempt: Attempt) -> tuple[dict[str, Any], JobLogContext] | None:
        """Decode the payload and build the Context; None when that decided the outcome
        (an invalid payload). Runs user code (validators): never on the claim loop."""
        worker = self.worker
        row, definition = attempt.row, attempt.definition
        assert definition is not None
        try:
            attempt.kwargs = definition.payload.decode(row.args)
        except Exception as exc:  # any failure to decode the stored payload is permanent
            if not isinstance(exc, InvalidPayload):
                invalid = InvalidPayload(
                    f"{row.name}: decoding the stored arguments failed: {type(exc).__name__}: {exc}"
                )
                invalid.__cause__ = exc
                exc = invalid
            worker.recorder.decided(attempt, exc, None)
            return None
        kwargs = dict(attempt.kwargs)
        if definition.payload.context_param:
            # A handler without a Context parameter gets none: nothing could reach it
            # (steps, children, ctx.transaction, progress all go through it), and it cost
            # 2.4 us a job. Its stop is read from attempt.stop_reason alone (an async one's
            # task is cancelled as well).
            attempt.runtime = AttemptRuntime(worker.app, attempt)
            attempt.ctx = context_for(row, definition, worker.id, attempt.runtime)
            if attempt.stop_reason is not None:  # an interrupt that came before its ctx did
                attempt.ctx._request_cancel(attempt.stop_reason)
            kwargs[definition.payload.context_param] = attempt.ctx
        events = worker.app.events
        if events.wants("errands.job.started"):
            # On the handler's thread: its subscribers on the events lane (a slow one held
            # the job's start, a hung one its slot for good), errands' own inline. Shielded:
            # an interrupt landing inside the lane's queue left its lock held (the lane,
            # then the completer emitting to it, blocked for good).
            with shielded():
                events.emit_later(
                    "errands.job.started",
                    **job_fields(row),
                    args=_args_for_started(events, attempt.kwargs, definition.sensitive),
                    queue_wait=max((row.attempted_at or row.run_at) - row.run_at, 0.0),
                    meta=row.meta,
                )
        return kwargs, JobLogContext(row.id, row.name, row.queue, row.attempt)

    def _begin(self, attempt: Attempt) -> bool:
        """A handler thread takes a queued attempt up: False when it must not run (withdrawn
        at shutdown, or its lease may have run out while it waited: handed back)."""
        worker = self.worker
        if not attempt.begin():
            return False  # withdrawn at shutdown before it began: released
        if attempt.stop_reason in (LEASE_LOST, LEASE_UNRENEWED):
            # Its lease lost, or not renewed (self-fenced), while it waited: it never ran,
            # so it is handed back uncharged (fenced by its token), as below. Raised as
            # Interrupted, a job prefetched before a short heartbeat outage was charged,
            # and dead with retries=0.
            if attempt.give_back():  # (else a graceful stop took it first: it releases it)
                reason = attempt.stop_reason.replace("%", "%%")
                message = f"released %d prefetched job(s): {reason}"
                _release(worker, attempt, message, prefetched=True)
            return False
        if attempt.stop_reason is not None:  # an operator's cancel while it waited
            raise Interrupted(attempt.stop_reason)
        began = clock.now()
        if began >= attempt.lease_valid_until:
            # No heartbeat confirmed its lease for a whole lease (this process was frozen,
            # or the store unreachable): another worker may run it by now. Hand the lease
            # back (fenced) instead of running it beside that one: through give_back, so
            # a stop taking it up in the same instant does not release it a second time.
            if attempt.give_back():
                message = "released %d prefetched job(s) whose lease may have run out"
                _release(worker, attempt, message, prefetched=True)
            return False
        attempt.started = began
        return True

    # -- the three places a handler runs ----------------------------------------------------
    def _run_in_thread(self, attempt: Attempt, definition: JobDefinition[Any, Any]) -> Any:
        """A sync handler's attempt, in a handler thread, from its start to its encoded
        result."""
        if not self._begin(attempt):
            return None
        worker = self.worker
        began = attempt.started
        timeout = attempt.row.timeout
        if timeout:  # from the start: decoding the payload and job.started's subscribers too
            attempt.deadline = began + timeout
            with shielded():  # the keeper's wake-up: a lock an interrupt must not strand
                worker.leases.poke()
        prepared = self.prepare(attempt)
        if prepared is None:
            return None  # decided already; the outcome handed back is ignored
        kwargs, log_ctx = prepared
        if attempt.stop_reason is not None:  # interrupted while it was being prepared
            raise Interrupted(attempt.stop_reason)
        events = worker.app.events
        called = clock.now()
        pid = os.getpid()
        try:
            with job_context(log_ctx):
                try:
                    if not events.wrappers:  # the common case: nothing to wrap it in
                        result = definition.fn(**kwargs)
                    else:
                        info = {**job_fields(attempt.row), "meta": attempt.row.meta}
                        with events.around_handler(info):
                            result = definition.fn(**kwargs)
                finally:
                    leave_if_forked(pid, attempt.id)
                    attempt.ran = clock.now() - called
                return encode(definition, result)
        finally:
            worker.ran_for(clock.now() - began)

    async def _run_async(
        self,
        attempt: Attempt,
        definition: JobDefinition[Any, Any],
        key: tuple[str, str] | None = None,
        urgent: bool = False,
    ) -> Any:
        attempt.task = task = asyncio.current_task()
        if task is not None:  # named for the loop's watchdog (errands.worker.runners)
            task.set_name(f"job {attempt.id} {attempt.row.name}")
        try:
            if not attempt.express:  # (the express lane's jobs have slots of their own)
                attempt.holds_slot = await self.slots.take(urgent)  # prefetched: waits here
        except asyncio.CancelledError:
            if attempt.stop_reason is None and not attempt.released:
                raise  # the loop shutting down
            # Stopped while it waited (an operator's cancel, a lease lost or not renewed, a
            # stop that withdrew it): it never began; as _begin decides below.
            if task is not None:
                task.uncancel()
        finally:
            self._begins(attempt.row.queue, key, urgent)
        # A failure's traceback holds this frame: the task's own exception would hold the
        # task through it, a cycle for the garbage collector for each failed job.
        task = None
        try:
            if not await self._begin_async(attempt):
                return None
            return await self._run_begun(attempt, definition)
        finally:
            self.give_slot(attempt)

    def give_slot(self, attempt: Attempt) -> None:
        """An attempt's handler ended, or was abandoned (it may run on, its outcome
        recorded): its slot, if it holds one, to the next job. From any thread (the
        handler's, the loop's, the lease keeper abandoning it); once an attempt. (The
        flag read first without the lock: every plain job of a worker of one kind comes
        here holding none, and takes no lock for it.)"""
        if attempt.holds_slot and attempt.drop_slot():
            self.slots.give()

    def open_slots(self) -> None:
        """A stop withdrew the jobs waiting for a slot: their waits end (none begins)."""
        self.slots.open()

    async def _begin_async(self, attempt: Attempt) -> bool:
        """:meth:`_begin` for an async attempt, on the loop: False when it must not run."""
        worker = self.worker
        if not attempt.begin():
            return False  # withdrawn (a stop, a lease not renewed) before it began: released
        lease = attempt.stop_reason in (LEASE_LOST, LEASE_UNRENEWED)
        if not lease and attempt.stop_reason is not None:  # an operator's cancel meanwhile
            raise Interrupted(attempt.stop_reason)
        if lease or clock.now() >= attempt.lease_valid_until:
            # Its lease lost or not renewed while it waited, or no heartbeat confirmed it
            # for a whole lease (a claim reply held up, a loop blocked by another handler,
            # a frozen process): another worker may run it now. Handed back, uncharged
            # (its handler never began, so nothing is recorded on the job), unless a
            # graceful stop took it over first (the stop gives it back).
            if attempt.give_back():
                if lease:
                    reason = (attempt.stop_reason or "").replace("%", "%%")
                    message = f"released %d prefetched job(s): {reason}"
                else:
                    message = "released %d prefetched job(s) whose lease may have run out"
                await offloop.run(_release, worker, attempt, message, prefetched=True)
            return False
        return True

    async def _run_begun(self, attempt: Attempt, definition: JobDefinition[Any, Any]) -> Any:
        attempt.started = clock.now()
        timeout = attempt.row.timeout
        # The job's timeout runs from its start: decoding the payload and job.started's
        # subscribers (in a thread: off the loop), the handler, encoding its result.
        limit = asyncio.timeout(timeout) if timeout else None
        if timeout:  # the lease keeper's too: ctx.cancelled, and a task that goes on abandoned
            attempt.deadline = attempt.started + timeout
            self.worker.leases.poke()
        try:
            async with limit or contextlib.nullcontext():
                result = await self._call_async(attempt, definition)
        except TimeoutError:
            if attempt.stop_reason is not None:
                raise Interrupted(attempt.stop_reason) from None
            if limit is not None and limit.expired():
                raise JobTimeout(f"timed out after {timeout:g} s") from None
            raise  # the handler's own (an inner wait_for, a socket): a failure as any
        except asyncio.CancelledError:
            if attempt.stop_reason is not None:  # the worker stopped it: why
                raise Interrupted(attempt.stop_reason) from None
            raise  # the loop shutting down
        except (JobTimeout, Interrupted):
            raise
        except Exception as exc:
            self._raise_if_stopped(attempt, limit, exc)
            raise
        else:
            self._raise_if_stopped(attempt, limit, None)
            return result
        finally:
            self.worker.ran_for(clock.now() - attempt.started)  # (the prefetch reads it)
            # Steps the handler left running on tasks of their own (asyncio.gather does
            # not cancel the siblings of one that raised) end before the attempt is
            # decided: its retry read the steps before theirs were stored, and ran their
            # effects again beside them.
            runtime = attempt.runtime
            in_flight = runtime.close() if runtime is not None else None
            if runtime is not None and in_flight:
                expired = limit is not None and limit.expired()
                await runtime.settle_steps(
                    in_flight,
                    self.worker.abandon_after,
                    lambda: expired or attempt.timed_out or attempt.stop_reason is not None,
                )

    @staticmethod
    def _raise_if_stopped(
        attempt: Attempt, limit: asyncio.Timeout | None, exc: Exception | None
    ) -> None:
        """An async handler ended (returned, or raised ``exc``) after a cancel of the
        worker's reached it (it caught the CancelledError): its timeout's (JobTimeout,
        never a completion: it was recorded as one when the lease keeper had not marked it
        yet) or a stop's (an operator's cancel, a lost or unrenewed lease: Interrupted).
        Raised as such, the task counts as stopped (_async_done): a to_thread call it
        awaited may still be in a statement of its ctx.transaction(), which is let go of,
        never committed or rolled back under it (the commit waited for the statement). A
        cancel that had not reached it yet (it ended in the same turn of the loop) leaves
        its outcome as it is."""
        if limit is not None and limit.expired():
            timeout = attempt.row.timeout or 0
            raise JobTimeout(f"timed out after {timeout:g} s; it ended after its cancel") from exc
        task = asyncio.current_task()
        if attempt.stop_reason is not None and task is not None and task.cancelling():
            raise Interrupted(attempt.stop_reason) from exc

    async def _call_async(self, attempt: Attempt, definition: JobDefinition[Any, Any]) -> Any:
        if (
            definition.payload.decodes_without_user_code
            and len(attempt.row.args) <= INLINE_DECODE_MAX
            and not self.worker.app.events.wants("errands.job.started")
        ):
            # No code of the application's runs (no validator, no started subscriber) and
            # the payload is small: decoded on the loop (~10 us), not in a thread, whose
            # hand-offs cost a no-op async job 5 x its throughput.
            prepared = self.prepare(attempt)
        else:
            prepared = await offloop.run(self.prepare, attempt)  # validators off the loop
        if prepared is None:
            return None
        kwargs, log_ctx = prepared
        if attempt.stop_reason is not None:  # stopped while it was being prepared
            raise Interrupted(attempt.stop_reason)
        info = {**job_fields(attempt.row), "meta": attempt.row.meta}
        called = clock.now()
        with job_context(log_ctx), self.worker.app.events.around_handler(info):
            try:
                result = await definition.fn(**kwargs)
            except asyncio.CancelledError as exc:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # this task was cancelled: by its timeout, or by the worker
                # Not asked to stop: a task or future the handler awaited was cancelled.
                # As "cancelled" it ended the job for good as an operator's cancel.
                raise HandlerCancelled(
                    "the handler raised asyncio.CancelledError without the worker asking it "
                    "to stop (a task or future it awaited was cancelled); retried as any "
                    "failure"
                ) from exc
            finally:
                attempt.ran = clock.now() - called
        if result is None:  # nothing to encode (no code of the application's runs)
            return None
        return await offloop.run(encode, definition, result)

    def _thread_returned(self, attempt: Attempt, exc: BaseException | None, result: Any) -> None:
        """A handler thread's call for ``attempt`` returned (or raised): its slot (if it
        holds one) to the next job, and it is recorded; the thread is done with the
        attempt then. Here, not at the end of the call: until the call is over an
        interrupt (a timeout's, a fence's) may land in it, and one landing between the
        slot's release and its hand-over lost the slot, or the waiter it was handed to,
        for good (the worker ran a handler short from then on)."""
        try:
            self.give_slot(attempt)
            self.worker.recorder.handler_returned(attempt, exc, result)
        finally:
            attempt.handler_over()

    def _async_done(self, attempt: Attempt, future: Any) -> None:
        recorder = self.worker.recorder
        if future.cancelled():  # an async task cancelled before it began (shutdown)
            recorder.decided(attempt, Interrupted("shutdown"), None)
            return
        exc = future.exception()
        # Stopped by its timeout or the worker: a thread it started (asyncio.to_thread) may
        # still be in a statement of its ctx.transaction(); the loop never waits for it.
        # (A task that caught the cancel and ended is one too: see _run_begun.)
        stopped = isinstance(exc, JobTimeout | Interrupted)
        result = None if exc is not None else future.result()
        runtime = attempt.runtime
        if (
            runtime is not None and runtime.tx is not None and not stopped
        ) or attempt.stop_reason == LEASE_UNRENEWED:
            # This runs on the event loop, and the outcome is committed in the handler's
            # own transaction, which may wait on a lock (a row, a workflow's fan-in, SQLite's
            # file), or a self-fenced attempt given back while the store is out of reach:
            # every async job of the worker stood still meanwhile. On a thread.
            threading.Thread(
                target=self._task_returned,
                args=(attempt, exc, result, stopped),
                name=f"errands-commit-{attempt.id}",
                daemon=True,
            ).start()
            return
        self._task_returned(attempt, exc, result, stopped)

    def _task_returned(
        self, attempt: Attempt, exc: BaseException | None, result: Any, stopped: bool
    ) -> None:
        """An async handler's task ended: record it (``stopped``: by its timeout or the
        worker, so a thread it started may still be in a statement of its transaction,
        which is let go of, never rolled back under it); the task is done with the
        attempt then, unless stopped (that thread may still use its ctx)."""
        try:
            self.worker.recorder.handler_returned(attempt, exc, result, handler_running=stopped)
        finally:
            if not stopped:
                attempt.handler_over()

    def _run_in_child(self, attempt: Attempt, children: ProcessRunner) -> Any:
        """A process-pool attempt (or an isolated suspect): prepared here, run in a child
        process; this handler thread waits for it. Returns its ChildResult."""
        definition = attempt.definition
        if (
            definition is not None
            and not attempt.express  # (the express lane's jobs have slots of their own)
            and ((definition.is_async and self.worker.prefetch) or self.shares_slots)
        ):
            # A rescued job, isolated: it takes a slot as if it ran here. The suspects'
            # threads and the loop's -c slots ran up to twice -c (prefetched async jobs
            # are bounded by the slots alone, not by a free thread).
            self._wait_for_slot(attempt, urgent=True)
        return self._run_child(attempt, children)  # (its slot: _thread_returned)

    def _wait_for_slot(self, attempt: Attempt, urgent: bool) -> None:
        """Block this handler thread until ``attempt`` holds a slot (``urgent``: a rescued
        job starts at the next one free); a wait ended by a stop holds none (the attempt,
        withdrawn by the stop, does not begin). Not shielded: no interrupt is aimed at an
        attempt that has not begun (a timeout's runs from its start; a stop and a fence
        withdraw a waiting one), and one aimed at this thread's previous call too late
        was dropped as that call ended (ThreadRunner._step). The shield's lock, one for
        every thread of the process, cost a worker of both kinds ~25 % of its rate."""
        attempt.holds_slot = self.slots.take_blocking(urgent)

    def _run_child(self, attempt: Attempt, children: ProcessRunner) -> Any:
        if not self._begin(attempt):
            return None
        worker = self.worker
        timeout = attempt.row.timeout
        if timeout:  # from the start: decoding the payload and job.started's subscribers too
            attempt.deadline = attempt.started + timeout
            worker.leases.poke()
        if self.prepare(attempt) is None:
            return None
        # The child's answer, made here before anything is asked of the pool: whatever
        # instant this thread is stopped at (an interrupt raised inside it: a timeout's, a
        # graceful stop's), the job is stopped too, never left running in a child (or
        # taking one) for an attempt already given up on.
        child: Future[Any] = Future()
        try:
            attempt.child = child
            attempt.kill = functools.partial(children.kill, child)
            if attempt.stop_reason is not None:  # asked to stop before it got to its child
                raise Interrupted(attempt.stop_reason)
            children.submit(attempt.row, lambda r: _progressed(attempt, r), future=child)
            return child.result()
        except ChildStartFailed as exc:
            self._not_started(attempt, exc)
            return None
        except BaseException as exc:
            if not child.done():  # this thread leaves while the child runs the job (or
                children.kill(child, exc)  # while it waits for one): neither goes on
            raise
        finally:
            worker.ran_for(clock.now() - attempt.started)

    def _not_started(self, attempt: Attempt, exc: ChildStartFailed) -> None:
        """No child process could be started for the attempt: it did nothing, so its job
        is released (available again, the attempt not charged), never failed; the failed
        start pauses the claims that need a child (see :mod:`.child_starts`)."""
        if attempt.give_back():  # (else a graceful stop took it first: it releases it)
            why = str(exc).replace("%", "%%")
            _release(self.worker, attempt, f"released %d job(s): {why}", unrun=True)


def _release(
    worker: Worker,
    attempt: Attempt,
    message: str,
    *,
    unrun: bool = False,
    prefetched: bool = False,
) -> None:
    """Give a handed-back attempt's job back and free its slot, from the handler's thread
    (``unrun``, ``prefetched``: see :meth:`Worker.release`). Shielded: an interrupt
    landing after the store's release (in its log line or event) skipped slot_freed, and
    the worker ran one slot short for good (the attempt, released, is never decided, so
    nothing else frees it)."""
    with shielded():
        worker.release([attempt], message, unrun=unrun, prefetched=prefetched)
        worker.slot_freed(attempt)


def leave_if_forked(pid: int, job_id: int) -> None:
    """Called as a handler returns (or raises) to errands, in process ``pid``: a process
    the handler forked that returned from it too (``os.fork()`` with no ``os._exit()`` in
    the child) exits here, saying so on stderr. It is a copy of the worker with only the
    handler's thread: it took the next job from its pool's queue and waited for ever, a
    copy of the worker left running after the worker exited (in a process-pool child, it
    answered on its parent's pipe). A fork that execs or exits (subprocess,
    multiprocessing) never gets here."""
    if os.getpid() == pid:
        return
    code = 0 if sys.exc_info()[0] is None else 1
    with contextlib.suppress(OSError):
        os.write(
            2,
            lockless_line(
                f"job {job_id}: its handler forked process {os.getpid()} (from {pid}) and "
                "the fork returned from the handler: a forked copy of the worker cannot run "
                f"it, so it exits ({code}); end a forked child with os._exit()"
            ),
        )
    os._exit(code)


def encode(definition: JobDefinition[Any, Any], result: Any) -> str | None:
    """The handler's result as stored JSON; any failure to encode it is InvalidPayload."""
    try:
        return definition.payload.encode_result(result)
    except InvalidPayload:
        raise
    except Exception as exc:
        raise InvalidPayload(
            f"{definition.name}: encoding the handler's result failed: {type(exc).__name__}: {exc}"
        ) from exc


def _progressed(attempt: Attempt, report: tuple[float, str]) -> None:
    """A child process's ctx.progress report: stored with the next heartbeat, as in a
    thread."""
    attempt.progress = report


def _args_for_started(events: Any, kwargs: dict[str, Any], sensitive: Any) -> dict[str, Any]:
    """The masked arguments of errands.job.started; a copy as they are now only when a
    subscriber reads them later, on the events lane (the handler may change them
    meanwhile): errands' own inline subscribers (metrics, tracing) pay no copy per job.
    A value that cannot be copied is passed as it is."""
    args = mask(kwargs, sensitive)
    if not events.wants_later("errands.job.started"):
        return args
    try:
        return copy.deepcopy(args)
    except Exception:
        return dict(args)
