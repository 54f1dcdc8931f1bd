"""The worker the test tools run jobs on (internal).

It *is* :class:`errands.worker.worker.Worker` — the same claim, payload decoding,
Context, steps, completion transaction, children, classification of failures and fenced
completer — with three additions for tests:

- :meth:`HarnessWorker.run_row` runs one claimed row and waits for its outcome to be
  written, so ``drain()`` can go one job at a time without sleeping;
- a simulated crash (:class:`~errands.testing.faults.SimulatedCrash`, or a crash the
  tester asks for before an outcome is written) behaves like the process dying: nothing
  is written, the completion transaction rolls back, the children are dropped, and the
  lease is left to expire and be rescued;
- a *duplicate delivery* runs a row again under a lease token that is not the job's (as a
  stale worker would): its handler runs for real and the fence rejects its outcome.
"""

from __future__ import annotations

import logging
import secrets
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from ..backends.base import ClaimParams, FinishParams, LeaseRef, QueueClaim
from ..jobs import JobRow
from ..worker.completer import GiveBack
from ..worker.execution import Attempt
from ..worker.recorder import OutcomeRecorder
from ..worker.worker import Worker
from ._store import store_tools
from .faults import SimulatedCrash
from .results import Run, RunOutcome

if TYPE_CHECKING:
    from ..app import App

DUPLICATE_TOKEN_PREFIX = "dup-"


class Hooks(Protocol):
    """What the worker asks of the tester that owns it."""

    def _hook_crash_before_write(self, attempt: Attempt, exc: BaseException | None) -> bool: ...

    def _hook_record(self, run: Run) -> None: ...


class HarnessRecorder(OutcomeRecorder):
    """The worker's outcome recorder, with the tester's crashes and run records."""

    worker: HarnessWorker

    def decided(
        self,
        attempt: Attempt,
        exc: BaseException | None,
        result_json: Any,
        *,
        handler_running: bool = False,
        over_stop: bool = False,
    ) -> bool:
        worker = self.worker
        key = (attempt.id, attempt.token)
        with worker._harness_lock:
            duplicate = key in worker._duplicates
        if _is_crash(exc) or (
            not duplicate and worker.hooks._hook_crash_before_write(attempt, exc)
        ):
            return self._harness_crash(attempt, exc, result_json, handler_running, over_stop)
        with worker._harness_lock:
            worker._errors[key] = exc
        return super().decided(
            attempt, exc, result_json, handler_running=handler_running, over_stop=over_stop
        )

    def _harness_crash(
        self,
        attempt: Attempt,
        exc: BaseException | None,
        result: Any,
        handler_running: bool = False,
        over_stop: bool = False,
    ) -> bool:
        """The attempt dies as its process would: nothing written, lease left to expire.

        The worker decides the outcome as usual (freeing the slot and its bookkeeping),
        but the completion transaction is rolled back first, so the outcome goes to the
        completer, where :meth:`HarnessWorker._harness_submit` drops it with the children
        it carries.
        """
        worker = self.worker
        key = (attempt.id, attempt.token)
        if attempt.runtime is not None and not handler_running:
            attempt.runtime.rollback()  # a dead process's transaction rolls back
        # (a handler still running: decided() lets go of it once it owns the outcome)
        with worker._harness_lock:
            worker._crashing[key] = exc if _is_crash(exc) else None
        if super().decided(
            attempt, exc, result, handler_running=handler_running, over_stop=over_stop
        ):
            return True
        with worker._harness_lock:
            worker._crashing.pop(key, None)
        return False

    def on_written(self, attempt: Attempt, outcome: FinishParams, accepted: bool | None) -> None:
        worker = self.worker
        try:
            super().on_written(attempt, outcome, accepted)
        finally:
            with worker._harness_lock:
                error = worker._errors.pop((attempt.id, attempt.token), None)
            state: RunOutcome = outcome.state if accepted else "rejected"
            worker._harness_finish(attempt, state, error)


class HarnessWorker(Worker):
    recorder_class = HarnessRecorder

    def __init__(self, app: App, hooks: Hooks, **options: Any) -> None:
        super().__init__(app, **options)
        self.hooks = hooks
        self._errors: dict[tuple[int, str], BaseException | None] = {}
        self._duplicates: set[tuple[int, str]] = set()
        self._waiting: dict[tuple[int, str], Future[Run]] = {}
        self._harness_lock = threading.Lock()
        self._services = False
        self._crashing: dict[tuple[int, str], BaseException | None] = {}
        # Every outcome the worker decides goes through the completer, unless it commits a
        # ctx.transaction() itself: the place to drop the outcome of a crashed attempt.
        self._submit_outcome = self.completer.submit
        setattr(self.completer, "submit", self._harness_submit)  # noqa: B010

    # -- what the lease keeper sees ----------------------------------------------------------
    def attempts(self) -> list[Attempt]:
        """Every live attempt but the duplicate deliveries: their lease is not theirs to
        renew (a heartbeat would find it lost and stop them half-way)."""
        with self._harness_lock:
            duplicates = set(self._duplicates)
        return [a for a in super().attempts() if (a.id, a.token) not in duplicates]

    def live_tokens(self) -> set[str]:
        return {a.token for a in super().attempts() if not a.decided}

    # -- outcomes ------------------------------------------------------------------------------
    def _harness_submit(self, attempt: Attempt, outcome: FinishParams | GiveBack) -> None:
        key = (attempt.id, attempt.token)
        with self._harness_lock:
            crashed = key in self._crashing
            error = self._crashing.pop(key, None)
        if not crashed:
            self._submit_outcome(attempt, outcome)
            return
        with self._lock:
            self._attempts.pop(key, None)  # no more heartbeats: its lease will expire
        self._harness_finish(attempt, "crashed", error)

    def release_done(
        self,
        attempts: list[Attempt],
        released: list[bool | None],
        message: str,
        level: int = logging.WARNING,
    ) -> None:
        """A run that drain() waits for may end released: its ctx.transaction() could
        not be committed because the store cannot write (given back by the completer),
        or it was self-fenced. Its wait ends with the release (a release reported no
        run: drain() waited out its timeout)."""
        try:
            super().release_done(attempts, released, message, level)
        finally:
            for attempt, ok in zip(attempts, released, strict=True):
                with self._harness_lock:
                    waited = (attempt.id, attempt.token) in self._waiting
                if waited:  # (None: not written; its lease expires, as after a crash)
                    outcome: RunOutcome = "released" if ok else "rejected"
                    self._harness_finish(attempt, "crashed" if ok is None else outcome, None)

    def _harness_finish(
        self, attempt: Attempt, outcome: RunOutcome, error: BaseException | None
    ) -> None:
        key = (attempt.id, attempt.token)
        with self._harness_lock:
            duplicate = key in self._duplicates
            self._duplicates.discard(key)
            waiter = self._waiting.pop(key, None)
        row = attempt.row
        run = Run(row.id, row.name, row.queue, row.attempt, outcome, error, duplicate)
        try:
            self.hooks._hook_record(run)
        finally:
            if waiter is not None:
                waiter.set_result(run)

    # -- one job at a time (drain) -----------------------------------------------------------
    def start_services(self) -> None:
        """What ``run()`` starts, minus the producer loop, the listener and maintenance."""
        if not self._services:
            self._services = True
            self.completer.start()
            self.leases.start()

    def stop_services(self) -> None:
        if self._services:
            self._services = False
            self.completer.stop(timeout=10.0)
            self.leases.stop()
        self.threads.shutdown()
        if self.express_threads is not None:
            self.express_threads.shutdown()
        if self.loop_runner is not None:
            self.loop_runner.shutdown()

    def claim_one(self, queues: list[str]) -> JobRow | None:
        if not queues:
            return None
        plan = [QueueClaim(q, 1) for q in queues]
        backend = self.app.backend
        rows = backend.job_claim(ClaimParams(plan, 1, self.id, self.app.lease))
        if not rows:  # jobs rescued before (poison suspects) are claimed on their own
            rows = backend.job_claim(ClaimParams(plan, 1, self.id, self.app.lease, suspects=True))
        if not rows:
            rows = self._claim_limited(plan)
        return rows[0] if rows else None

    def _claim_limited(self, plan: list[QueueClaim]) -> list[JobRow]:
        """Jobs with a concurrency key or a rate (and those of limited or fair queues),
        which the plain claim leaves out: through the limited claim, one at a time (never
        past a concurrency limit), with the rate log forgotten first, as drain() applies
        no rate. They were never claimed: drain() stopped, reporting nothing left to run."""
        backend = self.app.backend
        # All of it: pruning "older than 0 s" kept a start logged in the same millisecond
        # (SQLite's clock), and a fast drain then stopped at the rate it does not apply.
        store_tools(backend).forget_rates()
        for suspects in (False, True):
            for queue in plan:
                rows = backend.job_claim_limited(queue, self.id, self.app.lease, suspects=suspects)
                if rows:
                    return list(rows)
        return []

    def release_row(self, row: JobRow) -> None:
        """Give a claimed row back without running it, as a worker gives back a
        prefetched job: due again in its place, nothing recorded (no ``released`` entry in
        its errors: no attempt of it began)."""
        lease = row.lease_seconds or self.app.lease
        fair = row.fair_key is not None
        self.app.backend.job_release_many(
            [LeaseRef(row.id, row.lease_token or "", lease, fair=fair)], prefetched=True
        )

    def run_row(self, row: JobRow, *, duplicate: bool = False, timeout: float = 60.0) -> Run:
        """Run ``row`` (claimed by this worker) and wait until its outcome is written.

        ``duplicate``: run it again under a token that is not the job's, as a stale worker
        would; the fence rejects whatever it tries to write.
        """
        if duplicate:
            row = replace(row, lease_token=DUPLICATE_TOKEN_PREFIX + secrets.token_hex(8))
        key = (row.id, row.lease_token or "")
        waiter: Future[Run] = Future()
        with self._harness_lock:
            self._waiting[key] = waiter
            if duplicate:
                self._duplicates.add(key)
        self._start_all([row])
        try:
            return waiter.result(timeout)
        except FutureTimeout:
            raise RuntimeError(
                f"job {row.id} ({row.name}) was still running after {timeout:g} s; drain() "
                "runs one job at a time, so a handler must not wait for another job"
            ) from None


def _is_crash(exc: BaseException | None) -> bool:
    seen = 0
    while exc is not None and seen < 5:  # a timeout wraps what the handler raised
        if isinstance(exc, SimulatedCrash):
            return True
        exc, seen = exc.__cause__, seen + 1
    return False
