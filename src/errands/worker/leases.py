"""The lease keeper: heartbeats, lost leases, operator cancels, timeouts, self-fencing.

One thread, waking at whichever comes first: the next heartbeat, the next handler
deadline, or the next step of stopping a self-fenced handler.

Heartbeat: extend the lease of every attempt still held, in one transaction, every third
of the shortest lease among them (the worker's own ``lease`` setting, or a job's stored
lease when that is shorter: a job enqueued by another app with ``lease=3`` is renewed
every second, not every 10 s). A lease the store no longer extends was lost (rescued
after a pause, or the job was replayed): the handler is asked to stop, and its late
outcome will be rejected by the fence. A lease flagged ``cancel_requested`` means an
operator cancelled the job: the handler is asked to stop (``ctx.cancelled``;
``CancelledError`` in async handlers).

A heartbeat fails when the store raises or does not answer in time. After a failure the
next one is tried about a second later (never later than the usual beat), over and over,
until one gets through; meanwhile the worker claims no new job (see ``failures``), and
claims again at the first heartbeat that gets through.

Self-fencing: an attempt whose lease no heartbeat could renew, and which would run out
within half a heartbeat interval (a sixth of its lease), is stopped *before* it runs out,
so this worker never races the worker that will take the job over (see
:func:`errands.worker.timeouts.on_fence`): ``ctx.cancelled`` turns true at once (an async
task is cancelled, a child process is killed), a sync handler's thread gets
HandlerInterrupt soon after, and one that still runs is abandoned shortly before the
lease ends. Its job is given back, uncharged (released, fenced by its lease token): a
store out of reach is not the job's failure. A prefetched job not yet begun is given back
at once.

A heartbeat's answer is matched by job id *and* lease token: after a lease loss this
worker may hold a stale attempt and a newer attempt of the same job at once, and only the
newer one's lease was extended; the stale one is told its lease is lost.

Every time here is read from :func:`errands.clock.now`, which counts a host's suspend as
the store's clock does: woken from a suspend longer than a lease, the keeper's next round
is a heartbeat long overdue, whose failure self-fences at once (the lease has run out at
the store), and whose success renews the lease (no other worker took the job). Its waits
read that clock again at least every :data:`WAIT_SLICE` seconds (a wait itself runs on
CLOCK_MONOTONIC, which a suspend stops), so that round comes within a second of the
resume, not up to a heartbeat interval later.

On a store where an open transaction holds the single write lock (SQLite), a handler
that keeps ``ctx.transaction()`` open keeps every heartbeat of this worker out: past a
third of the lease, the keeper warns, naming the job.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from .. import clock
from ..backends.base import LeaseRef
from ..errortext import scrub
from ..hooks import protect_current_thread
from ..observability.logcontext import job_extra
from .callers import Caller as _Caller
from .execution import LEASE_LOST, LEASE_UNRENEWED, Attempt, _secrets

if TYPE_CHECKING:
    from ..app import App

log = logging.getLogger("errands.worker")

CALLERS_MAX = 3  # helper threads; more are only started while earlier ones hang
# A job still running at these ages (seconds) is named at INFO, once each: the only
# lifecycle line a default worker writes before a job finishes.
STILL_RUNNING_AT = (60.0, 600.0, 3600.0)
MIN_INTERVAL = 0.2  # seconds: no heartbeat plan is faster (the worker's interval floor too)
RETRY_AFTER_FAILURE = 1.0  # seconds between heartbeats while they fail (the interval, if less)
WAIT_MIN = 1.0  # seconds a heartbeat may always take to answer (the interval, if less)
# Seconds the keeper waits at most before it reads errands.clock again. A wait runs on
# CLOCK_MONOTONIC, which a host's suspend stops: one wait to the next round woke up to a
# whole heartbeat interval late after a resume, its overdue heartbeat with it.
WAIT_SLICE = 1.0


class LeaseKeeper:
    def __init__(
        self,
        worker: WorkerLike,
        interval: float,
        on_timeout: Callable[[Attempt], None],
        on_fence: Callable[[Attempt], None],
    ) -> None:
        self.worker = worker
        self.interval = interval  # between heartbeats, at most (a shorter lease held: less)
        self.on_timeout = on_timeout
        self.on_fence = on_fence  # self-fencing, one step at a time (timeouts.on_fence)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="errands-leases", daemon=True)
        self._callers: list[_Caller] = []
        self._last_beat = 0.0  # when the last heartbeat was sent (errands.clock)
        self._registry_at = 0.0  # when the last registry beat was sent (errands.clock)
        self._warned_at = float("-inf")  # when a failed heartbeat was last warned about
        # Heartbeats failed in a row (0: the last one got through). While it is not 0 the
        # worker claims no new job: each would be self-fenced in its turn.
        self.failures = 0

    def start(self) -> None:
        self._thread.start()

    def poke(self) -> None:
        """Re-plan the next wake-up (a new attempt with a deadline, or a shorter lease)."""
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

    def every(self, lease_seconds: float) -> float:
        """Seconds between heartbeats for a lease of ``lease_seconds``: a third of it, at
        most the worker's interval, at least MIN_INTERVAL. A job's stored lease comes from
        whoever enqueued it and may be shorter than the worker's own: beating at the
        worker's interval had such a job rescued while it ran, and run twice at once."""
        return max(min(self.interval, lease_seconds / 3), MIN_INTERVAL)

    def interval_for(self, held: list[Attempt]) -> float:
        """Seconds between two heartbeats while ``held`` are held (the shortest lease)."""
        return min([self.interval, *(self.every(a.lease_seconds) for a in held)])

    def fence_at(self, attempt: Attempt) -> float:
        """When ``attempt`` is self-fenced if no heartbeat renews its lease by then: half a
        heartbeat interval (a sixth of its lease, 5 s by default) before the lease runs
        out. Heartbeats are retried every second until then, so an outage that ends
        sooner fences nothing (at a whole interval, an 11 s outage fenced every handler)."""
        return attempt.lease_valid_until - self.every(attempt.lease_seconds) / 2

    def _run(self) -> None:
        protect_current_thread()
        self._last_beat = self._registry_at = clock.now()
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
        attempts = self.worker.attempts()
        held = [a for a in attempts if not a.released]
        every = self.interval_for(held)
        # After a failed heartbeat the next is tried about a second later, not a whole
        # interval: at the defaults (30 s lease, a beat every 10 s) an 11 s outage spanned
        # two beats and fenced every handler, and the next beat landed as the store's
        # leases ran out, racing the rescue.
        next_beat = self._last_beat + (min(RETRY_AFTER_FAILURE, every) if self.failures else every)
        wake = [next_beat]
        for attempt in attempts:
            if attempt.decided:
                continue
            if attempt.deadline:
                wake.append(attempt.deadline)
            if attempt.fence is not None:
                step = attempt.fence.next_at()
                if step is not None:
                    wake.append(step)
            elif self.failures and not attempt.released and attempt.stop_reason != LEASE_LOST:
                wake.append(self.fence_at(attempt))
        now = clock.now()
        wake_at = min(wake)
        if wake_at > now:
            self._wait_until(wake_at)
            return
        if now >= next_beat:
            self._last_beat = now
            self.beat()
            self._warn_long_transactions()
            self._name_long_runs()
            if now >= self._registry_at + self.interval:  # not with each retry of a failure
                self._registry_at = now
                caller = self._caller()  # best effort, never waited for
                if caller is not None:
                    caller.submit(self.worker.registry_beat)
        if self.failures:
            self._self_fence(self.worker.attempts())
        for attempt in self.worker.attempts():
            if attempt.decided:
                continue
            if attempt.deadline and clock.now() >= attempt.deadline:
                self.on_timeout(attempt)
            step = attempt.fence.next_at() if attempt.fence is not None else None
            if step is not None and clock.now() >= step and not attempt.decided:
                self.on_fence(attempt)

    def _wait_until(self, wake_at: float) -> None:
        """Wait until ``wake_at`` on errands.clock, or a poke: in slices of WAIT_SLICE at
        most, each followed by a fresh reading of the clock, so a suspend that passed it
        meanwhile ends the wait within a slice of the resume."""
        while (left := wake_at - clock.now()) > 0:
            if self._wake.wait(min(left, WAIT_SLICE)):
                break
        self._wake.clear()

    def _answer_within(self, held: list[Attempt], sent_at: float) -> float:
        """How long a heartbeat sent at ``sent_at`` waits for its answer: one interval at
        most, and never past the moment the soonest lease still believed valid is to be
        self-fenced (its handler must be stopped before the lease runs out); at least
        WAIT_MIN (or the interval, if shorter), the time a busy store may take to answer.

        Only leases still believed valid count: an attempt whose lease is already lost or
        could not be renewed, whose handler still runs, made every heartbeat wait 50 ms at
        most, so a store answering in 100 ms failed them all and healthy jobs were fenced."""
        every = self.interval_for(held)
        points = [
            self.fence_at(a)
            for a in held
            if not a.decided
            and a.fence is None
            and a.stop_reason not in (LEASE_LOST, LEASE_UNRENEWED)
            and a.lease_valid_until > sent_at
        ]
        wait = min([every, *(point - sent_at for point in points)])
        return max(wait, min(WAIT_MIN, every))

    def beat(self) -> None:
        held = [a for a in self.worker.attempts() if not a.released]
        if not held and not self.failures:
            return
        sent_at = clock.now()
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
            wait = self._answer_within(held, sent_at)
            try:
                result = call.result(timeout=wait)
            except TimeoutError:
                if call.done():
                    raise
                raise TimeoutError(f"no answer from the database within {wait:.2f} s") from None
        except Exception as exc:
            self._failed(exc, held)
            return
        if self.failures:
            log.info(
                "heartbeats get through again (after %d failed); claiming new jobs again",
                self.failures,
            )
            self.failures = 0
            self._warned_at = float("-inf")
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
                        "job %s was cancelled by an operator; stopping its handler",
                        attempt.id,
                        extra=job_extra(attempt.row),
                    )
                    attempt.interrupt("cancelled", loop)
            elif not attempt.decided and attempt.stop_reason is None:
                log.warning(
                    "lease of job %s (attempt %s) is lost: another worker may run it now; "
                    "stopping the handler, and its outcome will be rejected",
                    attempt.id,
                    attempt.row.attempt,
                    extra=job_extra(attempt.row),
                )
                attempt.interrupt(LEASE_LOST, loop)

    def _failed(self, exc: Exception, held: list[Attempt]) -> None:
        """A heartbeat failed: say so (the first, then once an interval while they go on
        failing: they are retried every second), and self-fence the leases at risk."""
        self.failures += 1
        now = clock.now()
        if now >= self._warned_at + self.interval:
            self._warned_at = now
            log.warning(
                "heartbeat failed (%s); %s; retrying every %.1f s, claiming no new job "
                "until one gets through",
                exc,
                f"{len(held)} lease(s) at risk" if held else "no lease held",
                min(RETRY_AFTER_FAILURE, self.interval_for(held)),
            )
        else:
            log.debug("heartbeat failed again (%s)", exc)
        self._self_fence(held)

    def _self_fence(self, attempts: list[Attempt]) -> None:
        """Stop the handlers whose lease no heartbeat renewed and that would run out within
        half a heartbeat interval (their fence point passed); see :func:`.timeouts.on_fence`. A lost
        lease is not fenced: it is not ours to give back, and its outcome is refused."""
        now = clock.now()
        for attempt in attempts:
            if (
                attempt.decided
                or attempt.released
                or attempt.fence is not None
                or attempt.stop_reason == LEASE_LOST
                or now < self.fence_at(attempt)
            ):
                continue
            log.error(
                "cannot renew the lease of job %s: stopping its handler before the lease "
                "runs out (in %.2f s), so no other worker races it; the job is given back, "
                "uncharged",
                attempt.id,
                attempt.lease_valid_until - now,
                extra=job_extra(attempt.row),
            )
            self.on_fence(attempt)

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

    def _name_long_runs(self) -> None:
        now = clock.now()
        for attempt in self.worker.attempts():
            if attempt.decided or attempt.waiting or attempt.reported >= len(STILL_RUNNING_AT):
                continue
            ran = now - attempt.started
            if ran >= STILL_RUNNING_AT[attempt.reported]:
                attempt.reported += 1
                log.info("still running after %.0f s", ran, extra=job_extra(attempt.row))

    def _warn_long_transactions(self) -> None:
        backend = self.worker.app.backend
        if not backend.capabilities.single_writer:
            return
        now = clock.now()
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
                    extra=job_extra(attempt.row),
                )


class WorkerLike(Protocol):
    """The slice of :class:`errands.worker.worker.Worker` the keeper uses."""

    app: App

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None: ...

    def attempts(self) -> list[Attempt]: ...

    def registry_beat(self) -> None: ...

    def heartbeats_resumed(self) -> None: ...
