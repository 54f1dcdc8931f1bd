"""The completer: writes attempt outcomes in batches, fenced by lease token.

Handlers hand their outcome to :meth:`Completer.submit` and move on. One thread drains
everything queued so far and writes it in a single transaction — under load a batch
carries many outcomes for one commit; when idle, a batch of one goes out at once (no
added latency). A write whose lease token is stale changes nothing: it is logged and
counted, never written over the newer attempt.

Two more things go through it, written when the store takes them as outcomes are:

- a give-back (:class:`GiveBack`): a job whose ``ctx.transaction()`` met a store that
  cannot write (full, read-only: its COMMIT, or the handler's own statement) is released,
  uncharged, with a growing pause before it is due again, once the store takes the
  release, its lease kept by the heartbeat meanwhile, as an outcome's is;
- a completion that may have landed (:meth:`Completer.maybe_landed`): a
  ``ctx.transaction()`` whose COMMIT lost its reply, on a worker's thread or in a
  process-pool child. The attempt's failure is written instead; if the fence refuses
  it, the job is read back (again while the store is out of reach), and a completion
  found there (the job completed at that attempt) is reported as the attempt's outcome,
  with what its workflow fan-in did (errands.landed).
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..backends.base import Backend, FinishParams
from ..errors import cannot_write_now, is_transient
from ..errortext import LOG_LIMIT, clip
from ..hooks import protect_current_thread
from ..landed import landed, read_back
from ..observability.logcontext import job_extra
from .execution import Attempt

if TYPE_CHECKING:
    from ..app import App

log = logging.getLogger("errands.worker")

_pause = time.sleep  # the completer's own name for its retry pause (tests replace it)

BATCH_MAX = 500
REFUSALS_BEFORE_SPLIT = 3
# A failed batch is written again within 0.05 s, the pause doubling up to this (each
# sleep between half the pause and all of it): the store's return is seen within a
# second. It was 5 s (with jitter up to 10 s): a worker whose writes failed for a moment
# then waited seconds with the store back, its outcomes held (and heartbeated) meanwhile,
# while its claims went through.
RETRY_PAUSE_MAX = 1.0
RETRY_REPORT_EVERY = 10.0  # seconds between two log lines of one streak of failed writes
# While handlers are still running, a batch smaller than this waits up to LINGER seconds
# for their outcomes: one statement then carries many jobs instead of a handful (each
# statement costs the store a round trip and a commit). An idle worker never waits.
LINGER_BATCH = 32
LINGER = 0.001


# the outcome stored (True), refused by its fence (False), or not stored at all (None: the
# store refused even the fallback; the lease runs out and the job is rescued)
Written = Callable[[Attempt, FinishParams, bool | None], None]
Released = Callable[[set[str]], None]
# A give-back's write (the worker's release, with each job's pause before it is due again:
# raises what the store raises) and its report (each lease given back, refused by its
# fence, or None: given up on)
ReleaseWrite = Callable[[list[Attempt], str, list[float]], list[bool | None]]
ReleaseDone = Callable[[list[Attempt], list[bool | None], str], None]


@dataclass(frozen=True)
class GiveBack:
    """Not an outcome: the attempt's job is to be given back (released: available again,
    the attempt not charged, ``message`` recorded as the worker's release records its
    own), once the store takes the write. For a job whose ctx.transaction() met a store
    that cannot write now: nothing of the attempt was stored, and the job must run again;
    the store's failure, not the job's. ``delay``: seconds before it is due again (see
    :func:`errands.worker.recorder.unwritable_pause`)."""

    message: str  # as Worker.release takes it: "%d" stands for the number of jobs
    delay: float = 0.0


Item = tuple[Attempt, "FinishParams | GiveBack"]


class Completer:
    def __init__(
        self,
        app: App,
        on_written: Written,
        running: Callable[[], int] | None = None,
        on_released: Released | None = None,
        on_batch: Callable[[], None] | None = None,
        release: ReleaseWrite | None = None,
        on_given_back: ReleaseDone | None = None,
    ) -> None:
        self.app = app
        self.on_written = on_written
        self.release = release
        self.on_given_back = on_given_back
        # ctx.transaction() completions whose COMMIT lost its reply, by attempt (job id and
        # lease token): the completion, and what its fan-in did if it committed
        self._maybe: dict[tuple[int, str], tuple[FinishParams, Unsure]] = {}
        # A batch's workflow fan-ins released dependents (or inserted callbacks) into
        # these queues: this worker may claim them at once, without a wake-up's round trip.
        self.on_released = on_released
        self._running = running or (lambda: 0)  # handlers whose outcome is still to come
        self._queue: queue.SimpleQueue[Item | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="errands-completer", daemon=True)
        self._closing = False
        self.stale_rejected = 0
        self._writing = 0  # outcomes of the batch being written now
        self.on_batch = on_batch  # after each batch: the worker may claim again (pending)

    def start(self) -> None:
        self._thread.start()

    def submit(self, attempt: Attempt, outcome: FinishParams | GiveBack) -> None:
        self._queue.put((attempt, outcome))

    def maybe_landed(
        self,
        attempt: Attempt,
        completion: FinishParams,
        store: Backend | None = None,
        kept: Unsure | None = None,
    ) -> None:
        """The COMMIT of ``attempt``'s ctx.transaction(), holding ``completion``, failed on
        a connection error: it may have gone through before it (its reply lost). Called
        right after the error and before the attempt's failure is submitted: what the
        transaction's fan-in did is read from ``store`` now, on the thread that committed
        (its record is that thread's), or was read by the process-pool child that
        committed it (``kept``, sent with its failure: :class:`.process_child.MaybeLanded`);
        it is reported if the completion turns out to have landed (see :meth:`_confirm`).
        One read-back for both: a child's failure is written, and the job read back, by
        this completer as a thread's is."""
        if kept is None:
            kept = Unsure()
            if store is not None:
                kept.take(store)
        self._maybe[(attempt.id, attempt.token)] = (completion, kept)

    @property
    def pending(self) -> int:
        """Outcomes decided and not yet written (queued, or in the batch being written):
        the worker claims no more while these are too many (see Worker._produce)."""
        return self._queue.qsize() + self._writing

    def _run(self) -> None:
        protect_current_thread()
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            stop = self._gather(batch)
            self._writing = len(batch)
            try:
                self._write(batch)
            finally:
                self._writing = 0
            if self.on_batch is not None:
                self.on_batch()
            if stop:
                return

    def _gather(self, batch: list[Item]) -> bool:
        """Add what is queued (waiting briefly while handlers run); True on the stop mark."""
        linger_until = 0.0
        while len(batch) < BATCH_MAX:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                if len(batch) >= LINGER_BATCH or self._running() == 0:
                    return False
                now = time.monotonic()
                if not linger_until:
                    linger_until = now + LINGER
                if now >= linger_until:
                    return False
                try:
                    item = self._queue.get(timeout=linger_until - now)
                except queue.Empty:
                    return False
            if item is None:
                return True
            batch.append(item)
        return False

    def _write(self, batch: list[Item]) -> None:
        backs = [(a, o) for a, o in batch if isinstance(o, GiveBack)]
        if backs:
            self._give_back(backs)
        finishes = [(a, o) for a, o in batch if isinstance(o, FinishParams)]
        if not finishes:
            return
        for (attempt, outcome), ok in self._confirm(self._store(finishes)):
            if ok is False:
                self.stale_rejected += 1
            try:
                self.on_written(attempt, outcome, ok)
            except Exception:
                log.exception(
                    "error after recording the outcome of job %s",
                    attempt.id,
                    extra=job_extra(attempt.row),
                )

    def _store(
        self, batch: list[tuple[Attempt, FinishParams]]
    ) -> list[tuple[tuple[Attempt, FinishParams], bool | None]]:
        """Write a batch, retrying while the store is unreachable, busy or out of room
        (leases keep the jobs safe). A batch the store refuses for its content is split,
        and an outcome that cannot be stored on its own is recorded as dead with the
        reason, so one bad outcome never holds the others back.

        A full store (or a file this process may not write) is not a refusal of the
        content: it refuses any write (it took a job that had succeeded to the dead-letter
        queue, UnstorableOutcome, once a full disk refused its outcome three times in
        0.15 s and then took the smaller dead record), so that write is made again until
        it goes through."""
        streak = _Streak()
        refusals = 0
        unsure = False  # an earlier try may have committed before its error
        kept = Unsure()  # what the fan-ins of such tries did (each retry starts afresh)
        while True:
            backend: Backend | None = None
            try:
                backend = self.app.backend  # what its fan-ins did is read from the same store
                accepted = backend.job_finish_many([o for _, o in batch])
                reported = self.fanned_in(store=backend)
                if unsure and not all(accepted):
                    confirmed = self._landed_anyway(batch, accepted)
                    if kept.settled and _fan_ins_landed_before(batch, accepted, confirmed):
                        self._report_earlier(kept, reported)
                    accepted = confirmed
                return list(zip(batch, accepted, strict=True))
            except Exception as exc:
                if is_transient(exc) and backend is not None:
                    kept.take(backend)  # (the next try's write starts by dropping them)
                unsure = unsure or is_transient(exc)  # (a full store wrote nothing)
                if not is_transient(exc) and not cannot_write_now(exc):
                    refusals += 1
                    if refusals >= REFUSALS_BEFORE_SPLIT:
                        return self._store_apart(batch, exc)
                report = streak.failed()
                if report == FIRST:  # with its traceback
                    log.exception(
                        "could not record %d outcome(s); retrying within %.2f s (leases keep "
                        "them safe)",
                        len(batch),
                        streak.pause,
                    )
                elif report == STILL:
                    log.warning(
                        "could not record %d outcome(s) in %d tries (%s); still retrying",
                        len(batch),
                        streak.failures,
                        exc,
                    )
                streak.wait()

    def fanned_in(self, store: Backend) -> list[Any]:
        """Once a write committed (a batch here, or a ctx.transaction() completion on
        its handler's thread): what its workflow fan-ins did on this thread, read from
        ``store``, the one that wrote it (the App's may be another since), reported as
        :meth:`_report_fan_in` says. Returns the workflows reported settled."""
        return self._report_fan_in(store.workflow_take_released, store.workflow_take_settled)

    def child_fanned_in(self, settled: list[Any], released: set[str]) -> None:
        """What a child process's committed write fanned in, as it sent it (it was never
        announced in this process), reported as :meth:`_report_fan_in` says."""
        self._report_fan_in(lambda: released, lambda: settled)

    def _report_fan_in(
        self, released: Callable[[], set[str]], settled: Callable[[], list[Any]]
    ) -> list[Any]:
        """The queues the fan-ins released jobs into wake this worker; the workflows they
        settled are emitted (``errands.workflow.settled``, and its metric), and returned.
        Never raises: the write committed."""
        try:
            queues = released()
            if queues and self.on_released is not None:
                self.on_released(queues)
        except Exception:  # a wake-up missed: the store's own notification still comes
            log.exception("could not wake the worker for the jobs a fan-in released")
        done: list[Any] = []
        try:
            done = settled()
            self.app.workflows_settled(later=True, settled=done)  # (off a handler's thread)
        except Exception:  # committed: an event missed is never a reason to write again
            log.exception("could not report the workflows a fan-in settled")
        return done

    def _report_earlier(self, kept: Unsure, reported: list[Any]) -> None:
        """An earlier try committed its members' ends, and with them what its fan-ins
        did (its reply was lost; this try's refusals settle nothing): reported now, each
        workflow once (not those this try reported itself)."""
        done = {s.id for s in reported}
        more = [s for s in kept.settled.values() if s.id not in done]
        self._report_fan_in(lambda: kept.queues, lambda: more)

    def _landed_anyway(
        self, batch: list[tuple[Attempt, FinishParams]], accepted: list[bool]
    ) -> list[bool]:
        """After a retry that followed a connection error: the outcomes refused now may be
        those the lost try wrote (errands.landed). Read them back, again while the store
        is out of reach (:meth:`_read_back_until_known`)."""
        refused = [o.id for (_, o), ok in zip(batch, accepted, strict=True) if not ok]
        rows = self._read_back_until_known(refused, "refused outcome(s) whose write")
        if rows is None:
            return accepted
        return [
            ok or landed(rows.get(o.id), o.lease_token, attempt.row.attempt, o.error is not None)
            for (attempt, o), ok in zip(batch, accepted, strict=True)
        ]

    def _confirm(
        self, written: list[tuple[tuple[Attempt, FinishParams], bool | None]]
    ) -> list[tuple[tuple[Attempt, FinishParams], bool | None]]:
        """The outcomes just written of attempts whose ctx.transaction() COMMIT lost its
        reply (:meth:`maybe_landed`): a failure the fence refused was refused because the
        completion landed, if the job reads back completed at that attempt. Such an
        attempt's outcome is its completion (its event, metrics), and what the
        transaction's fan-in did is reported (the settled workflows, the queues it
        released into). A failure that was stored says the completion did not land."""
        if not self._maybe:
            return written
        refused: list[tuple[int, FinishParams, Unsure]] = []
        for i, ((attempt, _), ok) in enumerate(written):
            entry = self._maybe.pop((attempt.id, attempt.token), None)
            if entry is not None and ok is False:
                refused.append((i, *entry))
        if not refused:
            return written
        rows = self._read_back_until_known(
            [written[i][0][0].id for i, _, _ in refused], "job(s) whose transaction's commit"
        )
        if rows is None:
            return written
        confirmed = list(written)
        for i, completion, kept in refused:
            attempt = written[i][0][0]
            row = rows.get(attempt.id)
            if not landed(row, completion.lease_token, attempt.row.attempt, has_error=False):
                continue
            log.info(
                "job %s: its ctx.transaction() had committed (the reply to its COMMIT was "
                "lost): completed",
                attempt.id,
                extra=job_extra(attempt.row),
            )
            confirmed[i] = ((attempt, completion), True)
            self._report_kept(kept)
        return confirmed

    def _read_back_until_known(self, ids: list[int], what: str) -> dict[int, Any] | None:
        """The rows of ``ids``, jobs whose write (``what``, for the log: "... lost its
        reply") may have landed and lost its reply, and which the fence refused when
        written again: read again while the store is out of reach (as the write before
        it was: the jobs' leases are still this worker's, kept by the heartbeat). Read
        once, a second failure of the store reported the attempt as a stale write
        (errands.job.stale_write_rejected: a false alarm), its outcome's event and its
        workflow's settlement never announced. One read-back for the three writes that
        can lose their reply: a ctx.transaction() completion (:meth:`_confirm`), a batch
        of outcomes (:meth:`_landed_anyway`), a give-back (:meth:`_released_anyway`).
        None when the store refuses the read otherwise (logged): the refusal stands."""
        streak = _Streak()
        while True:
            try:
                return read_back(self.app.backend, ids)
            except Exception as exc:
                if not is_transient(exc):
                    log.exception("could not read back %d %s lost its reply", len(ids), what)
                    return None
                report = streak.failed()
                if report == FIRST:
                    log.warning(
                        "could not read back %d %s lost its reply (%s); retrying within %.2f s",
                        len(ids),
                        what,
                        exc,
                        streak.pause,
                        exc_info=True,
                    )
                elif report == STILL:
                    log.warning(
                        "could not read back %d %s lost its reply in %d tries (%s); still retrying",
                        len(ids),
                        what,
                        streak.failures,
                        exc,
                    )
                streak.wait()

    def _report_kept(self, kept: Unsure) -> None:
        """What the fan-in of a write confirmed landed did (read when it failed)."""
        self._report_fan_in(lambda: kept.queues, lambda: list(kept.settled.values()))

    def _give_back(self, items: list[tuple[Attempt, GiveBack]]) -> None:
        """Release the jobs of ``items`` (see :class:`GiveBack`), those of one message
        together, and report each (its log line and event, the attempt forgotten)."""
        by_message: dict[str, list[tuple[Attempt, float]]] = {}
        for attempt, back in items:
            by_message.setdefault(back.message, []).append((attempt, back.delay))
        for message, backs in by_message.items():
            attempts = [attempt for attempt, _ in backs]
            released = self._release(attempts, message, [delay for _, delay in backs])
            if self.on_given_back is None:
                continue
            try:
                self.on_given_back(attempts, released, message)
            except Exception:
                log.exception("error after giving back job(s) %s", [a.id for a in attempts])

    def _release(
        self, attempts: list[Attempt], message: str, delays: list[float]
    ) -> list[bool | None]:
        """The release of ``attempts`` (each due again after its pause in ``delays``),
        written again while the store is out of reach, busy or cannot write, as an
        outcome is (their leases kept by the heartbeat meanwhile: the attempts are still
        this worker's). None for each when the store refuses it otherwise: their leases
        run out and they are rescued."""
        if self.release is None:  # a completer without a worker to release for
            return [None] * len(attempts)
        pause = 0.05
        failures = 0
        next_report = 0.0
        unsure = False  # an earlier try may have committed before its error
        kept = Unsure()  # what the fan-ins of such tries did, as _store keeps it
        while True:
            backend = self.app.backend
            Unsure().take(backend)  # not this release's: an earlier write's, dropped
            try:
                released = self.release(attempts, message, delays)
            except Exception as exc:
                if not is_transient(exc) and not cannot_write_now(exc):
                    log.exception(
                        "could not give back job(s) %s; they are rescued after their lease",
                        [a.id for a in attempts],
                    )
                    return [None] * len(attempts)
                if is_transient(exc) and not cannot_write_now(exc):
                    # It may have committed (its reply lost): what its fan-ins did (a
                    # member cancelled meanwhile ends, and may settle its workflow) is
                    # kept, else the next try's start dropped it and it was never told
                    unsure = True
                    kept.take(backend)
                failures += 1
                now = time.monotonic()
                if failures == 1:
                    log.exception(
                        "could not give back job(s) %s; retrying within %.2f s (leases keep "
                        "them safe)",
                        [a.id for a in attempts],
                        pause,
                    )
                elif now >= next_report:
                    log.warning(
                        "could not give back job(s) %s in %d tries (%s); still retrying",
                        [a.id for a in attempts],
                        failures,
                        exc,
                    )
                if now >= next_report:
                    next_report = now + RETRY_REPORT_EVERY
                _pause(pause * (0.5 + random.random() / 2))
                pause = min(pause * 2, RETRY_PAUSE_MAX)
                continue
            # a member's release may settle its workflow (a cancel requested meanwhile)
            reported = self.fanned_in(store=backend)
            if unsure and not all(released):
                confirmed = self._released_anyway(attempts, released)
                # an earlier try committed (this one's refusals settle nothing): its
                # fan-ins' settlements and wake-ups are told now
                if any(now and not was for was, now in zip(released, confirmed, strict=True)):
                    self._report_earlier(kept, reported)
                released = confirmed
            return released

    def _released_anyway(
        self, attempts: list[Attempt], released: list[bool | None]
    ) -> list[bool | None]:
        """After a release retried past a connection error: a lease refused now may be
        one the lost try gave back (its entry names the attempt's lease token). Read back
        as :meth:`_landed_anyway` reads."""
        rows = self._read_back_until_known([a.id for a in attempts], "release(s) whose write")
        if rows is None:
            return released
        return [
            ok or landed(rows.get(a.id), a.token, a.row.attempt, has_error=True)
            for a, ok in zip(attempts, released, strict=True)
        ]

    def _store_apart(
        self, batch: list[tuple[Attempt, FinishParams]], exc: Exception
    ) -> list[tuple[tuple[Attempt, FinishParams], bool | None]]:
        if len(batch) > 1:
            return [item for one in batch for item in self._store([one])]
        attempt, outcome = batch[0]
        why = clip(str(exc), LOG_LIMIT)
        log.error(
            "job %s: its outcome cannot be stored (%s); recording it as dead",
            attempt.id,
            why,
            extra=job_extra(attempt.row),
        )
        fallback = replace(
            outcome,
            state="dead",
            result_json=None,
            children=(),
            error={
                "attempt": attempt.row.attempt,
                "type": "UnstorableOutcome",
                "message": f"the store refused this attempt's outcome: {clip(str(exc), 500)}",
                "traceback": None,
                "worker": None,
                "kind": "permanent",
            },
        )
        ok: bool | None
        try:
            backend = self.app.backend
            [ok] = backend.job_finish_many([fallback])
            # A member's death may settle its workflow: announced as a batch's fan-in is
            # (its settled event and this worker's wake-up were dropped at the next write)
            self.fanned_in(store=backend)
        except Exception:
            log.exception(
                "job %s: even the fallback outcome failed; its lease expires",
                attempt.id,
                extra=job_extra(attempt.row),
            )
            ok = None  # not stored: not a fence's refusal (it was counted as a stale write)
        return [((attempt, fallback), ok)]

    def stop(self, timeout: float = 10.0) -> None:
        """Write every outcome submitted so far (the queue is FIFO: the stop mark comes
        after them), waiting up to ``timeout``, then end the thread."""
        if self._closing:
            return
        self._closing = True
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)
        if self._thread.is_alive():
            left = max(self.pending - 1, 0)  # the stop mark is not an outcome
            # Not silent: their jobs' leases run out and they are rescued and run again.
            log.error(
                "stopping: %d job outcome(s) still unwritten after %g s (the store is slow "
                "or unreachable); their jobs are rescued after their lease and run again",
                left,
                timeout,
            )


class Unsure:
    """What the workflow fan-ins of a batch's failed tries did, read before the next try
    (whose write begins by dropping it): a try that failed with a transient error may
    have committed (its reply lost), and then these settlements happened. The workflows
    by id (a later try's report of one replaces an earlier's), the queues released.
    (Pickled: a process-pool child sends one with a failure that may have landed.)"""

    def __init__(self) -> None:
        self.settled: dict[int, Any] = {}
        self.queues: set[str] = set()

    def take(self, store: Backend) -> None:
        try:
            for s in store.workflow_take_settled():
                self.settled[s.id] = s
            self.queues |= store.workflow_take_released()
        except Exception:  # (a thread-local read: nothing to retry)
            log.exception("could not read what a failed write's fan-ins did")


def _fan_ins_landed_before(
    batch: list[tuple[Attempt, FinishParams]], accepted: list[bool], confirmed: list[bool]
) -> bool:
    """Whether an earlier try's fan-ins committed: a workflow member's outcome, refused by
    this try, was found written by it (its members' transaction committed, the fan-ins in
    it). Where no outcome is known to be a member (SQLite's claimed rows do not say; it
    writes a whole batch in one transaction), any outcome found written tells."""
    before = [
        bool(o.member)
        for (_, o), was, now in zip(batch, accepted, confirmed, strict=True)
        if now and not was
    ]
    if any(o.member for _, o in batch):
        return any(before)
    return bool(before)


FIRST, STILL = "first", "still"  # what a failed try reports (_Streak.failed)


class _Streak:
    """A run of failed tries of one store call, made again until it goes through: the
    pause before the next try (from 0.05 s, doubling to RETRY_PAUSE_MAX, jittered), and
    when to report: the first failure (FIRST), then one line every RETRY_REPORT_EVERY at
    most (STILL)."""

    __slots__ = ("_next_report", "failures", "pause")

    def __init__(self) -> None:
        self.pause = 0.05
        self.failures = 0
        self._next_report = 0.0

    def failed(self) -> str | None:
        """Count a failure: what to report of it, if anything."""
        self.failures += 1
        now = time.monotonic()
        report = FIRST if self.failures == 1 else STILL if now >= self._next_report else None
        if now >= self._next_report:
            self._next_report = now + RETRY_REPORT_EVERY
        return report

    def wait(self) -> None:
        """The pause before the next try; the one after it twice as long (capped)."""
        _pause(self.pause * (0.5 + random.random() / 2))
        self.pause = min(self.pause * 2, RETRY_PAUSE_MAX)
