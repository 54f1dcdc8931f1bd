"""The lease keeper: heartbeats, lost leases, operator cancels, timeouts, self-fencing.

One thread, waking at whichever comes first: the next heartbeat (a third of the shortest
lease), the next handler deadline, or the next step of stopping a self-fenced handler.

Heartbeat: extend the lease of every attempt still held, in one transaction. A lease the
store no longer extends was lost (rescued after a pause, or the job was replayed): the
handler is asked to stop, and its late outcome will be rejected by the fence. A lease
flagged ``cancel_requested`` means an operator cancelled the job: the handler is asked
to stop (``ctx.cancelled``; ``CancelledError`` in async handlers).

Self-fencing: if heartbeats keep failing (database unreachable), every handler whose
lease would run out within 1.5 heartbeat intervals is stopped *before* it runs out, so
this worker never races the worker that will take the job over (see
:func:`errands.worker.timeouts.on_fence`): ``ctx.cancelled`` turns true at once (an async
task is cancelled, a child process is killed), a sync handler's thread gets
HandlerInterrupt soon after, and one that still runs is abandoned shortly before the
lease ends. Its job is given back, uncharged (released, fenced by its lease token): a
store out of reach is not the job's failure. A prefetched job not yet begun is given back
at once. The worker claims no new job while heartbeats fail (see ``failures``).

A heartbeat's answer is matched by job id *and* lease token: after a lease loss this
worker may hold a stale attempt and a newer attempt of the same job at once, and only the
newer one's lease was extended; the stale one is told its lease is lost.

On a store where an open transaction holds the single write lock (SQLite), a handler
that keeps ``ctx.transaction()`` open keeps every heartbeat of this worker out: past a
third of the lease, the keeper warns, naming the job.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from ..backends.base import LeaseRef
from ..hooks import protect_current_thread
from ..observability.logcontext import JobLogContext, job_context
from .execution import LEASE_LOST, Attempt, _secrets, scrub

if TYPE_CHECKING:
    from ..app import App

log = logging.getLogger("errands.worker")

CALLERS_MAX = 3  # helper threads; more are only started while earlier ones hang
# A job still running at these ages (seconds) is named at INFO, once each: the only
# lifecycle line a default worker writes before a job finishes.
STILL_RUNNING_AT = (60.0, 600.0, 3600.0)


class _Caller:
    """A daemon thread running the keeper's database calls one at a time (one thread,
    so one SQLite connection, for the life of the worker)."""

    def __init__(self) -> None:
        self.busy = False
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        threading.Thread(target=self._run, name="errands-heartbeat", daemon=True).start()

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self.busy = True
        self._calls.put((fn, future))
        return future

    def stop(self) -> None:
        self._calls.put(None)

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            fn, future = item
            try:
                result = fn()
            except BaseException as exc:
                self.busy = False
                future.set_exception(exc)
            else:
                self.busy = False
                future.set_result(result)


class LeaseKeeper:
    def __init__(
        self,
        worker: WorkerLike,
        interval: float,
        on_timeout: Callable[[Attempt], None],
        on_fence: Callable[[Attempt], None],
    ) -> None:
        self.worker = worker
        self.interval = interval
        self.on_timeout = on_timeout
        self.on_fence = on_fence  # self-fencing, one step at a time (timeouts.on_fence)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="errands-leases", daemon=True)
        self._callers: list[_Caller] = []
        self._next_beat = 0.0  # when the next heartbeat is due (monotonic)
        # Heartbeats failed in a row (0: the last one got through). While it is not 0 the
        # worker claims no new job: each would be self-fenced in its turn.
        self.failures = 0

    def start(self) -> None:
        self._thread.start()

    def poke(self) -> None:
        """Re-plan the next wake-up (a new attempt with a deadline started)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)
        for caller in self._callers:
            caller.stop()

    def _caller(self) -> _Caller | None:
        """An idle helper thread (a new one while fewer than CALLERS_MAX hang)."""
        for caller in self._callers:
            if not caller.busy:
                return caller
        if len(self._callers) < CALLERS_MAX:
            self._callers.append(_Caller())
            return self._callers[-1]
        return None

    def _run(self) -> None:
        protect_current_thread()
        self._next_beat = time.monotonic() + self.interval
        while not self._stop.is_set():
            try:
                self._round()
            except Exception:
                # Heartbeats, timeouts and cancels of every job depend on this thread:
                # it must outlive any one failure (a helper thread that cannot start, a
                # runner's abandon raising). It died with a traceback on stderr, and
                # every lease of the worker then ran out while its handlers ran on.
                log.exception("the lease keeper failed; it goes on in a second")
                self._wake.wait(min(self.interval, 1.0))
                self._wake.clear()

    def _round(self) -> None:
        """One turn of the keeper: wait for the next heartbeat, deadline or self-fencing
        step, then act."""
        next_beat = self._next_beat
        now = time.monotonic()
        deadlines = []
        for attempt in self.worker.attempts():
            if attempt.decided:
                continue
            if attempt.deadline:
                deadlines.append(attempt.deadline)
            step = attempt.fence.next_at() if attempt.fence is not None else None
            if step is not None:
                deadlines.append(step)
        wake_at = min([next_beat, *deadlines])
        if wake_at > now:
            self._wake.wait(wake_at - now)
            self._wake.clear()
            return
        if now >= next_beat:
            self._next_beat = time.monotonic() + self.interval  # even if this one fails
            self.beat()
            self._warn_long_transactions()
            self._name_long_runs()
            caller = self._caller()  # best effort, never waited for
            if caller is not None:
                caller.submit(self.worker.registry_beat)
            self._next_beat = time.monotonic() + self.interval
        for attempt in self.worker.attempts():
            if attempt.decided:
                continue
            if attempt.deadline and time.monotonic() >= attempt.deadline:
                self.on_timeout(attempt)
            step = attempt.fence.next_at() if attempt.fence is not None else None
            if step is not None and time.monotonic() >= step and not attempt.decided:
                self.on_fence(attempt)

    def beat(self) -> None:
        held = [a for a in self.worker.attempts() if not a.released]
        if not held and not self.failures:
            return
        sent_at = time.monotonic()
        reports = {id(a): a.progress for a in held if a.progress != a.progress_stored}
        refs = [
            LeaseRef(a.id, a.token, a.lease_seconds, *(reports.get(id(a)) or (None, None)))
            for a in held
        ]
        if not refs:
            # Heartbeats failed and nothing is held now: a probe that matches no job
            # tells whether they get through again (the worker claims nothing until then).
            refs = [LeaseRef(0, "", self.interval * 3)]
        backend = self.worker.app.backend
        caller = self._caller()
        try:
            if caller is None:
                raise TimeoutError(f"{CALLERS_MAX} earlier heartbeats still wait for an answer")
            call = caller.submit(lambda: backend.job_heartbeat_many(refs))
            # Wait one interval at most, and never past half an interval before the
            # soonest lease runs out: its handler must be stopped before that.
            soonest = min([a.lease_valid_until for a in held] or [sent_at + self.interval * 3])
            wait = max(min(self.interval, soonest - sent_at - self.interval / 2), 0.05)
            try:
                result = call.result(timeout=wait)
            except TimeoutError:
                if call.done():
                    raise
                raise TimeoutError(f"no answer from the database within {wait:.2f} s") from None
        except Exception as exc:
            self.failures += 1
            log.warning(
                "heartbeat failed (%s); %d lease(s) at risk; claiming no new job until one "
                "gets through",
                exc,
                len(held),
            )
            self._self_fence(held)
            return
        if self.failures:
            log.info(
                "heartbeats get through again (after %d failed); claiming new jobs again",
                self.failures,
            )
            self.failures = 0
            self.worker.heartbeats_resumed()
        loop = self.worker.loop
        for attempt in held:
            lease = (attempt.id, attempt.token)
            if lease in result.extended:
                attempt.lease_valid_until = sent_at + attempt.lease_seconds
                report = reports.get(id(attempt))
                if report is not None:
                    attempt.progress_stored = report
                    self._progressed(attempt, report)
                if lease in result.cancel_requested and attempt.stop_reason is None:
                    log.info(
                        "job %s was cancelled by an operator; stopping its handler", attempt.id
                    )
                    attempt.interrupt("cancelled", loop)
            elif not attempt.decided and attempt.stop_reason is None:
                log.warning(
                    "lease of job %s (attempt %s) is lost: another worker may run it now; "
                    "stopping the handler, and its outcome will be rejected",
                    attempt.id,
                    attempt.row.attempt,
                )
                attempt.interrupt(LEASE_LOST, loop)

    def _progressed(self, attempt: Attempt, report: tuple[float, str]) -> None:
        events = self.worker.app.events
        if events.wants("errands.job.progress"):
            row = attempt.row
            events.emit(
                "errands.job.progress",
                job_id=row.id,
                job_name=row.name,
                queue=row.queue,
                attempt=row.attempt,
                max_attempts=row.max_attempts,
                progress=report[0],
                message=scrub(report[1], _secrets(attempt)),  # as its errors are
            )

    def _self_fence(self, held: list[Attempt]) -> None:
        """Stop the handlers whose lease would run out within 1.5 heartbeat intervals; see
        :func:`.timeouts.on_fence`. A lost lease is not fenced: it is not ours to give
        back, and its outcome is refused."""
        now = time.monotonic()
        horizon = now + self.interval * 1.5
        for attempt in held:
            if (
                attempt.decided
                or attempt.released
                or attempt.fence is not None
                or attempt.stop_reason == LEASE_LOST
                or attempt.lease_valid_until > horizon
            ):
                continue
            log.error(
                "cannot renew the lease of job %s: stopping its handler before the lease "
                "runs out (in %.2f s), so no other worker races it; the job is given back, "
                "uncharged",
                attempt.id,
                attempt.lease_valid_until - now,
            )
            self.on_fence(attempt)

    def _name_long_runs(self) -> None:
        now = time.monotonic()
        for attempt in self.worker.attempts():
            if attempt.decided or attempt.waiting or attempt.reported >= len(STILL_RUNNING_AT):
                continue
            ran = now - attempt.started
            if ran >= STILL_RUNNING_AT[attempt.reported]:
                attempt.reported += 1
                row = attempt.row
                with job_context(JobLogContext(row.id, row.name, row.queue, row.attempt)):
                    log.info("still running after %.0f s", ran)

    def _warn_long_transactions(self) -> None:
        backend = self.worker.app.backend
        if not backend.capabilities.single_writer:
            return
        now = time.monotonic()
        for attempt in self.worker.attempts():
            runtime = attempt.runtime
            if runtime is None or runtime.tx is None or runtime.tx_warned:
                continue
            held = now - runtime.tx_opened
            if held > attempt.lease_seconds / 3:
                runtime.tx_warned = True
                log.warning(
                    "job %s has held ctx.transaction() open for %.1f s: on SQLite it holds "
                    "the database's write lock, so no heartbeat of this worker can renew a "
                    "lease; past the lease (%g s) every handler of this worker is self-fenced. "
                    "Open the transaction at the end of the handler and keep it short",
                    attempt.id,
                    held,
                    attempt.lease_seconds,
                )


class WorkerLike(Protocol):
    """The slice of :class:`errands.worker.worker.Worker` the keeper uses."""

    app: App

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None: ...

    def attempts(self) -> list[Attempt]: ...

    def registry_beat(self) -> None: ...

    def heartbeats_resumed(self) -> None: ...
