"""The outcome recorder: from "the attempt is decided" to the fenced write, never raising.

An attempt is decided exactly once (:meth:`Attempt.decide`): by its handler returning or
raising, by its timeout, or by a shutdown release. Whoever decides owns the rest, and the
rest must happen whatever goes wrong in it: the slot is freed, and an outcome is handed to
the completer (or written in the handler's own transaction). If classifying the outcome
fails (a backoff policy, an exception whose ``__str__`` raises, a bug of errands'), the
attempt is still recorded as a failed, retryable attempt with the reason, never left
``running`` with its heartbeat renewing its lease for ever.

A handler that returns normally after being asked to stop is not a completion: after an
operator's cancel the job ends ``cancelled``; after a lost lease, the attempt is a failure
of kind ``lease_lost`` (and its write is fenced out). After self-fencing (its lease could
not be renewed: the store was out of reach) whatever the handler did next (returned,
perhaps early on ``ctx.cancelled``, unwound from the interrupt, raised) is not the job's
outcome: the job is given back, released uncharged and fenced by its lease token, as a
shutdown release is (:meth:`OutcomeRecorder.give_back_fenced`). A store out of reach is
the infrastructure's failure, not the job's: charged, a job went dead after an outage on
its last attempt. One exception: on SQLite, a handler that held ``ctx.transaction()``
open past a third of its lease kept the heartbeats out itself; its attempt is charged as
a ``lease_lost`` failure, or it would be given back and block the worker again for ever.
A handler whose attempt a graceful stop took over at the end of its grace period
(:meth:`Attempt.stop_for_shutdown`) records nothing when it ends: the stop gives its job
back once its steps are over (or records its timeout, if it ran past it meanwhile). The
stop's claim and the handler's decision are one step (:meth:`Attempt.decide`): a handler
deciding as the grace period ends keeps its outcome, else the stop owns it.

A completion is never written outside the ``ctx.transaction()`` the handler opened: if
that transaction was let go of (rolled back) before the outcome was decided, the job is
given back (released, uncharged) instead: its writes are gone, so its work must run again.

A job whose ``ctx.transaction()`` meets a store that cannot write now (full, read-only:
:func:`errands.errors.cannot_write_now`), as its COMMIT does or as a statement of the
handler's in it does (that error let through the handler: see
:meth:`AttemptRuntime.met_unwritable`), is given back too: released, uncharged, once the
store takes the release. It waits a pause before it runs again, doubling with each such
give-back of the job in a row (:func:`unwritable_pause`): it was due again at once, and
during a disk-full incident ran in a tight loop, its side effects with it.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .. import clock
from ..backends.base import FinishParams
from ..errors import ConfigurationError, cannot_write_now, is_transient
from ..errortext import clip, scrub
from ..observability.logcontext import job_extra
from .completer import GiveBack
from .execution import (
    CANCELLED,
    LEASE_UNRENEWED,
    Attempt,
    Interrupted,
    JobTimeout,
    _secrets,
    handler_seconds,
    outcome_for,
)
from .process_child import UNWRITABLE, ChildResult, MaybeLanded
from .process_pool import ChildFailure

if TYPE_CHECKING:
    from .worker import Worker

log = logging.getLogger("errands.worker")

# The event a stored outcome emits.
EVENT_OF_STATE = {
    "completed": "errands.job.completed",
    "retryable": "errands.job.retrying",
    "cancelled": "errands.job.cancelled",
    "dead": "errands.job.dead",
    "waiting": "errands.job.waiting",
}


class OutcomeRecorder:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def handler_returned(
        self,
        attempt: Attempt,
        exc: BaseException | None,
        result: Any,
        *,
        handler_running: bool = False,
    ) -> None:
        """A handler ended (``result``: its encoded JSON, or a child process's result).
        ``handler_running``: its task ended but work it started may still run (an async
        handler stopped by its timeout or the worker, whose ``asyncio.to_thread`` call
        goes on): its ctx.transaction() is let go of, never rolled back from here."""
        if isinstance(result, ChildResult):
            self.child_done(attempt, result)
            return
        if attempt.stopping:
            # A graceful stop took it over at the end of its grace period: the stop gives
            # the job back (released, uncharged) once its steps are over (or records its
            # timeout), whatever the handler did (it may have returned early on
            # ctx.cancelled), and frees nothing meanwhile (see Worker._shutdown). decide()
            # refuses it, marking the handler as ended (as it does a handler that reads
            # this just before the stop's claim).
            attempt.decide()
            return
        if attempt.timed_out:
            # Past its deadline, whatever it did next (returned early on ctx.cancelled,
            # or unwound from the interrupt) is a timeout, never a completion.
            timeout = JobTimeout(f"timed out after {attempt.row.timeout or 0:g} s")
            timeout.__cause__ = exc
            exc, result = timeout, None
        elif attempt.stop_reason == LEASE_UNRENEWED:
            if not self._charged_fence(attempt, handler_running):
                self.give_back_fenced(attempt, handler_running=handler_running)
                return
            stopped = Interrupted(LEASE_UNRENEWED)
            stopped.__cause__ = exc
            exc, result = stopped, None
        elif exc is None and attempt.stop_reason is not None:
            # Asked to stop (cancelled, lease lost or unrenewable) and returned: it stopped
            # early, so its work is not done. (A shutdown release ignores the outcome.)
            exc, result = Interrupted(attempt.stop_reason or ""), None
        self.decided(attempt, exc, result, handler_running=handler_running)

    def _charged_fence(self, attempt: Attempt, handler_running: bool) -> bool:
        """Whether a self-fenced attempt is charged rather than given back: its handler
        held SQLite's write lock (``ctx.transaction()``) long enough to keep the
        heartbeats out itself, or ended that transaction itself (its writes may be
        committed: recorded as TransactionEnded, never run again)."""
        runtime = attempt.runtime
        if runtime is None:
            return False
        if runtime.tx_warned and self.worker.app.backend.capabilities.single_writer:
            return True
        return (
            not handler_running
            and runtime.tx is not None
            and runtime.ended_then_failed() is not None
        )

    def give_back_fenced(self, attempt: Attempt, *, handler_running: bool = False) -> bool:
        """Give back the job of a self-fenced attempt: released (available again, the
        attempt not charged, the release recorded on the job), fenced by its lease token,
        its ``ctx.transaction()`` rolled back. ``handler_running``: the handler may still
        run (an async handler's task cancelled, a thread abandoned by the lease keeper):
        its transaction is let go of, and the release is written on a thread of its own
        (the caller must not wait for a store that may be out of reach). False when
        another outcome was decided first."""
        if not attempt.give_back():
            return False
        attempt.ended = clock.now()
        runtime = attempt.runtime
        if runtime is not None:
            try:
                if handler_running:
                    runtime.let_go()
                else:
                    runtime.rollback()
            except Exception:
                log.exception(
                    "job %s: could not roll back its transaction",
                    attempt.id,
                    extra=job_extra(attempt.row),
                )
        message = "released %d job(s) whose lease could not be renewed (self-fenced)"
        worker = self.worker
        if handler_running:
            worker.slot_freed(attempt)
            worker.release_in_background([attempt], message)
            return True
        try:
            worker.release([attempt], message)
        finally:
            worker.slot_freed(attempt)
        return True

    def decided(
        self,
        attempt: Attempt,
        exc: BaseException | None,
        result_json: Any,
        *,
        handler_running: bool = False,
        over_stop: bool = False,
    ) -> bool:
        """The attempt's outcome is known: free its slot and hand the write on.
        ``handler_running``: decided on another thread while the handler still runs
        (abandoned after its timeout): its ctx.transaction() is let go of, never used.
        ``over_stop``: decided even when a graceful stop took the attempt over (see
        :meth:`Attempt.decide`): a timeout recorded while the handler still runs.

        Returns False when another outcome was decided first (this one is ignored), or a
        graceful stop took the attempt over (it gives the job back).
        Never raises once the attempt is decided.
        """
        if attempt.released or not attempt.decide(over_stop=over_stop):
            return False  # (decide sets writing too: cleared here)
        outcome: FinishParams | GiveBack
        try:
            attempt.ended = clock.now()
            written: bool | None = None
            if attempt.runtime is not None:  # no step or transaction starts from now on
                attempt.runtime.close()
            try:
                outcome, written = self._outcome(attempt, exc, result_json, handler_running)
            except BaseException as bug:
                log.exception(
                    "job %s: recording its outcome failed; recording a failure",
                    attempt.id,
                    extra=job_extra(attempt.row),
                )
                outcome, written = self._fallback(attempt, bug, handler_running), None
        finally:
            attempt.writing = False
        try:
            self.worker.slot_freed(attempt)
        finally:
            if written is not None and isinstance(outcome, FinishParams):
                self.on_written(attempt, outcome, written)
            else:  # (a give-back too: released once the store takes it)
                self.worker.completer.submit(attempt, outcome)
        return True

    def _outcome(
        self,
        attempt: Attempt,
        exc: BaseException | None,
        result_json: Any,
        handler_running: bool = False,
    ) -> tuple[FinishParams | GiveBack, bool | None]:
        if exc is None and result_json is not None and not isinstance(result_json, str):
            exc = ConfigurationError(
                f"internal: an encoded result was expected, got {result_json!r}"
            )
        if isinstance(exc, ChildFailure) and exc.kind == UNWRITABLE:
            # a process-pool child's ctx.transaction() met a store that cannot write
            return self._give_back_unwritable(attempt, exc.type_name, str(exc))
        outcome = outcome_for(
            attempt, exc, result_json, self.worker.id, self.worker.app.poison_after
        )
        landing = _child_landing(exc)
        if landing is not None:
            # A process-pool child's ctx.transaction() COMMIT failed on a connection
            # error, and may have gone through (its reply lost): its failure is written,
            # and the job read back if the fence refuses it, as for this worker's threads
            completion = outcome_for(attempt, None, landing.result_json, self.worker.id)
            self.worker.completer.maybe_landed(attempt, completion, kept=landing.fan_ins)
            return outcome, None
        runtime = attempt.runtime
        if runtime is None:
            return outcome, None
        if handler_running:
            # Its thread may hold the connection inside a statement: whether it ended the
            # transaction itself cannot be asked without waiting for that statement. Let
            # go even when none is open: the handler, still running, cannot open one.
            runtime.let_go()
            return outcome, None
        if outcome.state == "completed" and runtime.children:
            outcome = replace(outcome, children=tuple(runtime.children))
        if runtime.tx is None:
            if outcome.state == "completed" and runtime.tx_let_go():
                return _given_back_without_transaction(attempt), None
            if runtime.met_unwritable(exc):  # ctx.transaction() could not open: read-only
                assert exc is not None
                return self._give_back_unwritable(attempt, type(exc).__qualname__, str(exc))
            return outcome, None
        if outcome.state != "completed":
            # (asked first: the check for an ended transaction rolls back to errands'
            # savepoint, and PostgreSQL then forgets the statement that failed)
            unwritable = runtime.met_unwritable(exc)
            ended = runtime.ended_then_failed()
            if ended is not None:  # its writes may be committed: never again
                log.error("%s", ended)
                outcome = outcome_for(attempt, ended, None, self.worker.id)
            elif unwritable:  # its own statement met a full store
                assert exc is not None
                runtime.rollback()
                return self._give_back_unwritable(attempt, type(exc).__qualname__, str(exc))
            runtime.rollback()
            return outcome, None
        return self._commit_transaction(attempt, outcome)

    def _give_back_unwritable(
        self, attempt: Attempt, type_name: str, message: str
    ) -> tuple[FinishParams | GiveBack, bool | None]:
        """See :func:`give_back_unwritable` (nothing written yet)."""
        return give_back_unwritable(attempt, f"{type_name}: {message}", self.worker.id), None

    def _commit_transaction(
        self, attempt: Attempt, outcome: FinishParams
    ) -> tuple[FinishParams | GiveBack, bool | None]:
        """Complete the job inside the handler's own transaction, right here: the
        transaction may hold SQLite's write lock, so no other writer can go first.

        If that fails, nothing of it may be known to be stored:

        - the store cannot write (full, read-only: :func:`errands.errors.cannot_write_now`):
          nothing of the transaction was written, and the transaction is gone, so the job
          must run again. It is given back (released, uncharged, due again after a
          growing pause: :func:`unwritable_pause`) once the store takes the release, as
          an outcome meeting such a store waits for it: the store's failure, not the
          job's;
        - the connection broke (:func:`errands.errors.is_transient`): the COMMIT may have
          gone through before it, its reply lost. The attempt's failure is handed to the
          completer, which reads the job back if the fence refuses it: a completion found
          there is the attempt's outcome (:meth:`Completer.maybe_landed`). Else the
          failure is recorded, retried as any other.
        """
        runtime = attempt.runtime
        assert runtime is not None
        try:
            runtime.check_transaction()
        except Exception as ended:
            log.error("%s", ended)
            runtime.rollback()
            return outcome_for(attempt, ended, None, self.worker.id), None
        taken = runtime.take_transaction()
        if taken is None:  # let go of meanwhile (cannot happen once decided: defensive)
            return _given_back_without_transaction(attempt), None
        backend, tx = taken
        try:
            landed = backend.tx_finish(tx, outcome)
        except Exception as exc:
            if cannot_write_now(exc):  # (before is_transient: a disk_full is OperationalError)
                # errands' own COMMIT: the store's for certain, never charged (a handler
                # that returned is not recorded failed for the store's incident)
                text = f"{type(exc).__qualname__}: {exc}"
                return give_back_unwritable(attempt, text, self.worker.id, certain=True), None
            if is_transient(exc):
                self.worker.completer.maybe_landed(attempt, outcome, store=backend)
                log.warning(
                    "job %s: committing its transaction failed on a connection error (%s): "
                    "it may have committed before it; its failure is recorded unless the "
                    "job reads back completed",
                    attempt.id,
                    clip(str(exc), 500),
                    exc_info=True,
                    extra=job_extra(attempt.row),
                )
            else:
                log.exception(
                    "job %s: committing its transaction failed; retrying it",
                    attempt.id,
                    extra=job_extra(attempt.row),
                )
            return outcome_for(attempt, exc, None, self.worker.id), None
        # What its fan-in settled and released, reported from this thread as the
        # completer reports its batches' (events, metrics, this worker's wake-up); read
        # from the store that committed it (app.backend may be another since: see tx_backend)
        self.worker.completer.fanned_in(store=backend)
        return outcome, landed

    def _fallback(
        self, attempt: Attempt, bug: BaseException, handler_running: bool = False
    ) -> FinishParams:
        """A retryable failure naming what broke, built from nothing that can fail."""
        runtime = attempt.runtime
        if runtime is not None:
            try:
                if handler_running:  # never rolled back from here (see let_go)
                    runtime.let_go()
                else:
                    runtime.rollback()
            except Exception:
                log.exception(
                    "job %s: could not roll back its transaction",
                    attempt.id,
                    extra=job_extra(attempt.row),
                )
        state = "retryable" if attempt.row.attempt < attempt.row.max_attempts else "dead"
        return FinishParams(
            attempt.id,
            attempt.token,
            state,  # type: ignore[arg-type]
            error={
                "attempt": attempt.row.attempt,
                "type": "OutcomeError",
                "message": f"errands could not record this attempt's outcome: {type(bug).__name__}",
                "traceback": None,
                "worker": self.worker.id,
                "kind": "transient",
                "lease_token": attempt.token,
            },
            delay=2.0,
            fair=attempt.row.fair_key is not None,
            ran=handler_seconds(attempt),
            member=attempt.row.workflow_id is not None,
        )

    def child_done(self, attempt: Attempt, result: ChildResult) -> None:
        """A process-pool attempt returned: record it (the child may have written it)."""
        if result.written is None and (attempt.timed_out or attempt.stop_reason):
            self.handler_returned(attempt, None, result.result_json)  # not a completion
            return
        # A child's outcome stored already is the attempt's, a graceful stop or not
        if attempt.released or not attempt.decide(over_stop=result.written is not None):
            return
        attempt.ended = clock.now()
        attempt.writing = False  # (the child wrote its own transaction's outcome already)
        try:
            outcome = outcome_for(attempt, None, result.result_json, self.worker.id)
            if result.children:
                outcome = replace(outcome, children=tuple(result.children))
        except BaseException as bug:
            log.exception(
                "job %s: recording its outcome failed; recording a failure",
                attempt.id,
                extra=job_extra(attempt.row),
            )
            outcome = self._fallback(attempt, bug)
        try:
            self.worker.slot_freed(attempt)
        finally:
            if result.written is not None:
                self.worker.completer.child_fanned_in(result.settled, result.released)
                self.on_written(attempt, outcome, result.written)
            else:
                self.worker.completer.submit(attempt, outcome)

    def on_written(self, attempt: Attempt, outcome: FinishParams, accepted: bool | None) -> None:
        """The completer (or the handler's transaction) stored the outcome, or the fence
        refused it: forget the attempt, emit its event, queue the on_dead hooks. None: it
        could not be stored at all (logged; its lease runs out and it is rescued): not a
        stale write, ``errands.job.write_failed`` (it ended no attempt: the in-flight
        gauge and the process span stayed open for good)."""
        worker = self.worker
        worker.forget(attempt)
        attempt.outcome_written()  # its objects let go of once its handler is over too
        worker.processed += 1
        events = worker.app.events
        if accepted is None:
            events.emit_later(
                "errands.job.write_failed", **job_fields(attempt.row), outcome=outcome.state
            )
            return
        if not accepted:
            if events.wants("errands.job.stale_write_rejected"):
                fields = job_fields(attempt.row)
                events.emit_later(
                    "errands.job.stale_write_rejected", **fields, outcome=outcome.state
                )
            return
        state = outcome.state
        cancelled = attempt.stop_reason == CANCELLED  # the first stop asked of it (= ctx's)
        if state in ("retryable", "dead") and cancelled:
            state = "cancelled"  # the store records a failure after a cancel as cancelled
        name = EVENT_OF_STATE[state]
        if events.wants(name):  # usually not, for completed (a debug line): build nothing
            fields = job_fields(attempt.row)
            fields["duration"] = (attempt.ended or clock.now()) - attempt.started
            error = outcome.error or {}
            if state == "retryable":
                fields["delay"] = outcome.delay
            if state in ("retryable", "dead"):
                fields["error_type"] = error.get("type")
                fields["error_message"] = error.get("message")
                fields["traceback"] = error.get("traceback")  # scrubbed, as stored
            if state == "dead":
                fields["reason"] = error.get("kind")
            if state == "waiting":
                del fields["duration"]
                fields["signal"] = outcome.wait_signal
                fields["timeout"] = outcome.wait_timeout
            events.emit_later(name, **fields)  # on a handler thread too: see emit_later
        if state == "dead":
            worker.app.dead_hooks_later(attempt.row.id)


def _given_back_without_transaction(attempt: Attempt) -> GiveBack:
    """The give-back of a job whose handler returned after its ctx.transaction() was let
    go of (rolled back): a plain completion outside it recorded the job ``completed``
    while its transaction's writes were gone (I3); it runs again instead."""
    log.error(
        "job %s: its handler returned after its ctx.transaction() was ended without it; "
        "nothing of that transaction is committed, so the job is given back (uncharged) "
        "rather than completed",
        attempt.id,
        extra=job_extra(attempt.row),
    )
    return GiveBack(
        "released %d job(s) whose ctx.transaction() was ended before their completion "
        "(nothing of it committed)"
    )


# A job given back because its ctx.transaction() met a store that cannot write waits this
# long before it is due again, doubling with each such give-back of it in a row, up to
# UNWRITABLE_PAUSE_MAX; each pause is drawn between half of it and all of it (jitter: the
# jobs of one incident do not come due together).
UNWRITABLE_PAUSE = 1.0
UNWRITABLE_PAUSE_MAX = 60.0
# What the release entry of such a give-back says (the text recorded on the job), by which
# the give-backs in a row are counted
UNWRITABLE_MARK = "met a store that cannot be written now"
# The backstop: a job given back this many times in a row for a store that cannot write
# (about 45 minutes of pauses at most, 1 + 2 + ... + 32 s and then 60 s each, at least
# half of it with the jitter) is charged its attempt on the next, as a failure of its own
# (retried after its backoff, or dead once out of attempts): no job loops for ever
# uncharged, even on an error taken for the store's that was not.
UNWRITABLE_GIVE_BACKS_MAX = 50


def unwritable_pause(attempt: Attempt) -> float:
    """The pause before a job given back for a store that cannot write is due again:
    UNWRITABLE_PAUSE after its first such give-back, doubling with each one in a row (the
    release entries that end the job's errors, of this same attempt: each give-back gives
    its attempt back) up to UNWRITABLE_PAUSE_MAX, with jitter. Counted from the job's own
    record, so that it holds across workers and restarts; it starts over once a run of
    the job ends otherwise (its commit succeeds and it completes, or its failure is
    charged: a new attempt)."""
    in_a_row = 1 + _unwritable_in_a_row(attempt.row.errors, attempt.row.attempt)[0]
    pause = min(UNWRITABLE_PAUSE * 2 ** min(in_a_row - 1, 32), UNWRITABLE_PAUSE_MAX)
    return pause * (0.5 + random.random() / 2)


def _unwritable_in_a_row(errors: str, attempt: int) -> tuple[int, float | None]:
    """The give-backs for a store that cannot write that end ``errors`` (a job's errors,
    as JSON text), each of attempt ``attempt``, and when the first of them was recorded
    (epoch seconds; None if none, or not known)."""
    if UNWRITABLE_MARK not in errors:
        return 0, None
    try:
        entries = json.loads(errors)
    except (TypeError, ValueError, RecursionError):
        return 0, None
    count = 0
    first: float | None = None
    for entry in reversed(entries if isinstance(entries, list) else []):
        if not (
            isinstance(entry, dict)
            and entry.get("kind") == "released"
            and entry.get("attempt") == attempt
            and UNWRITABLE_MARK in str(entry.get("message"))
        ):
            break
        count += 1
        at = entry.get("at")
        first = float(at) if isinstance(at, int | float) else first
    return count, first


def give_back_unwritable(
    attempt: Attempt, error: str, worker_id: str, *, certain: bool = False
) -> GiveBack | FinishParams:
    """The give-back of a job whose ctx.transaction() met a store that cannot write now,
    as its COMMIT or as a statement of the handler's in it (``error``: the error's type
    and text, as the release records it: see GiveBack), due again after
    :func:`unwritable_pause`.

    Once the job was given back UNWRITABLE_GIVE_BACKS_MAX times in a row for it, its
    attempt is charged instead (the backstop: see there): the failure recorded says that
    the store could not be written for that long. Not when the error is ``certain`` to
    be the store's (errands' own COMMIT met it: the handler returned): such a job waits
    for the store as any outcome does, however long."""
    text = clip(scrub(error, _secrets(attempt)), 300)
    in_a_row, first = _unwritable_in_a_row(attempt.row.errors, attempt.row.attempt)
    if in_a_row >= UNWRITABLE_GIVE_BACKS_MAX and not certain:
        since = ""
        if first is not None:
            since = f" over {max(time.time() - first, 0.0) / 60:.0f} min"
        failure = RuntimeError(
            f"job {attempt.id}: its ctx.transaction() {UNWRITABLE_MARK} {in_a_row + 1} "
            f"times in a row{since} (the store could not be written for that long, or the "
            f"error was not the store's); the attempt is charged, so that the job does not "
            f"run again for ever uncharged. Last: {text}"
        )
        return outcome_for(attempt, failure, None, worker_id)
    delay = unwritable_pause(attempt)
    return GiveBack(
        f"released %d job(s) whose ctx.transaction() {UNWRITABLE_MARK} "
        f"({text.replace('%', '%%')}); due again in {delay:.2f} s",
        delay,
    )


def job_fields(row: Any) -> dict[str, Any]:
    return {
        "job_id": row.id,
        "job_name": row.name,
        "queue": row.queue,
        "attempt": row.attempt,
        "max_attempts": row.max_attempts,
    }


def _child_landing(exc: BaseException | None) -> MaybeLanded | None:
    """What a process-pool child sent with a failure whose transaction may have
    committed (:class:`.process_child.MaybeLanded`), also under the timeout or stop the
    worker recorded in its place (its cause)."""
    for failure in (exc, exc.__cause__ if exc is not None else None):
        if isinstance(failure, ChildFailure) and failure.landing is not None:
            return failure.landing
    return None
