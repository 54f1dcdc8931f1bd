"""The worker: a claim loop that takes jobs sized to its free slots, and its services.

::

    claim loop (this thread) ──ClaimRound──> Dispatcher ──> handler thread / event loop /
         ^  wakes on a freed slot                            child process
         │                                                        │ returns or raises
         └──────────── slot freed <── OutcomeRecorder <───────────┘
                                           │ fenced outcome (never raises once decided)
                                           v
    LeaseKeeper: heartbeats, lost leases,  Completer ──batch──> the store
    cancels, timeouts, self-fencing        Maintenance: leader election, rescue, promotion,
    HookRunner: on_dead hooks and event    pruning, cron
    subscribers, off every thread above

Each part is one module: :mod:`.claiming` (a round that starts or returns everything it
claimed), :mod:`.dispatch` (where user code runs), :mod:`.recorder` (the outcome of an
attempt), :mod:`.timeouts`, :mod:`.completer`, :mod:`.leases`, and :mod:`errands.hooks`.
No user code runs on the claim loop, the completer, the lease keeper or the maintenance
thread.

With quick handlers a claim also takes up to ``prefetch`` jobs beyond the free slots;
they wait in the thread pool's queue, and the handler thread that takes one up prepares
it (payload, Context) and runs it, while the claim loop waits on its next claim.

Rescued jobs (suspects) may be what killed their last worker. With the worker's app path
known (``errands worker module:app``), up to ``suspect_lanes`` (default: the concurrency)
run at once, each in a child process of its own, so a job that crashes its process takes
nothing else with it; a spare child is kept started ahead of need, so a burst of rescued
jobs does not wait for child start-ups. Without an app path (an embedded worker), one runs
at a time, never beside another suspect.

A worker serving a fair queue keeps an **express lane**: ``express`` handler threads
beyond its slots (default: half the concurrency, rounded down), for the jobs of
fair keys with nothing running and within their share, used only when every slot is
busy. A claim names such jobs; one that finds no free slot starts on the lane at once,
and with every slot busy a notification (a job enqueued) makes the claim loop claim for
the lane first, ahead of its regular claim. So a quiet tenant's job behind another
tenant's backlog starts as on an idle queue, rather than waiting for a slot the backlog
keeps full.

Graceful stop (SIGTERM/SIGINT, DESIGN §7): stop claiming, and give prefetched jobs back
(never begun: nothing recorded on them, their place in the queue kept); let in-flight
handlers finish within ``grace`` seconds while heartbeats keep their leases; take what
still runs over (in one step with its handler's decision: see Attempt.stop_for_shutdown)
and stop it (as a timeout does), and release each job (back to available, the attempt
not charged, the release recorded on the job) once it runs no durable step (up to
``abandon_after``, its lease still heartbeated); flush outcomes; let queued hooks run;
resign leadership. Each store write of the stop waits for its answer a bounded time (the
releases: RELEASE_WAIT after the last one began, see _StopReleases); a job whose release
is given up on is rescued once its lease runs out. A second signal exits the process at
once; those leases then expire and are rescued.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import select
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .. import clock
from ..backends import redact_url
from ..backends.base import (
    LeaseRef,
    QueueClaim,
    QueueSettings,
    WorkerInfo,
    calls_until,
    calls_until_stopped,
)
from ..definition import check_name
from ..errors import ConfigurationError, is_transient
from ..fleet import warn_unserved_periodic
from ..hooks import protect_current_thread
from ..jobs import JobRow
from ..maintenance import Maintenance
from ..observability.logcontext import install_record_factory, job_extra, lockless_line
from .callers import call_within
from .claiming import Claimer
from .completer import Completer
from .dispatch import Dispatcher
from .execution import SHUTDOWN, Attempt
from .leases import MIN_INTERVAL as MIN_BEAT
from .leases import LeaseKeeper
from .process_pool import ProcessRunner
from .recorder import OutcomeRecorder, job_fields
from .runners import LoopRunner, ThreadRunner
from .signals import SignalRelay
from .timeouts import INTERRUPT_AFTER, abandon, interrupt_threads, on_deadline, on_fence

if TYPE_CHECKING:
    from ..app import App

log = logging.getLogger("errands.worker")

CONCURRENCY_DEFAULT = 10
# The most handler threads a worker runs for its slots (-c, or the sum of -q's per-queue
# limits), and the most its express lane adds: each is a thread, started with the worker.
# concurrency=10**9 started some 22,000 threads, then failed with "can't start new
# thread" and left them running. More work at once: more worker processes (--processes).
CONCURRENCY_MAX = 10_000
THREADS_ADVICE = (
    "each is a handler thread, started with the worker); for more jobs at once run more "
    "worker processes (--processes N, or more workers)"
)
GRACE_DEFAULT = 30.0
POLL_INTERVAL_DEFAULT = 1.0
# After a claim a notification woke, the worker looks once more this long after the
# store's notification window (PostgreSQL's notify_window: an enqueuing process sends at
# most one NOTIFY per queue per window, so a job committed within it after a notified one
# sent none). It was a flat 20 ms, four times the default window: a job enqueued a few
# milliseconds after another waited up to 20 ms more (the PostgreSQL fair queue's idle
# dwell p99, 29 ms with quiet tenants enqueueing 50 jobs a second).
RECHECK_MARGIN = 0.005
RECHECK_AFTER_NOTIFY_MIN = 0.01
CLAIM_RETRY_MAX = 2.0  # seconds: failed claims are retried after poll_interval, doubling to this
THROTTLE_WARN_EVERY = 60.0  # seconds between two warnings that outcomes are written slowly
BATCH_GATHER = 0.005  # with a backlog, wait up to this long for a batch's worth of free slots
# A prefetched job waits for a handler thread at most about this long on average: the
# worker holds concurrency * PREFETCH_HORIZON / (mean handler time) jobs beyond its slots.
PREFETCH_HORIZON = 0.05
PREFETCH_MULTIPLIER = 4  # the default prefetch: this many jobs per slot, at most
# The most jobs a worker claims beyond its slots (--prefetch, and the defaults: 4 x -c, a
# fair queue's 16 x -c). Each is a leased, running row the worker holds in memory and
# renews with the others in its one heartbeat statement, every third of a lease, and one
# claim statement takes the slots' and the prefetch's rows at once; twice as many
# outcomes may wait to be written (_unwritten_max). Unbounded, a typo (--prefetch
# 1000000) let one worker with quick handlers claim a whole backlog while the others
# idled (had it died, all of it waited for its leases to run out). 10 x the largest
# prefetch measured best (1,024 at -c 32, docs/benchmarks.md).
PREFETCH_MAX = 10_000
PREFETCH_ADVICE = (
    "each is a job claimed beyond -c and held, leased, until a handler thread is free); "
    "for more jobs at once raise -c or run more workers; --prefetch 0 turns it off"
)
# A prefetching fair queue's (see _fair_prefetch_now): this many jobs per slot, at most.
# Its claim reads a window of keys and ranks them, ~2.5 x the time of a plain claim, and
# a worker whose one claimer waits for it takes about half its room per claim (the other
# half runs meanwhile): with the plain queues' 4 x -c, a fair queue of 1,000 keys and
# no-op jobs ran at 0.5 x a plain one; 2 ms jobs at 0.8 x (bench/fairness.py).
FAIR_PREFETCH_MULTIPLIER = 16
# The default express lane of a worker serving a fair queue: one handler thread per this
# many slots (none below that: -c 1 still runs one job at a time). Half: the noisy-
# neighbour benchmark's quiet traffic (50 tenants, a 50 ms job a second each) needs 2.5
# threads on average; -c / 4 left its dwell 5-8 x the idle queue's, -c / 2 within 2 x.
EXPRESS_SHARE = 2
# After an express claim that found nothing, the next waits at least this long, whatever
# wakes the claim loop: on SQLite every commit to the file does (the completer's own).
EXPRESS_GAP = 0.01
ABANDON_AFTER_DEFAULT = 10.0
# Suspects: a spare child process is started with the worker, then kept (children idle
# longer than SUSPECT_IDLE_RETIRE beyond the spare are stopped). The worker claims no
# suspect before its first child is up: on a loaded machine the forkserver's start-up
# (importing the app) took 12-14 s, and suspects claimed meanwhile waited for it, claimed,
# while warm workers could have run them. Started with the worker (it was 5 s after, with
# an early start when the store showed a rescue coming, until 2026-12-04): the forkserver
# and the spare cost a worker's start ~0.5 s more CPU, once, but a worker restarted after
# a crash, or a fleet restarted by a deploy that killed its predecessors, is the one the
# rescued jobs come to a lease later; with a 2 s lease (the chaos soak's) they waited for
# its children (15 of the 19 late rescued claims of a full-size PostgreSQL run, all in
# its first 15 s).
SUSPECT_SPARE = 1
SUSPECT_IDLE_RETIRE = 60.0
HOOK_DRAIN = 5.0  # seconds a graceful stop waits for queued on_dead hooks and events
# A stop's last store call, leaving the registry, waits this long for its answer (on a
# helper thread, as the resignation does: errands.worker.callers), then goes without: the
# registry shows the worker's heartbeat stopped and forgets it after WORKER_FORGET_AFTER.
# A store that stopped answering (a partition with no RST, SQLite's write lock held
# elsewhere) held the stop up to its TCP timeouts or write_timeout.
DEREGISTER_WAIT = 5.0
# A stop gives the jobs it took over back (released, uncharged) in store writes made each
# on a helper thread of its own as soon as the stop makes it (see _StopReleases), their
# answers waited for, all together, until this long after the last one began at most.
# Past that the worker exits without them: their leases run out (no heartbeat renews them
# any more) and the jobs are rescued. A store that stopped answering (a lock held
# elsewhere: SQLite's write lock, a job's row under PostgreSQL's FOR UPDATE; a partition
# with no RST) held the stop with the write, up to SQLite's write_timeout or the TCP
# timeouts, or for as long as the lock was held; and with one helper for all of them, a
# release waiting for one job's row lock made every later one of the stop fail untried.
RELEASE_WAIT = 5.0
EXIT_NOW_CODE = 1


def parse_queues(spec: str | Sequence[str] | Mapping[str, int] | None) -> dict[str, int | None]:
    """``"emails=10,payments=2"`` or ``["emails", "payments"]`` -> {queue: limit or None}.

    None (no ``-q``) is ``{}``: the worker serves every queue the app's jobs use. A spec
    that names no queue (``""``, ``","``, ``"=5"``: an unset ``$QUEUE``, say) is an error:
    it served every queue too, silently."""
    if spec is None:
        return {}
    if isinstance(spec, Mapping):
        items: list[tuple[str, int | None]] = [(str(k), v) for k, v in spec.items()]
    else:
        parts = spec.split(",") if isinstance(spec, str) else list(spec)
        items = []
        for part in parts:
            name, _, limit_text = part.strip().partition("=")
            if not name.strip():
                if limit_text.strip():
                    raise ConfigurationError(
                        f"queue spec {part!r}: no queue name before '='; write name=limit, "
                        "as in emails=10"
                    )
                continue  # a stray comma: "emails,,payments"
            if limit_text:
                try:
                    value: int | None = int(limit_text)
                except ValueError:
                    raise ConfigurationError(
                        f"queue spec {part!r}: the limit after '=' must be a whole number, "
                        "as in emails=10"
                    ) from None
            else:
                value = None
            items.append((name.strip(), value))
    result: dict[str, int | None] = {}
    for name, limit in items:
        check_name("queue", name)  # a typo would serve a queue no job can be in
        if limit is not None:
            check_count(limit, f"queue {name!r}: its concurrency (-q {name}=N)")
        result[name] = limit
    if not result:
        raise ConfigurationError(
            f"the queues to serve, {spec!r}, name no queue (an empty -q, such as an unset "
            "$QUEUE?): name them, as in -q emails,payments, or leave -q out to serve every "
            "queue the app's jobs use"
        )
    return result


def check_count(
    value: object,
    what: str,
    *,
    least: int = 1,
    most: int = CONCURRENCY_MAX,
    advice: str = THREADS_ADVICE,
) -> int:
    """A count option, checked: an int (not a bool: True ran as 1) from ``least`` to
    ``most`` (by default a number of handler threads, at most CONCURRENCY_MAX); ``what``
    names the option in the error, ``advice`` ends it: why the bound (it follows "(") and
    what to do instead."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigurationError(
            f"{what} must be a whole number (an int) of at least {least}, got {value!r}"
        )
    if value > most:
        raise ConfigurationError(f"{what} is {value:,}: at most {most:,} ({advice}")
    return value


def check_prefetch(value: object) -> int:
    """``prefetch`` / ``--prefetch``, checked: an int from 0 (off) to PREFETCH_MAX."""
    return check_count(
        value, "prefetch (--prefetch)", least=0, most=PREFETCH_MAX, advice=PREFETCH_ADVICE
    )


def check_counts(
    queues: str | Sequence[str] | Mapping[str, int] | None,
    concurrency: int | None,
    express: int | None,
    prefetch: int | None = None,
) -> None:
    """-q, -c, --express and --prefetch checked as a worker checks them, without starting
    one (the CLI, before it starts --processes N children: each failed on its own, five
    times)."""
    limits = parse_queues(queues)
    per_queue = [v for v in limits.values() if v is not None]
    if concurrency is not None:
        check_count(concurrency, "concurrency (-c)")
    elif per_queue and len(per_queue) == len(limits):
        check_count(sum(per_queue), "concurrency (the sum of -q's per-queue limits)")
    if express is not None:
        check_count(express, "express (--express)", least=0)
    if prefetch is not None:
        check_prefetch(prefetch)


def _worker_seconds(value: float, option: str, *, above_zero: bool = True) -> float:
    """A worker's duration option, checked: a finite number of seconds, more than 0 where
    ``above_zero`` (else 0 or more). NaN compares false with every bound, so a bounds check
    alone let ``poll_interval=nan`` through (a worker that never slept between claims) and
    ``grace=inf`` (a shutdown that never ended; ``abandon_after=inf`` too, once a step
    still running held it)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < 0 or (above_zero and value == 0):
        raise ConfigurationError(
            f"{option}={value!r}: give a finite number of seconds "
            f"{'above 0' if above_zero else '(0 or more)'}, such as {option}=1"
        )
    return float(value)


class Worker:
    recorder_class: type[OutcomeRecorder] = OutcomeRecorder  # the test tools add to it

    def __init__(
        self,
        app: App,
        *,
        queues: str | Sequence[str] | Mapping[str, int] | None = None,
        concurrency: int | None = None,
        grace: float = GRACE_DEFAULT,
        poll_interval: float = POLL_INTERVAL_DEFAULT,
        maintenance: bool = True,
        maintenance_tick: float | None = None,
        worker_id: str | None = None,
        abandon_after: float = ABANDON_AFTER_DEFAULT,
        pool: str = "thread",
        app_path: str | None = None,
        prefetch: int | None = None,
        suspect_lanes: int | None = None,
        express: int | None = None,
    ) -> None:
        self.app = app
        self.id = worker_id or f"w-{secrets.token_hex(4)}"
        limits = parse_queues(queues)
        if not limits:
            known = {d.queue for d in app.registry.values()} | {app.default_queue}
            limits = dict.fromkeys(sorted(known))
        self.queue_limits = limits
        per_queue = [v for v in limits.values() if v is not None]
        if concurrency is None:
            concurrency = (
                sum(per_queue)
                if per_queue and len(per_queue) == len(limits)
                else CONCURRENCY_DEFAULT
            )
            what = "concurrency (the sum of -q's per-queue limits)"
        else:
            what = "concurrency (-c)"
        # Before any thread starts (the slots' and the express lane's start below).
        self.concurrency = concurrency = check_count(concurrency, what)
        if express is not None:
            check_count(express, "express (--express)", least=0)
        self.grace = grace = _worker_seconds(grace, "grace", above_zero=False)
        poll_interval = _worker_seconds(poll_interval, "poll_interval")
        # It bounds a stop's wait for the steps still running, as grace bounds the rest:
        # abandon_after=inf made a stop whose step never returned hang for good.
        self.abandon_after = _worker_seconds(abandon_after, "abandon_after", above_zero=False)
        if pool not in ("thread", "process"):
            raise ConfigurationError(f"pool={pool!r}: choose thread or process")
        if pool == "process" and not app_path:
            raise ConfigurationError(
                "pool='process' needs the app's import path (module:attr) so child processes "
                "can load your jobs: pass app_path=, or use `errands worker module:app --pool "
                "process`"
            )
        self.pool = pool
        self.app_path = app_path
        if prefetch is not None:
            prefetch = check_prefetch(prefetch)
        # Prefetch queues claimed jobs for the handler threads, or for the event loop's
        # slots (errands.worker.runners.HandlerSlots) for async handlers. Not for the
        # process pool. A worker with both kinds bounds them together: each kind bounds
        # its own handlers by `concurrency` (the threads, the loop's slots), so prefetched
        # jobs of both ran up to twice it, and such a worker did not prefetch; now its
        # sync handlers take the async ones' -c slots too (shares_slots), in one order.
        kinds = {d.is_async for d in app.registry.values()}
        prefetches = pool == "thread"
        fair_most = min(FAIR_PREFETCH_MULTIPLIER * concurrency, PREFETCH_MAX)
        # A fair queue prefetches deeper (its claim costs more), up to a given --prefetch
        fair_prefetch = fair_most if prefetch is None else min(prefetch, fair_most)
        if prefetch is None:  # as Celery's worker_prefetch_multiplier (4) does
            prefetch = min(PREFETCH_MULTIPLIER * concurrency, PREFETCH_MAX)
        self.prefetch = prefetch if prefetches else 0
        self.fair_prefetch = fair_prefetch if prefetches else 0
        self.shares_slots = len(kinds) > 1 and bool(self.prefetch or self.fair_prefetch)
        if suspect_lanes is not None and suspect_lanes < 1:
            raise ConfigurationError("suspect_lanes must be at least 1")
        # Suspects run isolated in child processes when children can import the app: as
        # many at once as the worker has slots, unless capped (each child costs memory).
        lanes = min(suspect_lanes or concurrency, concurrency)
        self.suspect_lanes = lanes if app_path else 1
        self.processes: ProcessRunner | None = None
        self.suspect_processes: ProcessRunner | None = None
        self.poll_interval = poll_interval
        # keyed by (job id, lease token): after a lease loss the same worker may run a newer
        # attempt of a job while the stale one is still inside its handler
        self._attempts: dict[tuple[int, str], Attempt] = {}
        self._lock = threading.Lock()
        self._running_per_queue: dict[str, int] = dict.fromkeys(limits, 0)
        self._free = concurrency  # slots; below 0 while prefetched jobs wait for a thread
        self._extra = 0  # how many jobs beyond its slots the worker claims now (prefetch)
        self._fair_extra = 0  # ... for a prefetching fair queue (see _fair_prefetch_now)
        self._fair_backlog = False  # such a queue's last claim filled its room
        self._mean_run: float | None = None  # handler time, moving average (seconds)
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self.thread: threading.Thread | None = None  # the one in run(), while it runs
        self.ended = threading.Event()  # run() returned (App.close() waits for it)
        self._backlog = False
        self._claimed_at = 0.0  # time.monotonic() of the last claim round
        # A finishing handler woke the claim loop for a refill since its last claim (see
        # slot_freed): only such a wake makes it claim while prefetched jobs wait
        self._refill_woken = False
        # The last claim may have left due jobs waiting for a concurrency key (or a rate)
        # held by running jobs (it held some back, or a limited queue gave fewer than
        # asked): the stored outcome of a job with a key or a rate in this worker's
        # limited queues may let them run, so it wakes the claim loop (on PostgreSQL
        # nothing else does: they waited for the next poll, and a key's backlog ran one
        # job a poll interval).
        self._gated = False
        # Stored outcomes of such jobs so far: one stored while a claim ran (read before
        # it) may have freed what that claim found taken; the loop claims again at once.
        self._limited_done = 0
        # With a backlog, the producer waits (up to BATCH_GATHER) for this many free slots
        # before claiming: one round trip brings a batch instead of one or two jobs.
        self._refill_at = max(1, concurrency // 2)
        self._rotation = 0
        self._suspects = 0  # rescued jobs running here
        self._wake_at = float("inf")  # a limited queue asked to be looked at again then
        self._claim_warned_at = float("-inf")
        # Checked before any thread starts (a worker that fails to build leaves none behind)
        if express and pool != "thread":
            raise ConfigurationError(
                "express: the express lane runs handler threads; with pool='process' leave "
                "it out (or 0)"
            )
        tick = (
            _worker_seconds(maintenance_tick, "maintenance_tick")
            if maintenance_tick is not None
            else min(1.0, app.lease / 4)
        )
        self.threads = ThreadRunner(concurrency)
        # The express lane: handler threads beyond the slots, for the jobs of a fair
        # queue's keys with nothing running, when every slot is busy (see _claim_express).
        self.fair_queues = [q for q in limits if getattr(app.queues.get(q), "fair", False)]
        if express is None:
            express = concurrency // EXPRESS_SHARE if self.fair_queues and pool == "thread" else 0
        self.express = express
        self._express_free = self.express
        self._express_wanted = False  # a notification: a fair queue may have a new key
        self._express_at = float("-inf")  # monotonic: the last express claim
        self._express_found = False  # ... took jobs
        try:
            self.express_threads = (
                ThreadRunner(self.express, "errands-express") if self.express else None
            )
        except BaseException:
            self.threads.shutdown()  # (the machine's thread limit): none left running
            raise
        self.loop_runner: LoopRunner | None = None
        self.recorder = self.recorder_class(self)
        self.dispatcher = Dispatcher(self)
        self.claimer = Claimer(
            app, self.id, list(limits), poll_interval,
            fair_room=(FAIR_PREFETCH_MULTIPLIER + 1) * concurrency,
        )  # fmt: skip
        self.completer = Completer(
            app,
            lambda attempt, outcome, ok: self.recorder.on_written(attempt, outcome, ok),
            running=self._running_handlers,
            on_released=self._on_released,
            on_batch=self._on_batch_written,
            release=lambda attempts, message, delays: self.release_write(
                attempts, message, delays=delays
            ),
            on_given_back=self.release_done,
        )
        # Outcomes decided but not yet written, beyond which the worker claims nothing (see
        # _produce): twice what its slots and prefetch hold. Each is a job that ran and
        # runs again if this worker loses the store for longer than its lease: the floor
        # was a batch (500) until a chaos soak's worker, its outcome writes failing while
        # its claims went through, held 505 when it lost its connection, and the 505
        # rescued jobs queued for isolated runs for up to 6 s (I9).
        if not self.claimer.prefetching:  # no fair queue claims for a prefetch room here
            self.fair_prefetch = 0
        self._unwritten_max = 2 * (concurrency + max(self.prefetch, self.fair_prefetch))
        self.recheck_after_notify = RECHECK_AFTER_NOTIFY_MIN  # set from the store in run()
        self._throttled = False
        self._throttle_warned_at = float("-inf")
        shortest = min([app.lease, *(d.lease for d in app.registry.values() if d.lease)])
        self.leases = LeaseKeeper(
            self,
            interval=max(shortest / 3, MIN_BEAT),
            on_timeout=lambda a: on_deadline(self, a),
            on_fence=lambda a: on_fence(self, a),
        )
        self.maintenance = Maintenance(app, self.id, tick=tick) if maintenance else None
        self.processed = 0
        self.started_at = 0.0
        self._leaving = False  # set as the shutdown begins: the registry is left for good
        # the stop's releases, on helper threads, answered within a bound (_StopReleases)
        self._stop_releases = _StopReleases(self)
        self.listener: Any = None
        self._notified = False
        self.exit_code = 0  # 1: it stopped because its child processes cannot start
        self._hopeless_said = 0  # the failed starts counted when that was last said
        self._claims_paused = False  # heartbeats fail: the claim loop waits (said once)

    # -- what the services see --------------------------------------------------------
    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self.loop_runner.loop if self.loop_runner else None

    def loop_runner_started(self) -> LoopRunner:
        if self.loop_runner is None:  # a thread per slot for the handlers' to_thread calls
            self.loop_runner = LoopRunner(slots=self.concurrency + self.express)
        return self.loop_runner

    def child_runner_for(self, attempt: Attempt) -> ProcessRunner | None:
        """The child processes an attempt runs in: the process pool's for sync handlers in
        process mode, the suspects' own for a rescued job (when children can load the
        app), else None (a thread or the event loop)."""
        definition = attempt.definition
        if attempt.row.rescues > 0 and self.isolates_suspects:
            return self.suspect_runner()
        if self.processes is not None and definition is not None and not definition.is_async:
            return self.processes
        return None

    @property
    def isolates_suspects(self) -> bool:
        """Rescued jobs run in child processes (several at once), not in this one."""
        return bool(self.app_path) and self.suspect_lanes > 1

    def suspect_runner(self) -> ProcessRunner:
        """The suspects' child processes: one per suspect running, started on need, one
        spare ahead of need once warm (:meth:`ProcessRunner.warm`)."""
        if self.suspect_processes is None:
            self.suspect_processes = ProcessRunner(
                self.app_path or "",
                self.app.url,
                self.suspect_lanes,
                start=False,
                worker_id=self.id,
                spare=SUSPECT_SPARE,
                idle_retire=SUSPECT_IDLE_RETIRE,
                needed_by="rescued jobs",
            )
        return self.suspect_processes

    def _suspects_startable(self) -> bool:
        """Whether a suspect claimed now starts at once (isolated: once a child is up, and
        not while its children fail to start: see child_starts)."""
        runner = self.suspect_processes
        if self.isolates_suspects and runner is not None and runner.hopeless():
            self._suspects_in_process(runner)
        return not self.isolates_suspects or (
            runner is not None and runner.ready and runner.failures.pause_left() <= 0
        )

    def _suspects_in_process(self, runner: ProcessRunner) -> None:
        """The suspects' children have failed to start long enough to give up on them
        (see child_starts): rescued jobs run in this process from now on, one at a time,
        as in a worker with one suspect lane. Isolated, they never ran: each was claimed,
        released uncharged and claimed again every 30 s for as long as the worker lived
        (an app that imports here and fails in a child: a port it binds at import)."""
        self.suspect_lanes = 1  # (isolates_suspects: no more)
        log.error(
            "%s; rescued jobs run in this worker's process from now on, one at a time, "
            "not isolated: one that crashes its process takes this worker and its running "
            "jobs down (restart the worker once its children can start)",
            runner.failures.gave_up_message(),
        )

    def _children_fail(self) -> bool:
        """Whether the process pool's children cannot start now, so that the claim loop
        claims nothing this round: it waits out the pause their failures asked for (see
        child_starts), or, when they have failed long enough to give up on, the worker
        stops (exit 1).

        Only the job types that need a child wait: a worker that also serves ``async
        def`` handlers (run on its event loop, never in a child) claims those meanwhile
        (:attr:`Claimer.only`), and, when one of their queues is its own, never gives up,
        saying loudly instead at each failure that its sync jobs cannot run. The pause
        held every claim back, and the give-up stopped a worker whose async jobs ran fine."""
        runner = self.processes
        self.claimer.only = None
        if runner is None or not runner.failures.in_a_row:
            return False
        failures = runner.failures
        hopeless, pause = runner.hopeless(), failures.pause_left()
        if not hopeless and pause <= 0:
            return False
        childless = self._needing_no_child()
        if hopeless:
            queues = self.queue_limits  # (a type's jobs are in its own queue, as a rule)
            if not any(self.app.registry[name].queue in queues for name in childless):
                log.error("%s", failures.give_up_message())
                self.exit_code = 1
                self.stop()
                return True
            if failures.total != self._hopeless_said:  # once per failure: loud, not a flood
                self._hopeless_said = failures.total
                log.error("%s", failures.run_on_message())
        if pause <= 0:
            return False
        if childless:
            self.claimer.only = childless
            return False
        self._wake.wait(pause)
        return True

    def _needing_no_child(self) -> list[str]:
        """The job types this worker runs without its process pool's children: those with
        an ``async def`` handler (see :meth:`child_runner_for`)."""
        return sorted(name for name, d in self.app.registry.items() if d.is_async)

    def _running_handlers(self) -> int:
        # int reads: no lock needed for a hint; the express lane's handlers count too
        return self.concurrency - self._free + self.express - self._express_free

    def attempts(self) -> list[Attempt]:
        with self._lock:
            return list(self._attempts.values())

    def forget(self, attempt: Attempt) -> None:
        """The attempt's outcome is stored (or refused, or given up on): it is no longer
        this worker's. Its key, rate or queue slot is free in the store from now: a claim
        that may have left jobs waiting for one runs again (see _gated)."""
        claimer = self.claimer
        with self._lock:
            self._attempts.pop((attempt.id, attempt.token), None)
            # a job type with a key or a rate, or any job of a queue with a cluster-wide
            # limit (a plain or fair-only job frees neither: waking on each of those made a
            # claim per completed job of every fair queue). The handler's own slot frees
            # before its outcome is written, so the claim it woke then still found such a
            # queue full: the next job waited a poll interval (~N jobs a poll on
            # PostgreSQL for a queue of limit=N with short jobs).
            definition = attempt.definition
            queue = attempt.row.queue
            limited = queue in claimer.with_limits and (
                definition is None or definition.limited or queue in claimer.capped
            )
            self._limited_done += limited
            gated = limited and self._gated
        if gated:
            self._wake.set()

    # -- lifecycle ---------------------------------------------------------------------
    def run(self, *, install_signals: bool = True, signalled: Sequence[int] = ()) -> int:
        """Run until stopped (signal or :meth:`stop`); returns the process exit code (1
        when it stopped because its process pool's children cannot start: see
        :mod:`.child_starts`). ``signalled``: stop signals received before this call
        (the CLI keeps them from its start, while the app is imported): each is a
        graceful stop request."""
        install_record_factory()
        self.thread = threading.current_thread()
        self.ended.clear()
        with self.app._workers_lock:  # App.close() stops it and waits for it
            self.app._workers.add(self)
        try:
            return self._run_registered(install_signals, signalled)
        finally:
            with self.app._workers_lock:
                self.app._workers.discard(self)
            self.ended.set()

    def _run_registered(self, install_signals: bool, signalled: Sequence[int]) -> int:
        # The handlers first: a SIGTERM while the start-up waits for the store (a restart,
        # a slow server) is a graceful stop, not Python's default death (exit -15).
        relay = None
        if install_signals and threading.current_thread() is threading.main_thread():
            relay = SignalRelay(self._on_signal, on_repeat=self._exit_now)
            relay.install()
        if signalled:  # read once the relay has the signals: none falls between
            log.info("stop signal received while starting: stopping once started")
            self.stop()
        try:
            try:
                self._at_startup("checking the schema", lambda: self.app.backend.schema_check())
                self._at_startup(
                    "sizing connections",
                    # every handler at once may hold a ctx.transaction(): the express lane's
                    lambda: self.app.backend.configure_worker(
                        self.concurrency + self.express, self.app.lease
                    ),
                )
            except Exception:
                if self._stopping.is_set():  # stopped while it waited for the store
                    log.info("worker %s stopped before it started", self.id)
                    return 0
                raise
            window = getattr(getattr(self.app.backend, "config", None), "notify_window", 0.0)
            self.recheck_after_notify = max(
                RECHECK_AFTER_NOTIFY_MIN, float(window) + RECHECK_MARGIN
            )
            return self._run()
        finally:
            if relay is not None:  # also when the start-up fails: the handlers go back
                relay.uninstall()

    def _run(self) -> int:
        self.started_at = time.monotonic()
        self._register()
        try:
            self._start()
        except BaseException as exc:  # what started stops, and the worker leaves the registry
            with contextlib.suppress(Exception):  # the start-up's error is the one to see
                self._shutdown()
            if isinstance(exc, _StoppedAtStartup):  # stopped while the store was busy
                log.info("worker %s stopped while it started (%s)", self.id, exc)
                return 0
            raise
        protect_current_thread()  # the claim loop: user code reached from here goes to a lane
        try:
            self._produce()
        finally:
            try:
                self._shutdown()
            finally:
                protect_current_thread(False)
        return self.exit_code

    def _start(self) -> None:
        """The start-up steps after registering; any may fail, and _shutdown then stops
        whatever they started (child processes, threads)."""
        warn_unserved_periodic(self.app, list(self.queue_limits))
        self._at_startup("declaring queue settings", self._declare)
        self.claimer.refresh(force=True)
        if self.isolates_suspects:
            self.suspect_runner().warm()  # its forkserver and a spare child, in the background
        if self.pool == "process":
            self.processes = ProcessRunner(
                self.app_path or "", self.app.url, self.concurrency, worker_id=self.id,
                needed_by="sync jobs",
            )  # fmt: skip
        self.completer.start()
        self.leases.start()
        self.listener = self.app.backend.listener(self._on_notify)
        if self.listener is not None:
            self.listener.start()
        if self.maintenance:
            self.maintenance.start()
        self.app.events.emit(
            "errands.worker.started",
            worker_id=self.id,
            queues=", ".join(f"{q}={n}" if n else q for q, n in self.queue_limits.items()),
            concurrency=self.concurrency,
            store=redact_url(self.app.url),
        )

    def _at_startup(self, what: str, step: Callable[[], object]) -> None:
        """Run a startup step, retrying while the store errs transiently (a killed session,
        a restart, a busy SQLite file): a worker restarted mid-fault waits it out instead
        of dying with a traceback. Anything else (an outdated schema) fails at once, and a
        store unreachable when the worker opens it is one clear error line (exit 1)."""
        pause = self.poll_interval
        while True:
            try:
                with calls_until_stopped(self._stopping):  # (a locked SQLite file)
                    step()
                return
            except Exception as exc:
                if self._stopping.is_set() and is_transient(exc):
                    raise _StoppedAtStartup(what) from exc
                if not is_transient(exc) or self._stopping.is_set():
                    raise
                log.warning("%s failed (%s); retrying in %.1f s", what, exc, pause)
                self._stopping.wait(pause)
                pause = min(pause * 2, CLAIM_RETRY_MAX)

    def _register(self) -> None:
        """List this worker in the registry, retrying while the store errs transiently
        (a worker unlisted at start, or forgotten later, is listed by its next beat)."""
        try:
            self._at_startup(
                "registering the worker", lambda: self.app.backend.worker_register(self._info())
            )
        except _StoppedAtStartup:
            return  # (stopped before it was listed: nothing to list)
        except Exception:
            log.exception("could not register this worker; it runs unlisted")

    def _info(self) -> WorkerInfo:
        from .. import __version__

        return WorkerInfo(
            id=self.id,
            host=socket.gethostname(),
            pid=os.getpid(),
            queues=",".join(f"{q}={n}" if n else q for q, n in self.queue_limits.items()),
            concurrency=self.concurrency,
            version=__version__,
            jobs=tuple(sorted(self.app.registry)),
            beat_seconds=self.leases.interval,  # readers judge it by its own beat
        )

    def _declare(self) -> None:
        """Store the limits this app declares in code (``app.queue``): the store holds the
        cluster-wide ones. Per-key limits and job-type rates travel on each job row; they
        are also declared here for workers of older versions, which read them from the
        queue's flag and the job-limits table (the flag only ever turns on).

        A queue with such job types that this app does not declare gets the flag alone
        (queue_declare_keyed): its settings were read here and written back whole, so
        another deployment's declaration stored between the two was undone."""
        backend = self.app.backend
        keyed = {d.queue for d in self.app.registry.values() if d.limited}
        for name in sorted(keyed - set(self.app.queues)):
            backend.queue_declare_keyed(name, f"worker:{self.id}")
        for name in sorted(self.app.queues):
            declared = self.app.queues[name]
            settings = QueueSettings(
                name,
                max_running=declared.max_running,
                rate_limit=declared.rate_limit,
                rate_period=declared.rate_period,
                jobs_declare_limits=name in keyed,
                fair=declared.fair,
                aging=declared.aging,
            )
            backend.queue_declare(settings, f"worker:{self.id}")
        for definition in self.app.registry.values():  # a rate removed in code is cleared
            limit, period = definition.rate or (None, None)
            backend.job_limit_declare(definition.name, definition.queue, limit, period)

    def registry_beat(self) -> None:
        """Tell the registry this worker is alive (dashboard and status show it)."""
        try:
            with self._lock:
                in_flight = self._running_handlers()
            listed = self.app.backend.worker_heartbeat(self.id, in_flight, self.processed)
            if not listed and not self._leaving:
                # Forgotten (unlisted at start, or silent past the leader's patience while
                # the store was away): list it again rather than run unlisted for good.
                log.info("worker %s is not in the registry; listing it again", self.id)
                self.app.backend.worker_register(self._info())
                if self._leaving:  # the shutdown deregistered meanwhile: leave again
                    self.app.backend.worker_deregister(self.id)
        except Exception as exc:
            log.debug("worker registry heartbeat failed: %s", exc)

    def heartbeats_resumed(self) -> None:
        """A heartbeat got through after failures: the claim loop, paused, claims again."""
        self._wake.set()

    def _heartbeats_fail(self) -> bool:
        """Whether heartbeats fail now, so that the claim loop claims nothing this round:
        each job claimed would run only until it is self-fenced, and the jobs it gave back
        were claimed again by this worker while its heartbeats still failed (a job fenced
        and rescued ran again here beside its own first run). The lease keeper retries
        every second and wakes the loop at the first heartbeat that gets through."""
        if not self.leases.failures:
            self._claims_paused = False
            return False
        if not self._claims_paused:
            self._claims_paused = True
            log.warning("heartbeats fail: claiming no new job until one gets through")
        self._wake.wait(self.poll_interval)
        return True

    def stop(self) -> None:
        """Begin a graceful stop (what the first SIGTERM does)."""
        self._stopping.set()
        self._wake.set()

    def _on_notify(self, queue: str | None) -> None:
        if queue is None or queue in self.queue_limits:
            self._notified = True
            if queue is None or queue in self.fair_queues:
                self._express_wanted = True
            self._wake.set()

    def _on_released(self, queues: set[str]) -> None:
        """This worker's own finish released workflow dependents (or inserted callbacks)
        into these queues: claim now, as a notification would make it (a chain's next
        step starts without the round trip through the store's wake-up)."""
        for queue in queues:
            self._on_notify(queue)

    def _on_signal(self, signum: int, count: int) -> None:
        """SIGTERM or SIGINT, on the signal relay's thread (never in a signal handler: see
        :mod:`errands.worker.signals`): the first begins a graceful stop."""
        if count > 1:
            return  # a second one exits in the handler itself (_exit_now)
        log.info(
            "%s received: finishing in-flight jobs (up to %.0f s), claiming no more",
            signal.Signals(signum).name,
            self.grace,
        )
        self.stop()

    @staticmethod
    def _exit_now(signum: int) -> None:
        """A second SIGTERM or SIGINT: exit at once, from the signal handler. Nothing here
        waits: no lock is taken, and the line goes straight to stderr only when stderr
        takes it without blocking (a full pipe, the case where a log call blocks, gets no
        line); lines still queued in the log writer are dropped."""
        with contextlib.suppress(OSError, ValueError):
            if select.select([], [2], [], 0)[1]:  # room for a line below PIPE_BUF: no wait
                os.write(
                    2,
                    lockless_line(
                        f"second signal ({signal.Signals(signum).name}): exiting now; "
                        "running jobs are rescued after their lease"
                    ),
                )
        os._exit(EXIT_NOW_CODE)

    # -- the claim loop ----------------------------------------------------------------
    def _claim_plan(self, room: int) -> list[QueueClaim]:
        names = list(self.queue_limits)
        start = self._rotation % len(names)
        self._rotation += 1
        plan = []
        for name in names[start:] + names[:start]:
            cap = self.queue_limits[name]
            take = room if cap is None else min(cap - self._running_per_queue[name], room)
            if take > 0:
                plan.append(QueueClaim(name, take))
        return plan

    def _produce(self) -> None:
        pause = self.poll_interval
        gathered = False
        # While claims fail: whether a notification may end the backoff (it shows that a
        # job was committed: on PostgreSQL the server answers again), and whether one
        # ended the last. A claim that fails even so shows the failure is this process's
        # own (on SQLite a local I/O error, a file-size limit, while other processes still
        # commit): notifications end no more backoffs until a claim gets through. (They
        # ended every one: claims every 0.25 s, each with its warning.)
        heed_notify, cut_short = True, False
        while not self._stopping.is_set():
            # Cleared here, before this round reads anything, and never after a wait: a
            # wake-up set between a wait's end and a clear after it was lost (a keyed job's
            # outcome stored then: the next job of its key waited a whole poll interval).
            # One set during the round makes the next wait return at once.
            self._wake.clear()
            if self._stopping.is_set():  # a stop's wake-up just cleared: not lost
                break
            if self._children_fail():  # (claimed, a job would be released at once)
                continue
            if self._heartbeats_fail():
                continue
            self._extra = self._prefetch_now()
            self._fair_extra = self._fair_prefetch_now()
            deepest = self._deepest()
            self._refill_at = max(1, (self.concurrency + deepest) // 2)
            with self._lock:
                free = self._free
                room = free + self._extra
                fair_room = free + self._fair_extra
                plan = self._claim_plan(free + deepest) if free + deepest > 0 else []
                # Rescued jobs take the claim's room, prefetch included: they start at the
                # next free slot, ahead of the prefetched jobs (dispatched urgent). Counted
                # against free slots only, a worker with quick handlers, whose prefetched
                # jobs take each slot the moment it frees, never claimed one while fresh
                # jobs kept coming (I9: rescued jobs waited seconds behind fresh ones).
                # (a fair queue's deeper room too: claimed only while the plain room was
                # left, a rescued job waited behind a fair queue's whole prefetched backlog)
                suspects = min(max(self.suspect_lanes - self._suspects, 0), max(room, fair_room, 0))
                if not self._suspects_startable():
                    suspects = 0
                lane = self._express_plan() if free <= 0 else []
            self._throttled = bool(plan)  # before reading: a batch written after it wakes us
            unwritten = self.completer.pending
            # Every slot busy (a prefetch room may be left, or a limited queue's claim may
            # take only free slots): the lane's claim goes first; what it started changes
            # the plan (per-worker caps, room), which is made again.
            lane_now = lane and unwritten < self._unwritten_max and self._express_due() <= 0
            if lane_now and self._claim_express(lane):
                continue
            if plan and unwritten >= self._unwritten_max:
                # The store records outcomes slower than the handlers produce them (a slow
                # or struggling store): claim nothing until the completer catches up. Else
                # the worker ran on, its unwritten outcomes piled up in memory, each still
                # heartbeated, and the heartbeats grew with them (a PostgreSQL worker grew
                # by 80 MB and wrote ~160 outcomes a second for 100 s in the memory
                # benchmark). The completer wakes us after each batch.
                self._warn_throttled(unwritten)
                self._wake.wait(self.poll_interval)
                continue
            self._throttled = False
            # A notification for the lane inside its gap: no wait outlasts the gap.
            lane_due = bool(lane) and self._express_wanted and unwritten < self._unwritten_max
            if not plan:  # every slot busy: a finishing handler wakes us
                self._wake.wait(self._lane_wait(self.poll_interval, lane_due))
                continue
            if self._backlog and free + deepest < self._refill_at:
                if not gathered:
                    # With a backlog, give finishing handlers a moment to free a batch's
                    # worth of slots: one claim then brings many jobs instead of one or two.
                    gathered = True
                    self._wake.wait(BATCH_GATHER)
                    continue
                # Rescued jobs are looked for once a poll interval whatever the room (I9:
                # they start at the next free slot, ahead of the prefetched jobs)
                looked = time.monotonic() - self._claimed_at < self.poll_interval
                if (
                    free <= 0 < deepest
                    and not self._refill_woken
                    and not self._gated
                    and (looked or not suspects)
                ):
                    # Prefetched jobs still wait for every slot, and no finishing handler
                    # asked for a refill (slot_freed: the first slot freed after a full
                    # claim, or half the room): no claim. Woken by anything else (on
                    # SQLite every commit to the file notifies), the worker claimed the
                    # few slots freed during the gather, each such claim ended before the
                    # next slot freed, and its claims stayed small for good (SQLite, one
                    # worker in-process: ~0.6 x its rate in some runs; one with plain and
                    # async jobs in most).
                    self._wake.wait(self._lane_wait(self.poll_interval, lane_due))
                    continue
            gathered = self._refill_woken = False
            self._claimed_at = time.monotonic()
            sent = clock.now()  # each claimed lease runs from (at latest) the claim's send
            limited_done = self._limited_done
            with calls_until_stopped(self._stopping):  # (a locked SQLite file: see there)
                claimed = self.claimer.claim(plan, room, free, suspects, fair_room=fair_room)
            if claimed.retry_in is not None:
                self._wake_at = min(self._wake_at, time.monotonic() + claimed.retry_in)
            # Before the claimed jobs start: a quick one's outcome, stored before this was
            # set, woke nothing (its key's next job waited a whole poll interval).
            self._gated = claimed.gated > 0 or claimed.limited_short
            if self._gated and self._limited_done != limited_done:
                self._wake.set()  # one stored during the claim may have freed what it found taken
            # all claimed starts, even after an error
            self._start_all(claimed.rows, sent, claimed.express)
            rows = claimed.rows
            if claimed.error is not None:
                now = time.monotonic()
                if self._stopping.is_set():  # (given up for the stop: nothing to say)
                    pass
                elif now >= self._claim_warned_at + CLAIM_RETRY_MAX:
                    self._claim_warned_at = now  # one line per CLAIM_RETRY_MAX, not per claim
                    log.warning(
                        "claim failed (%s); %d job(s) claimed in that round started; %s",
                        claimed.error,
                        len(rows),
                        f"retrying in {pause:.1f} s" if not rows else "going on",
                    )
                if not rows:  # nothing claimed at all: back off before trying again
                    heed_notify = heed_notify and not cut_short
                    cut_short = self._back_off(pause, heed_notify)
                    pause = min(pause * 2, CLAIM_RETRY_MAX)
                    continue
            else:
                pause = self.poll_interval
                heed_notify, cut_short = True, False
            if not rows and claimed.limited_starved and self._backlog:
                # The limited queues wait for a free slot, which wakes us (the backlog
                # stays on) rather than the next poll.
                self._wake.wait(self._lane_wait(self.poll_interval, lane_due))
                continue
            self._backlog = bool(rows) and (len(rows) >= room or claimed.limited_full)
            self._fair_backlog = claimed.fair_full
            if self._backlog:
                continue
            # Woken by a notification: look once more shortly after, since notifications
            # are coalesced and a job committed just after this claim may have sent none.
            wait = self.recheck_after_notify if self._notified else self.poll_interval
            wait = max(min(wait, self._wake_at - time.monotonic()), 0.0)
            self._wake_at = float("inf")
            self._notified = False
            self._wake.wait(self._lane_wait(wait, lane_due))

    def _lane_wait(self, wait: float, lane_due: bool) -> float:
        """``wait``, or less when an express claim waits out its gap (``lane_due``)."""
        return min(wait, max(self._express_due(), 0.001)) if lane_due else wait

    def _express_plan(self) -> list[QueueClaim]:
        """The express lane's claim (call under the lock): each fair queue within its
        per-worker cap (``-q tenants=2``), for the lane's free threads."""
        most = self._express_free
        plan = []
        for queue in self.fair_queues if most > 0 else ():
            cap = self.queue_limits.get(queue)
            left = most if cap is None else min(most, cap - self._running_per_queue[queue])
            if left > 0:
                plan.append(QueueClaim(queue, left))
        return plan

    def _express_due(self) -> float:
        """Seconds until an express claim may run (0 or less: now). One runs when a
        notification came (a job enqueued: perhaps a new key's), at once after one that
        found jobs, at least EXPRESS_GAP after one that found none; without one, a poll
        interval after the last."""
        now = time.monotonic()
        if self._express_wanted:
            return self._express_at + (0.0 if self._express_found else EXPRESS_GAP) - now
        return self._express_at + self.poll_interval - now

    def _claim_express(self, plan: list[QueueClaim]) -> bool:
        """Every slot busy: claim for the express lane the next job of fair queues' keys
        with nothing running (one each, within their share), and start them at once. So a
        quiet tenant's job starts as on an idle queue behind another tenant's backlog that
        fills every slot (its wait for a slot was most of its dwell: 6-7 x the idle
        queue's). True when it started any."""
        self._express_wanted = False
        sent = clock.now()  # (the lease clock: see _start_all)
        with self._lock:  # rescued ones for the suspect lanes free (none before they can run)
            suspects = max(self.suspect_lanes - self._suspects, 0)
        if not self._suspects_startable():
            suspects = 0
        # the lane's room in all
        claimed = self.claimer.claim_express(plan, self._express_free, suspects)
        self._express_at, self._express_found = time.monotonic(), bool(claimed.rows)
        if claimed.rows:
            self._start_all(claimed.rows, sent, frozenset(r.id for r in claimed.rows))
        if claimed.error is not None:
            # A warning, at most once per CLAIM_RETRY_MAX as the regular claim's: while every
            # slot is busy no regular claim runs to report a store that fails.
            now = time.monotonic()
            if now >= self._claim_warned_at + CLAIM_RETRY_MAX:
                self._claim_warned_at = now
                log.warning("express claim failed (%s); the slots' claims go on", claimed.error)
        return bool(claimed.rows)

    def _on_batch_written(self) -> None:
        if self._throttled:
            self._wake.set()

    def _warn_throttled(self, unwritten: int) -> None:
        now = time.monotonic()
        if now >= self._throttle_warned_at + THROTTLE_WARN_EVERY:
            self._throttle_warned_at = now
            log.warning(
                "%d outcome(s) wait to be written (the store records them slower than the "
                "handlers finish): claiming no more jobs until it catches up",
                unwritten,
            )

    def _back_off(self, pause: float, heed_notify: bool = True) -> bool:
        """Wait ``pause`` seconds after a failed claim, or less: a notification (a job
        committed, announced by the store) shows the store answers again, so the next
        claim need not wait out a backoff grown while it was away (after a database
        restart that wait delayed claims, rescued jobs among them, by seconds). Not when
        ``heed_notify`` is False (see _produce). True when a notification ended it."""
        deadline = time.monotonic() + pause
        self._notified = False
        while not self._stopping.is_set() and (left := deadline - time.monotonic()) > 0:
            self._wake.wait(left)
            self._wake.clear()
            if self._notified and heed_notify:
                return True
        return False

    def _prefetch_now(self) -> int:
        """Jobs to hold beyond the slots: enough that one claim carries a batch, few enough
        that each waits for a thread about PREFETCH_HORIZON on average (none for slow
        handlers, which another worker may be free to run now)."""
        mean = self._mean_run
        if not self.prefetch or mean is None:
            return 0
        return min(self.prefetch, int(self.concurrency * PREFETCH_HORIZON / max(mean, 1e-6)))

    def _deepest(self) -> int:
        """The prefetch the worker gathers and refills for: a fair queue's deeper one
        while its last claim filled its room (a backlog), else the plain queues' (a plain
        backlog beside an idle fair queue was claimed in small batches, back to back)."""
        return max(self._extra, self._fair_extra) if self._fair_backlog else self._extra

    def _fair_prefetch_now(self) -> int:
        """A prefetching fair queue's jobs beyond the slots: as :meth:`_prefetch_now`, up
        to ``fair_prefetch`` (16 x -c by default, not 4 x), so that its costlier claim
        (a window of keys, ranked) brings a batch as large as its time asks; the horizon
        still bounds what waits (~50 ms of work on average). None without such a queue."""
        mean = self._mean_run
        if not self.fair_prefetch or mean is None or not self.claimer.prefetching:
            return 0
        horizon = int(self.concurrency * PREFETCH_HORIZON / max(mean, 1e-6))
        return min(self.fair_prefetch, horizon)

    def ran_for(self, seconds: float) -> None:
        mean = self._mean_run  # a racy update of a float: a lost sample is harmless
        self._mean_run = seconds if mean is None else mean + (seconds - mean) * 0.1

    def _start_all(
        self,
        rows: list[JobRow],
        sent: float | None = None,
        express: frozenset[int] = frozenset(),
    ) -> None:
        """Take on a claim's rows: one hold of the lock for the batch, then dispatch each.

        ``sent``: when the claim was sent (:func:`errands.clock.now`, the clock of every
        attempt's lease). The store started each lease when
        it ran the claim, so this worker counts the lease from the send, not from the
        reply: a reply held up (a network cut that delivers it late) would otherwise make
        a lease that ran out at the store look valid here for the time it was held, and
        its handler run beside the rescue.

        ``express``: rows that are the first of a fair key with nothing running; one that
        finds no slot free starts on the express lane, while it has room."""
        if not rows:
            return
        registry, lease = self.app.registry, self.app.lease
        started = clock.now() if sent is None else sent
        attempts = [
            Attempt(
                row=row,
                definition=registry.get(row.name),
                lease_seconds=row.lease_seconds or lease,
                started=started,
            )
            for row in rows
        ]
        running = self._running_per_queue
        with self._lock:
            for attempt in attempts:
                row = attempt.row
                self._attempts[(row.id, attempt.token)] = attempt
                self._suspects += row.rescues > 0
                running[row.queue] = running.get(row.queue, 0) + 1
                if row.id in express and self._free <= 0 and self._express_free > 0:
                    # (a rescued one too: isolated, its child waited on by a lane thread)
                    attempt.express = True
                    self._express_free -= 1
                else:
                    self._free -= 1
        if min(a.lease_seconds for a in attempts) < 3 * self.leases.interval:
            self.leases.poke()  # a job's own lease, shorter: heartbeats planned from it
        try:
            for attempt in attempts:
                try:
                    self.dispatcher.dispatch(attempt)
                except Exception as exc:  # never lose a claimed job to a dispatch bug
                    log.exception(
                        "job %s: could not start it", attempt.id, extra=job_extra(attempt.row)
                    )
                    self.recorder.decided(attempt, exc, None)
        finally:
            self.dispatcher.start_dispatched()  # the async ones, in one hand-over

    def slot_freed(self, attempt: Attempt) -> None:
        suspect = attempt.row.rescues > 0  # its end lets the next rescued job be claimed
        lane = False  # a lane thread free while a notification waits for one
        with self._lock:
            if attempt.express:
                self._express_free += 1
                lane = self._express_wanted
            else:
                self._free += 1
            self._running_per_queue[attempt.row.queue] -= 1
            self._suspects -= suspect
            room = self._free + self._deepest()
            # Half the room free (one claim brings a batch), or the first slot freed after
            # a full claim (the claim loop gathers a moment for more, then claims): only
            # these wake it to claim while prefetched jobs wait (see _run's gather)
            refill = self._backlog and (room == 1 or room >= self._refill_at)
            if refill:
                self._refill_woken = True
        if refill or suspect or lane:
            self._wake.set()

    # -- stopping ----------------------------------------------------------------------
    def _shutdown(self) -> None:
        # No registry beat lists it again from now on (a beat still in flight when it
        # deregistered found no row and listed it: shown live, then dead for minutes).
        self._leaving = True
        deadline = time.monotonic() + self.grace
        with self._lock:
            waiting = [a for a in self._attempts.values() if a.waiting]
        withdrawn = [a for a in waiting if a.withdraw()]
        # Their handler threads and tasks waiting for a slot go on now (none begins: each
        # finds its attempt withdrawn); they waited for running handlers to end, a
        # withdrawn task until the loop's shutdown cancelled it.
        self.dispatcher.open_slots()
        if withdrawn:  # prefetched, never begun: back to the queue at once, not run
            self.release(
                withdrawn,
                "stopping: released %d prefetched job(s)",
                logging.INFO,
                prefetched=True,
                bounded=True,
            )
        while time.monotonic() < deadline:
            # A decided attempt still writing its outcome (a ctx.transaction() commit that
            # waits on a lock) is waited for too: left behind, the process ended, the
            # commit was rolled back, and a job that succeeded was rescued as lost.
            # (Not the prefetched ones withdrawn above: they never run, and their release,
            # on a helper thread, forgets them once answered.)
            with self._lock:
                running = [
                    a
                    for a in self._attempts.values()
                    if (not a.decided and not a.released) or a.writing
                ]
            if not running:
                break
            time.sleep(0.02)
        with self._lock:
            running = [a for a in self._attempts.values() if not a.decided]
        # Past its timeout, still running: that is its outcome (given back uncharged, it
        # ran again at every start and never reached the dead-letter queue); one inside
        # a step is recorded once the step is over (below), or by the lease keeper when
        # its timeout's abandon_after is up, as it would be without the stop.
        for attempt in running:
            if attempt.timed_out and not _steps_in_flight(attempt):
                abandon(self, attempt, "the handler still ran when the worker stopped")
        # The stop takes the others over, each in one step with its handler's decision
        # (those deciding right now keep their outcome, and their transaction): their
        # handlers' ends record nothing from now on; the stop gives the jobs back below.
        leftover = [a for a in running if a.stop_for_shutdown()]
        if leftover:
            # Asked to stop first (ctx.cancelled, a task cancelled, a child killed): no
            # step's fn starts from now on. Their transactions are let go of (rolled
            # back): a handler may still be in a statement.
            for attempt in leftover:
                attempt.interrupt(SHUTDOWN, self.loop)
                runtime = attempt.runtime  # (read once: see Attempt.unlink)
                if runtime is not None:
                    runtime.let_go()
            settle_by = time.monotonic() + self.abandon_after
            # Stop them as a timeout would (an embedded worker's process lives on)...
            interrupt_threads(self, leftover, min(INTERRUPT_AFTER, self.grace or INTERRUPT_AFTER))
            # ...then give each job back as soon as its steps are over (bounded): the
            # release is recorded on each job.
            self._give_back_after_steps(leftover, settle_by)
        self._stop_releases.wait()  # (their answers, RELEASE_WAIT after the last began)
        self._wait_writes(max(self.grace, 5.0))
        self.completer.stop(timeout=max(self.grace, 5.0))
        self.leases.stop()
        if self.listener is not None:
            self.listener.stop()
        if self.maintenance:
            self.maintenance.stop()
        self.threads.shutdown()
        if self.express_threads is not None:
            self.express_threads.shutdown()
        for children in (self.processes, self.suspect_processes):
            if children is not None:
                children.shutdown()
        if self.loop_runner:
            self.loop_runner.shutdown()
        try:
            backend, deadline = self.app.backend, time.monotonic() + DEREGISTER_WAIT

            def deregister() -> None:
                with calls_until(deadline):
                    backend.worker_deregister(self.id)

            call_within(deregister, DEREGISTER_WAIT, "deregistration", "errands-deregister")
        except Exception as exc:
            log.debug("could not deregister worker %s: %s", self.id, exc)
        # after the released jobs' events, which the events lane delivers first
        self.app.events.emit_later(
            "errands.worker.stopped", worker_id=self.id, processed=self.processed
        )
        with self.app._workers_lock:
            last = not (self.app._workers - {self})
        if last:
            # The App's last worker: the lanes' threads end (they start again at the next
            # call). A process starting and stopping workers of new Apps kept them all.
            # What is left at the bound is logged by the lanes, each by name.
            self.app.hooks.close(HOOK_DRAIN)
            self.app._close_process_lanes(stopping=self)  # (unless another App's runs)
        elif not self.app.hooks.drain(HOOK_DRAIN):
            log.warning(
                "on_dead hooks or event subscribers still ran %g s after stopping", HOOK_DRAIN
            )

    def _give_back_after_steps(self, attempts: list[Attempt], settle_by: float) -> None:
        """At a stop, after the grace period: give back the jobs of ``attempts`` (taken
        over by the stop, their handlers asked to stop), each as soon as it runs no
        durable step (ctx.step or ctx.astep: its fn, or the store of its result). Until
        then it keeps its slot and its lease, heartbeated, up to ``settle_by``
        (``abandon_after`` after they were asked to stop), as an attempt past its
        timeout, or an async handler's orphaned steps, are held. Released with a step
        still running, the job was run by another worker at once, which found no stored
        result and ran the step's effect again, beside the first. A step still running
        at ``settle_by`` is abandoned (logged): its job is given back, and the step may go
        on beside the job's next run, as a thread abandoned after its timeout may.

        One that timed out while its handler still ran has its timeout recorded instead
        (the lease keeper may have recorded it already). The others never wait for
        another job's step: held for the slowest one, a job whose handler had stopped
        when asked was charged a timeout that came meanwhile."""
        busy = self._give_back_idle(attempts)
        if not busy:
            return
        log.warning(
            "stopping: job(s) %s still run a durable step; waiting for them to end (up to "
            "%.1f s, abandon_after) before giving the job(s) back, so that no other worker "
            "runs a step beside them",
            _shown([a.id for a in busy]),
            max(settle_by - time.monotonic(), 0.0),
        )
        while busy and time.monotonic() < settle_by:
            time.sleep(0.02)
            busy = self._give_back_idle(busy)
        for attempt in busy:
            running = _steps_in_flight(attempt)
            if running:  # (not one whose step ended just now)
                log.error(
                    "job %s: step(s) %s still ran %g s after the worker asked its handler "
                    "to stop; the job's attempt ends without them and the step(s) are "
                    "abandoned (they may still be running beside the job's next run)",
                    attempt.id,
                    ", ".join(map(repr, running)),
                    self.abandon_after,
                    extra=job_extra(attempt.row),
                )
        self._end_at_stop(busy)

    def _give_back_idle(self, attempts: list[Attempt]) -> list[Attempt]:
        """End (:meth:`_end_at_stop`) those of ``attempts`` that run no step now; the
        others, returned, are still held."""
        busy = [a for a in attempts if _steps_in_flight(a)]
        if len(busy) < len(attempts):
            held = set(map(id, busy))
            self._end_at_stop([a for a in attempts if id(a) not in held])
        return busy

    def _end_at_stop(self, attempts: list[Attempt]) -> None:
        """The outcomes of attempts a stop took over: a timeout for one that timed out
        while its handler still ran, else a release (not one decided meanwhile: its
        timeout, by the lease keeper)."""
        for attempt in attempts:
            if attempt.timed_out:
                abandon(self, attempt, "the handler still ran when the worker stopped")
        given = [a for a in attempts if a.give_back()]
        if given:
            self.release(
                given,
                "grace period over: released %d running job(s) back to the queue",
                bounded=True,
            )

    def _wait_writes(self, timeout: float) -> None:
        """At a stop, after the grace period: wait up to ``timeout`` for the outcomes still
        being written in their handlers' own transactions (commits waiting on a lock)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                writing = [a.id for a in self._attempts.values() if a.writing]
            if not writing:
                return
            if time.monotonic() >= deadline:
                log.error(
                    "stopping: the outcome of job(s) %s is still being committed in its "
                    "ctx.transaction() after %g s; if the process ends first, the server "
                    "rolls it back and the job is rescued after its lease",
                    ", ".join(map(str, writing[:20])),
                    timeout,
                )
                return
            time.sleep(0.02)

    def release(
        self,
        attempts: list[Attempt],
        message: str,
        level: int = logging.WARNING,
        *,
        unrun: bool = False,
        prefetched: bool = False,
        bounded: bool = False,
    ) -> None:
        """Give the leases of ``attempts`` back (available again, the attempt not charged,
        the release recorded on the job; ``unrun``: their handlers never ran, see
        :meth:`Backend.job_release_many`; ``prefetched``: claimed and never begun, nothing
        recorded on the job). Each attempt ends with an event: ``released``;
        ``stale_write_rejected`` (outcome ``released``) when its lease was no longer held
        (rescued or cancelled meanwhile); ``write_failed`` when the store could not be
        written (it is rescued after its lease). Without one, the in-flight gauge and the
        attempt's process span stayed open for good.

        ``bounded``: from the stop, whose exit must not wait for a store that does not
        answer: the write is begun on a helper thread of its own and this returns at once;
        the rest is done when its answer comes, or when the stop gives up waiting for it
        (see :class:`_StopReleases`)."""
        if bounded:
            self._stop_releases.begin(attempts, message, level, unrun=unrun, prefetched=prefetched)
            return
        released: list[bool | None]
        try:
            released = self.release_write(attempts, message, unrun=unrun, prefetched=prefetched)
        except Exception:
            log.exception("could not release running jobs; they are rescued after their lease")
            released = [None] * len(attempts)
        self.release_done(attempts, released, message, level)

    def release_write(
        self,
        attempts: list[Attempt],
        message: str,
        *,
        unrun: bool = False,
        prefetched: bool = False,
        delays: list[float] | None = None,
    ) -> list[bool | None]:
        """The store's part of :meth:`release`, raising what the store raises: whether
        each lease was given back (False: no longer held). ``delays``: each job's pause
        before it is due again (a give-back of the completer's; none: due at once)."""
        return list(
            self.app.backend.job_release_many(
                [
                    LeaseRef(a.id, a.token, a.lease_seconds, fair=a.row.fair_key is not None)
                    for a in attempts
                ],
                f"released by worker {self.id} ({message % len(attempts)}); the attempt "
                "is not charged and the job runs again",
                unrun=unrun,
                prefetched=prefetched,
                delays=delays,
            )
        )

    def release_done(
        self,
        attempts: list[Attempt],
        released: list[bool | None],
        message: str,
        level: int = logging.WARNING,
    ) -> None:
        """The rest of :meth:`release` once its write was made (or given up on, None):
        the log lines, each attempt's event, and the attempts forgotten."""
        try:
            ids = [a.id for a, ok in zip(attempts, released, strict=True) if ok]
            if ids:
                log.log(level, message + " (attempt not charged): job(s) %s", len(ids), _shown(ids))
            refused = [a.id for a, ok in zip(attempts, released, strict=True) if ok is False]
            if refused:
                log.log(
                    level,
                    "could not release job(s) %s: no longer held by this worker (rescued or "
                    "cancelled meanwhile)",
                    _shown(refused),
                )
            events = self.app.events
            for attempt, ok in zip(attempts, released, strict=True):
                # (from a handler's thread too: its subscribers off it)
                fields = job_fields(attempt.row)
                if ok:
                    events.emit_later("errands.job.released", **fields)
                elif ok is False:
                    events.emit_later(
                        "errands.job.stale_write_rejected", **fields, outcome="released"
                    )
                else:
                    events.emit_later("errands.job.write_failed", **fields, outcome="released")
        finally:
            with self._lock:
                for attempt in attempts:
                    self._attempts.pop((attempt.id, attempt.token), None)

    def release_in_background(
        self, attempts: list[Attempt], message: str, *, prefetched: bool = False
    ) -> None:
        """:meth:`release`, on a thread of its own: from a thread that must not wait for a
        store that may be out of reach (the lease keeper, the event loop)."""
        threading.Thread(
            target=self.release,
            args=(attempts, message),
            kwargs={"prefetched": prefetched},
            name="errands-release",
            daemon=True,
        ).start()

    def threads_for(self, attempt: Attempt) -> ThreadRunner:
        """The handler threads ``attempt`` runs on: the express lane's or the slots'."""
        if attempt.express and self.express_threads is not None:
            return self.express_threads
        return self.threads

    def stuck_threads(self) -> int:
        """Handler threads that ignored a timeout or shutdown and still run."""
        express = self.express_threads.stuck() if self.express_threads is not None else 0
        return (
            express
            + self.threads.stuck()
            + sum(
                1
                for a in self.attempts()
                if a.released and (call := a.future) is not None and not call.done()
            )
        )


class _StopReleases:
    """The releases of a stopping worker (its prefetched jobs as the stop begins, the jobs
    it took over at the end of the grace period, each as soon as its steps are over): each
    written on a helper thread of its own as soon as the stop makes it, so that none ever
    fails untried: one waiting for a lock (a job's row another session holds FOR UPDATE,
    SQLite's write lock) holds no other back; with one helper for them all, every later
    release of the stop failed at once while it waited, and those jobs, left running, were
    rescued after their leases and charged as lost. The stop goes on meanwhile; each
    answer is taken as it comes (Worker.release_done: its log line, its events, the
    attempt forgotten). Before leaving the registry, the stop waits for those still
    unanswered until ``RELEASE_WAIT`` after the last release began at most (one deadline
    for them all: the waits overlap), then logs the jobs not given back (their leases run
    out and they are rescued). A stop makes few releases (one a look at the steps that
    ended: at most one a job it held), so few threads.

    A write still waiting then goes on in its helper: on PostgreSQL its wait for a pool
    connection ends at the deadline (base.calls_until), and so does its statements' wait
    for a row lock another session holds (lock_timeout), as, on SQLite, its wait for the
    write lock; a statement already sent may still land (the server's answer slow to
    come). Landing after the stop, even after the worker left the registry, it is the
    release the stop meant (the job available, uncharged), fenced by the attempt's lease
    token: once the job has been rescued (its lease ran out) or taken by another worker,
    it changes nothing. Only its events were sent already (``write_failed``). When the
    process exits, its session ends with it, and a statement not committed is rolled back.
    """

    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        self._lock = threading.Lock()
        self._pending: list[_StopRelease] = []
        self._until = 0.0  # RELEASE_WAIT after the last release began (time.monotonic())

    def begin(
        self,
        attempts: list[Attempt],
        message: str,
        level: int,
        *,
        unrun: bool = False,
        prefetched: bool = False,
    ) -> None:
        """Begin the release of ``attempts`` on a helper thread of its own."""
        worker = self._worker
        deadline = time.monotonic() + RELEASE_WAIT
        release = _StopRelease(attempts, message, level)
        with self._lock:
            self._pending.append(release)
            self._until = max(self._until, deadline)

        def write() -> None:
            try:
                with calls_until(deadline):
                    answer = worker.release_write(
                        attempts, message, unrun=unrun, prefetched=prefetched
                    )
            except Exception as exc:
                if release.take():
                    # (past the deadline: a pool checkout or SQLite's lock wait gave up)
                    late = time.monotonic() >= deadline
                    log.error(
                        "stopping: could not give back job(s) %s (%s%s: %s); no heartbeat "
                        "renews their leases any more, and they are rescued once the "
                        "leases run out",
                        _shown([a.id for a in attempts]),
                        f"no answer to their release within {RELEASE_WAIT:g} s: " if late else "",
                        type(exc).__name__,
                        exc,
                    )
                    self._done(release, [None] * len(attempts))
            else:
                if release.take():
                    self._done(release, answer)

        threading.Thread(target=write, name="errands-stop-release", daemon=True).start()

    def _done(self, release: _StopRelease, answer: list[bool | None]) -> None:
        try:
            self._worker.release_done(release.attempts, answer, release.message, release.level)
        finally:
            with self._lock, contextlib.suppress(ValueError):
                self._pending.remove(release)

    def wait(self) -> None:
        """Wait for the answers still to come, until ``RELEASE_WAIT`` after the last
        release began at most; then log the jobs not given back, and end their attempts
        (a late answer is not read)."""
        while True:
            with self._lock:
                pending, until = list(self._pending), self._until
            if not pending:
                return
            if time.monotonic() >= until:
                break
            time.sleep(0.02)
        for release in pending:
            if not release.take():  # (answered just now)
                continue
            log.error(
                "stopping: could not give back job(s) %s (no answer to their release "
                "within %g s); the worker exits without waiting: no heartbeat renews their "
                "leases any more, and they are rescued once the leases run out",
                _shown([a.id for a in release.attempts]),
                RELEASE_WAIT,
            )
            self._done(release, [None] * len(release.attempts))


class _StopRelease:
    """One release of a stop (_StopReleases): taken once, by its answer or by the stop
    giving up on it."""

    __slots__ = ("_lock", "attempts", "level", "message", "taken")

    def __init__(self, attempts: list[Attempt], message: str, level: int) -> None:
        self.attempts = attempts
        self.message = message
        self.level = level
        self.taken = False
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self.taken:
                return False
            self.taken = True
            return True


def _steps_in_flight(attempt: Attempt) -> list[str]:
    """The durable steps of an undecided attempt still running (their fn, or the store of
    their result)."""
    runtime = attempt.runtime
    if attempt.decided or runtime is None:
        return []
    return runtime.steps_in_flight()


def _shown(ids: list[int]) -> str:
    """Job ids as a log line names them: the first 20, then how many more."""
    shown = ", ".join(map(str, ids[:20]))
    return shown + (f" and {len(ids) - 20} more" if len(ids) > 20 else "")


class _StoppedAtStartup(Exception):
    """A start-up step given up for the worker's stop (it waited for a store that was
    busy: a locked SQLite file): the worker stops, as asked, without an error."""
