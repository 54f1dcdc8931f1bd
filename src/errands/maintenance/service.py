"""The maintenance service: one leader in the cluster rescues, promotes and prunes.

Leadership is a leased row (``errands_leaders``): every worker tries to take or renew it
each tick; it is granted when free, expired, or already ours. A leader that dies or
pauses stops renewing; after ``ttl`` another worker takes over. A paused leader that
wakes up does no harm: every rescue is fenced by the expired lease token *and* by the
lease still being expired, so two rescuers can never rescue one attempt twice.

::

    follower ──(row free or expired)──> leader ──(renew fails / stop)──> follower
                                          │
                        every tick: rescue expired leases, promote due jobs,
                        every prune_interval: delete finished rows past retention
                        (and the usage of fair keys idle that long)

Rescue of one expired lease (the attempt counts, recorded as "worker lost"):

- cancel requested while it ran  -> cancelled
- rescued ``poison_after`` times -> dead, "poison: worker died N times"
- it was the last attempt        -> dead
- otherwise                      -> retryable after the job's backoff

Every duty of a tick (rescue, promotion, cron, pruning) runs on its own: one that fails
is logged and the others still run, and the next tick tries it again. Each expired lease
is planned on its own too: a row whose plan cannot be made (a backoff policy that raises,
a bug) is rescued with the default backoff rather than stopping the rescue of every other
row. User code (on_dead hooks, event subscribers) never runs on this thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from .. import clock
from ..backends.base import (
    PROMOTE_BATCH,
    WORKFLOW_PRUNE_ROWS,
    ExpiredLease,
    ExpiredWait,
    RescueParams,
    WaitTimeoutParams,
    calls_until,
    calls_until_stopped,
)
from ..backends.fair import HALF_LIFE
from ..backends.limits import RATE_PERIOD_MAX
from ..errors import is_transient
from ..hooks import protect_current_thread
from ..landed import landed, read_back
from ..retry import retry_delay
from ..worker.callers import Callers, call_within
from .scheduler import Scheduler

if TYPE_CHECKING:
    from ..app import App

log = logging.getLogger("errands.maintenance")

LEADER_NAME = "maintenance"
TICK_DEFAULT = 1.0
PRUNE_INTERVAL_DEFAULT = 60.0
RESCUE_BATCH = 500
PRUNE_BATCH = 1000
# The rows (workflows, members, edges) one workflow prune batch deletes, about (see
# backends.base.WORKFLOW_PRUNE_ROWS, every workflow_prune call's bound).
PRUNE_WORKFLOW_ROWS = WORKFLOW_PRUNE_ROWS
PRUNE_BATCHES_PER_ROUND = 10
PRUNE_BACKLOG_TICKS = 5  # with a backlog left, prune again after this many ticks
WORKER_FORGET_AFTER = 300.0  # seconds without a heartbeat before a worker leaves the registry
PROMOTE_BATCHES_PER_TICK = 10
DEAD_HOOKS_EVERY = 5.0  # seconds between two looks for on_dead hooks no worker ran
DEAD_HOOKS_BATCH = 100
# A fair key's usage is kept at least this long after its last attempt ended: by then it
# has decayed to 1/1024 (ten half-lives), so forgetting it changes no claim's order (with
# retention=60 s, a key bursting every two minutes was forgotten between its bursts).
FAIR_FORGET_MIN = 10 * HALF_LIFE
# A leader election that keeps failing (the store unreachable) is retried every tick and
# logged once in this many seconds: its traceback the first time, then a line saying it
# still fails (at tick 0.2 it wrote 45 tracebacks in 9 s).
ELECTION_WARN_EVERY = 30.0
# An election waits for its answer (on a helper thread, as the lease keeper's heartbeats
# do) until the leadership it would renew runs out (a follower's: one ttl, all that a
# granted election gives), and at least ELECTION_WAIT_MIN (half the ttl, if less): past
# that it has failed. A store that stops answering without an error (a partition that
# drops packets, a lock another session holds on the leadership's row, SQLite's write
# lock: up to its write_timeout, 60 s) held the election, and the leader went on believing
# it led after the store's leadership had run out and another worker had taken it.
ELECTION_WAIT_MIN = 1.0
ELECTION_CALLERS_MAX = 3  # helper threads; more are only started while earlier ones hang
# A resignation (at a stop) waits for its answer on a helper thread too: until the
# leadership it gives up would run out anyway (past that it is of no use: the store frees
# it itself), at least ELECTION_WAIT_MIN (half the ttl, if less), at most RESIGN_WAIT_MAX.
# One that gets no answer by then is given up and the leadership runs out by its ttl (a
# worker taking it over waits that long, and every duty is fenced). It held the worker's
# stop while the store did not answer: on PostgreSQL up to the TCP timeouts (a minute),
# or for as long as another session held the leadership's row; on SQLite up to its
# write_timeout.
RESIGN_WAIT_MAX = 5.0


def leader_ttl(tick: float, lease: float) -> float:
    """How long leadership lasts without a renewal: five ticks, at least 5 s, but no longer
    than the app's job lease (and at least two ticks). A leader that stops (SIGSTOP, a
    frozen VM, a long pause) stops the rescues too, until it resumes or its leadership
    runs out; held longer than a lease, that wait set the rescue of the jobs of a worker
    that died beside it: with a 2 s lease and a 5 s leadership, the full-size chaos soak
    had 21 rescued jobs wait 4.2-5.7 s, every one of them while the leader was stopped
    (I9's bound: 2 x (lease + poll) = 4.1 s). Each duty is fenced, so a leader that
    resumes after losing leadership does no harm."""
    return max(min(max(5.0 * tick, 5.0), lease), 2.0 * tick)


class Maintenance:
    def __init__(
        self,
        app: App,
        worker_id: str,
        *,
        tick: float = TICK_DEFAULT,
        prune_interval: float = PRUNE_INTERVAL_DEFAULT,
    ) -> None:
        self.app = app
        self.worker_id = worker_id
        self.tick = tick
        self.ttl = leader_ttl(tick, app.lease)
        self.prune_interval = prune_interval
        self.is_leader = False
        self._leader_lock = threading.Lock()  # is_leader's changes, each announced once
        self._term = 0  # counts the times this worker took the leadership (the cron's terms)
        self.rescued = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="errands-maintenance", daemon=True)
        self._next_prune = 0.0
        self._next_dead_hooks = 0.0
        self.dead_hooks_taken_over = 0
        self._unsure: list[tuple[RescueParams, ExpiredLease]] = []  # reply lost: did it land?
        self._unsure_settled: list[Any] = []  # the workflows that batch's fan-ins settled
        self._renewed_at = 0.0  # when the leadership was last taken or renewed (monotonic)
        # until when the store surely names this worker leader: the last election that
        # granted it was sent then, plus the ttl (errands.clock)
        self._leader_until = 0.0
        self._election_failures = 0  # in a row
        self._election_warned_at = float("-inf")  # time.monotonic()
        self._elections = Callers("errands-election", ELECTION_CALLERS_MAX)
        # a slot seen within a tick and a failover of its time is on time
        self.scheduler = Scheduler(app, grace=self.ttl + tick)

    def start(self) -> None:
        self._thread.start()

    def stop(self, wait: float = 10.0) -> None:
        """Stop the thread (waiting ``wait`` seconds for a duty in flight) and resign. A
        duty still running then ends the tick without taking the leadership again."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=wait)
        self._resign()
        self._elections.stop()

    def _resign(self) -> None:
        """Give the leadership up, once: stop() and the thread may both get here (stop()
        when its wait ran out while the thread was inside an election, the thread when
        that election returned), and ``errands.leader.resigned`` was emitted twice."""
        with self._leader_lock:
            if not self.is_leader:
                return
            self.is_leader = False
        try:
            self._leader_resign()
        except Exception as exc:
            log.warning(
                "could not resign leadership (%s); it expires in %.0f s",
                exc,
                max(self._leader_until - clock.now(), 0.0),
            )
        self.app.events.emit("errands.leader.resigned", worker_id=self.worker_id)

    def _leader_resign(self) -> None:
        """Give the leadership up in the store, on a helper thread of its own, its answer
        waited for as long as it can help (see RESIGN_WAIT_MAX): TimeoutError past that.
        Called from stop() or this service's thread, at most once or twice a run."""
        floor = min(ELECTION_WAIT_MIN, self.ttl / 2)
        wait = min(max(self._leader_until - clock.now(), floor), RESIGN_WAIT_MAX)
        deadline = time.monotonic() + wait
        backend, worker_id = self.app.backend, self.worker_id

        def resign() -> None:
            with calls_until(deadline):
                backend.leader_resign(LEADER_NAME, worker_id)

        call_within(resign, wait, "leadership resignation", "errands-resign")

    def _run(self) -> None:
        protect_current_thread()
        try:
            while not self._stop.is_set():
                try:
                    self.run_once()
                except Exception:
                    log.exception("maintenance tick failed; retrying next tick")
                self._stop.wait(self.tick)
        finally:
            # An election that returned after stop() gave up waiting for this thread
            # left it leader; resign here rather than hold it until it expires.
            self._resign()

    def run_once(self) -> None:
        if not self._elect():
            return
        for name, duty in (
            ("rescue", self.rescue),
            ("signal timeouts", self.expire_waits),
            ("promotion", self._promote_due),
            ("cron", lambda: self.scheduler.run_once(go_on=self._still_leader, leading=self._term)),
            ("pruning", self._prune_when_due),
            ("on_dead hooks", self._dead_hooks_when_due),
            ("write-ahead log", self.app.backend.wal_trim),  # (a file's size, mostly)
        ):
            if not self._still_leader():
                return
            self._duty(name, duty)

    def _elect(self) -> bool:
        """Take or renew the leadership; True while this worker holds it. Never once
        stopped: a duty that outlived stop()'s wait took the leadership stop() had just
        resigned, and held it, duties and all, on a worker on its way out."""
        if self._stop.is_set():
            return False
        sent = clock.now()  # a lease: counts a suspend (errands.clock)
        try:
            leader = self._ask(sent)
        except Exception as exc:
            self._election_failed(exc)
            return False
        if self._election_failures:
            log.info(
                "maintenance leader election works again (after %d failed)",
                self._election_failures,
            )
            self._election_failures, self._election_warned_at = 0, float("-inf")
        self._renewed_at = clock.now()
        if leader:
            self._leader_until = sent + self.ttl
        if leader and self._stop.is_set():  # stop() came while this was asked
            with contextlib.suppress(Exception):  # (else it expires after the ttl)
                self._leader_resign()
            leader = False
        with self._leader_lock:  # stop() may have resigned meanwhile: one event each way
            changed, self.is_leader = leader != self.is_leader, leader
        if changed and leader:
            self._term += 1  # a new term: the scheduler's last look was another's
        if changed:
            self.app.events.emit(
                "errands.leader.elected" if leader else "errands.leader.resigned",
                worker_id=self.worker_id,
            )
        return leader

    def _leadership_end(self) -> float:
        """When the leadership this worker holds runs out, on time.monotonic()'s scale
        (it moves as each renewal pushes it back)."""
        return time.monotonic() + max(self._leader_until - clock.now(), 0.0)

    def _answer_within(self, sent: float) -> float:
        """How long an election sent at ``sent`` waits for its answer: until the
        leadership it would renew runs out (a follower's: one ttl), at least
        ELECTION_WAIT_MIN (half the ttl, if less)."""
        end = self._leader_until if self.is_leader else sent + self.ttl
        return max(end - sent, min(ELECTION_WAIT_MIN, self.ttl / 2))

    def _ask(self, sent: float) -> bool:
        """The election, on a helper thread, its answer waited for as long as it can help
        (see ELECTION_WAIT_MIN): TimeoutError past that. A late answer is never read: the
        next election asks again. Its wait for a pool connection ends by then too."""
        wait = self._answer_within(sent)
        deadline = time.monotonic() + wait
        backend, worker_id, ttl = self.app.backend, self.worker_id, self.ttl

        def elect() -> bool:
            with calls_until(deadline):
                return backend.leader_attempt_elect(LEADER_NAME, worker_id, ttl)

        return self._elections.call(elect, wait, "leader election")

    def _election_failed(self, exc: Exception) -> None:
        """An election raised (the store unreachable, a bug): this tick runs no duty. Said
        once an interval while they go on failing (the first with its traceback). A leader
        stays one until its last granted election's ttl has run out (the store names it
        until then, and no other worker can take it); then it steps down: ``is_leader``
        false, ``errands.leader.resigned`` (the errands_leader gauge 0). It kept claiming
        the leadership, gauge 1, while another worker had taken it over."""
        self._election_failures += 1
        now = time.monotonic()
        if self._election_failures == 1:
            self._election_warned_at = now
            log.warning(
                "maintenance leader election failed (%s); retrying every %g s, running no "
                "maintenance duty until one succeeds",
                exc,
                self.tick,
                exc_info=exc,
            )
        elif now >= self._election_warned_at + ELECTION_WARN_EVERY:
            self._election_warned_at = now
            log.warning(
                "maintenance leader election still fails (%d in a row): %s",
                self._election_failures,
                exc,
            )
        else:
            log.debug("maintenance leader election failed again (%s)", exc)
        if clock.now() < self._leader_until:
            return  # still ours in the store
        with self._leader_lock:
            if not self.is_leader:
                return
            self.is_leader = False
        log.warning(
            "maintenance leadership not renewed for %g s (its ttl): stepping down; another "
            "worker may take it over",
            self.ttl,
        )
        self.app.events.emit("errands.leader.resigned", worker_id=self.worker_id)

    def _still_leader(self) -> bool:
        """Between two duties of a tick (and two prune batches): renew the leadership
        once a third of it has gone, so that a slow tick (a big rescue batch, a prune, a
        store waiting on a lock) keeps it rather than leave another worker to take it and
        run the same duties beside this one (every duty is fenced, but twice is waste).
        A third of it counts from when the last granted election was sent (the
        leadership's end, which bounds each duty's waits): counted from its answer, an
        election that waited 1.5 s of a 2 s leadership left the next duties 0.05 s to
        wait for the store while the leader asked for nothing more."""
        now = clock.now()
        if now - self._renewed_at < self.ttl / 3 and (
            not self.is_leader or self._leader_until - now > 2 * self.ttl / 3
        ):
            return self.is_leader
        return self._elect()

    def _duty(self, name: str, duty: Callable[[], object]) -> bool:
        """Run one duty of the tick; a failure is logged and never skips the others. Its
        store calls wait for a connection (SQLite: for the write lock; PostgreSQL: for a
        lock another session holds, by lock_timeout) no later than the leadership's end
        (:meth:`_leadership_end`): a duty waiting on a file another session held locked
        waited up to write_timeout (60 s by default), and on PostgreSQL behind a row or
        table lock for as long as it was held, while the leadership ran out, the leader
        never asking again nor stepping down, and it went on believing it led (its
        errands_leader gauge 1) beside the next leader. A stop asked meanwhile ends its
        wait for SQLite's write lock at once (base.calls_until_stopped): stop() waits 10 s
        for this thread, and a duty behind a file locked for longer kept it alive past
        the stop (a CI run's resignation test met it)."""
        try:
            with calls_until(self._leadership_end), calls_until_stopped(self._stop):
                duty()
            return True
        except Exception as exc:
            if self._stop.is_set():  # cut short by the stop: said, without the traceback
                log.info("maintenance %s ended by the stop (%s)", name, exc)
            else:
                log.exception("maintenance %s failed; the other duties go on", name)
            return False

    def _promote_due(self) -> int:
        """Relabel due scheduled and retryable jobs as available, a batch a statement, a
        few batches a tick (claims take them as they are: a backlog may take ticks)."""
        total = 0
        for _ in range(PROMOTE_BATCHES_PER_TICK):
            done = self.app.backend.job_promote_due(PROMOTE_BATCH)
            total += done
            if done < PROMOTE_BATCH or not self._still_leader():
                break
        return total

    def _dead_hooks_when_due(self) -> None:
        """Every DEAD_HOOKS_EVERY seconds: run the on_dead hooks of the deaths that no
        worker marked done within the app's ``dead_hooks_grace`` (their worker was killed
        before it ran them, or fell that far behind). They run on this process's hook lane,
        never on this thread; an app without hooks only forgets records of jobs that are
        no longer dead."""
        now = time.monotonic()
        if now < self._next_dead_hooks:
            return
        self._next_dead_hooks = now + DEAD_HOOKS_EVERY
        app = self.app
        due = app.backend.dead_hooks_due(
            app.dead_hooks_grace, DEAD_HOOKS_BATCH if app.dead_hooks else 0
        )
        if due:
            log.warning(
                "running the on_dead hooks of %d dead job(s) that no worker ran within %g s "
                "(it stopped or fell behind), e.g. job %s",
                len(due),
                app.dead_hooks_grace,
                due[0],
            )
            self.dead_hooks_taken_over += len(due)
        for job_id in due:
            app.dead_hooks_later(job_id)

    def _prune_when_due(self) -> None:
        if time.monotonic() >= self._next_prune:
            self._next_prune = time.monotonic() + self.prune_interval
            try:
                self.prune()
            except Exception:
                self._next_prune = 0.0  # failed: the next tick tries again, as for any duty
                raise

    def rescue(self) -> int:
        backend = self.app.backend
        count = self._confirm_unsure()
        expired = backend.job_list_expired(RESCUE_BATCH)
        if not expired:
            return count
        plans: list[RescueParams] = []
        by_id = {lease.id: lease for lease in expired}
        broken: set[str] = set()  # job types whose backoff failed in this batch
        budget = time.monotonic() + self.ttl / 3
        for lease in expired:
            # Past a third of the leadership spent asking backoff policies (one slow but
            # in time, 0.5 s x 500 rows: minutes before anything was written), the rest
            # of the batch takes the default backoff.
            if time.monotonic() > budget:
                broken.add(lease.name)
            try:
                plans.append(self._plan(lease, broken))
            except Exception:  # pragma: no cover - _plan calls nothing that raises
                log.exception("job %s: planning its rescue failed; retrying it later", lease.id)
        try:
            backend.workflow_take_settled()
            done = backend.job_rescue_many(plans)
            self.app.workflows_settled()
        except Exception as exc:
            if is_transient(exc):  # it may have committed: look next tick (errands.landed)
                self._unsure = [(p, by_id[p.id]) for p in plans]
                # what its fan-ins settled, announced if it landed (the next rescue's
                # write begins by dropping them)
                self._unsure_settled = _taken_settled(backend)
            raise
        for plan, ok in zip(plans, done, strict=True):
            if ok:  # else its heartbeat landed first, or another rescuer won
                count += self._rescued(plan, by_id[plan.id])
        self.rescued += count
        return count

    def _confirm_unsure(self) -> int:
        """The rescues of a batch whose reply was lost that did land: their events and
        on_dead hooks are due now (those that did not land are simply expired again)."""
        unsure = self._unsure
        if not unsure:
            return 0
        rows = read_back(self.app.backend, [plan.id for plan, _ in unsure])
        settled, self._unsure_settled = self._unsure_settled, []
        self._unsure = []  # after the read: a read that fails keeps them for the next tick
        count = 0
        for plan, lease in unsure:
            if landed(rows.get(plan.id), plan.lease_token, plan.error["attempt"], True):
                count += self._rescued(plan, lease)
        self.rescued += count
        if count and settled:  # the batch's one transaction committed: its fan-ins too
            try:
                self.app.workflows_settled(settled=settled)
            except Exception:  # committed: an event missed is never a reason to write again
                log.exception("could not report the workflows a rescue settled")
        return count

    def _rescued(self, plan: RescueParams, lease: ExpiredLease) -> int:
        """A rescue that landed: its events, and the on_dead hooks of a job it made dead."""
        fields = {
            "job_id": lease.id,
            "job_name": lease.name,
            "queue": lease.queue,
            "attempt": lease.attempt,
            "max_attempts": lease.max_attempts,
        }
        self.app.events.emit(
            "errands.job.rescued",
            **fields,
            state=plan.state,
            reason=plan.error["message"],
            worker=lease.lease_owner,
        )
        if plan.state == "dead":
            self.app.events.emit(
                "errands.job.dead",
                **fields,
                duration=None,
                error_type=plan.error["type"],
                error_message=plan.error["message"],
                traceback=None,
                reason=plan.error["kind"],
            )
            self.app.dead_hooks_later(plan.id)
        return 1

    def _plan(self, lease: ExpiredLease, broken: set[str] | None = None) -> RescueParams:
        """What becomes of one expired lease (see the module doc)."""
        rescues = lease.rescues + 1
        state: Literal["retryable", "dead", "cancelled"]
        message = (
            f"worker {lease.lease_owner} lost its lease on attempt {lease.attempt} "
            "(killed, crashed, paused or cut off from the database)"
        )
        if lease.cancel_requested:
            state, delay = "cancelled", 0.0
        elif rescues >= self.app.poison_after:
            state, delay = "dead", 0.0
            message = f"poison: worker died {rescues} times on this job; last: {message}"
        elif lease.attempt >= lease.max_attempts:
            state, delay = "dead", 0.0
        else:
            definition = self.app.registry.get(lease.name)
            policy = definition.backoff if definition is not None else None
            state, delay = (
                "retryable",
                retry_delay(policy, lease.attempt, job=lease.name, broken=broken),
            )
        error: dict[str, Any] = {
            "attempt": lease.attempt,
            "type": "WorkerLost",
            "message": message,
            "traceback": None,
            "worker": lease.lease_owner,
            "kind": "poison" if message.startswith("poison") else "worker_lost",
            "lease_token": lease.lease_token,  # which attempt it records (errands.landed)
        }
        return RescueParams(lease.id, lease.lease_token, state, error, delay, fair=lease.fair)

    def expire_waits(self) -> int:
        """End waits for signals past their timeout: each is a failed attempt (kind
        ``signal_timeout``), retried with the job's backoff, dead when out of attempts. A
        signal that lands first wins (the write is fenced by the job still waiting)."""
        backend = self.app.backend
        expired = backend.job_list_expired_waits(RESCUE_BATCH)
        broken: set[str] = set()  # job types whose backoff failed in this batch
        budget = time.monotonic() + self.ttl / 3  # as in rescue
        plans = []
        for wait in expired:
            if time.monotonic() > budget:
                broken.add(wait.name)
            plans.append(self._plan_timeout(wait, broken))
        backend.workflow_take_settled()  # (nothing left over from an earlier call)
        done = backend.job_expire_waits(plans)
        # A member dead by its wait's timeout can settle its workflow: announced, as a
        # rescue's are (its settlement was dropped by the next rescue, never emitted).
        self.app.workflows_settled()
        count = 0
        for wait, plan, ok in zip(expired, plans, done, strict=True):
            if not ok:
                continue
            count += 1
            fields = {
                "job_id": wait.id,
                "job_name": wait.name,
                "queue": wait.queue,
                "attempt": wait.attempt + 1,
                "max_attempts": wait.max_attempts,
            }
            self.app.events.emit(
                "errands.job.wait_timed_out", **fields, signal=wait.wait_signal, state=plan.state
            )
            if plan.state == "dead":
                self.app.events.emit(
                    "errands.job.dead", **fields, duration=None, error_type="SignalTimeout",
                    error_message=plan.error["message"], traceback=None, reason="signal_timeout",
                )  # fmt: skip
                self.app.dead_hooks_later(wait.id)
        return count

    def _plan_timeout(self, wait: ExpiredWait, broken: set[str] | None = None) -> WaitTimeoutParams:
        attempt = wait.attempt + 1  # the suspension gave the attempt back: charge it now
        state: Literal["retryable", "dead"] = "dead"
        delay = 0.0
        if attempt < wait.max_attempts:
            definition = self.app.registry.get(wait.name)
            policy = definition.backoff if definition is not None else None
            state, delay = "retryable", retry_delay(policy, attempt, job=wait.name, broken=broken)
        error: dict[str, Any] = {
            "attempt": attempt,
            "type": "SignalTimeout",
            "message": f"no signal {wait.wait_signal!r} arrived before the wait's timeout",
            "traceback": None,
            "worker": None,
            "kind": "signal_timeout",
        }
        return WaitTimeoutParams(wait.id, wait.wait_signal, state, error, delay, wait.attempt)

    def _forget_idle_fair_keys(self) -> None:
        """Fair keys idle as long as the retention (at least FAIR_FORGET_MIN) keep no usage
        row: a key per user would otherwise grow the table, and every tenants view, by
        every user ever seen. A few batches a round, as for the jobs."""
        idle = max(self.app.retention, FAIR_FORGET_MIN)
        for _ in range(PRUNE_BATCHES_PER_ROUND):
            if (
                self._stop.is_set()
                or self.app.backend.fair_usage_prune(idle, PRUNE_BATCH) < PRUNE_BATCH
            ):
                break

    def prune(self) -> int:
        self.app.backend.worker_prune(WORKER_FORGET_AFTER)
        self.app.backend.rate_log_prune(RATE_PERIOD_MAX)
        if self.app.retention <= 0:
            return 0
        total = 0
        # A bounded number of small batches per round: a big backlog (a retention just
        # shortened, a long outage) drains over several rounds instead of hammering the
        # store in one long burst; a full last batch brings the next round forward.
        for _ in range(PRUNE_BATCHES_PER_ROUND):
            if self._stop.is_set() or (self.is_leader and not self._still_leader()):
                break  # (called outside a tick, by a test, it prunes as asked)
            jobs = self.app.backend.job_prune(self.app.retention, PRUNE_BATCH)
            workflows = self.app.backend.workflow_prune(
                self.app.retention, PRUNE_BATCH, PRUNE_WORKFLOW_ROWS
            )
            total += jobs + workflows
            # A workflow batch stops at its rows: however few workflows went, more may
            # wait (and the members of those that went are prunable now).
            if jobs < PRUNE_BATCH and not workflows:
                break
        else:
            self._next_prune = time.monotonic() + self.tick * PRUNE_BACKLOG_TICKS
        if total:
            self.app.events.emit(
                "errands.maintenance.pruned", worker_id=self.worker_id, count=total
            )
        # Last: a failure here (retried next tick) never holds up the jobs' pruning.
        self._forget_idle_fair_keys()
        return total


def _taken_settled(backend: Any) -> list[Any]:
    """The workflows this thread's last write settled, as the backend reported them."""
    try:
        return list(backend.workflow_take_settled())
    except Exception:  # (a thread-local read)
        log.exception("could not read what a failed rescue's fan-ins settled")
        return []
