"""The worker: a producer loop that claims jobs sized to free slots, plus its services.

With quick handlers a claim also takes up to ``prefetch`` jobs beyond the free slots;
they wait in the thread pool's queue, and the handler thread that takes one up prepares
it (payload, Context) and runs it, while the producer waits on its next claim.

::

    producer (this thread) ──claim──> ThreadRunner / LoopRunner ──outcome──> Completer
         ^  wakes on a freed slot            │                                │ fenced batch
         └───────────────────────────────────┘                                v
    LeaseKeeper: heartbeats, lost leases, cancels, timeouts            the store
    Maintenance: leader election, rescue, promotion, pruning

Graceful stop (SIGTERM/SIGINT, DESIGN §7): stop claiming; let in-flight handlers finish
within ``grace`` seconds while heartbeats keep their leases; release whatever still runs
(back to available, the attempt not charged); flush outcomes; resign leadership. A
second signal exits the process at once; those leases then expire and are rescued.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..backends import redact_url
from ..backends.base import (
    ClaimParams,
    FinishParams,
    LeaseRef,
    QueueClaim,
    QueueSettings,
    WorkerInfo,
)
from ..context import Context
from ..definition import check_name
from ..errors import ConfigurationError, InvalidPayload, UnknownJob, is_transient
from ..jobs import JobRow
from ..maintenance import Maintenance
from ..observability.logcontext import JobLogContext, install_record_factory, job_context
from ..payload import mask
from .completer import Completer
from .execution import Attempt, Interrupted, JobTimeout, outcome_for
from .leases import LeaseKeeper
from .process_pool import ChildResult, ProcessRunner
from .runners import Call, LoopRunner, ThreadRunner
from .runtime import AttemptRuntime

if TYPE_CHECKING:
    from ..app import App
    from ..definition import JobDefinition

log = logging.getLogger("errands.worker")

CONCURRENCY_DEFAULT = 10
GRACE_DEFAULT = 30.0
POLL_INTERVAL_DEFAULT = 1.0
RECHECK_AFTER_NOTIFY = 0.02
CLAIM_RETRY_MAX = 5.0  # seconds: failed claims are retried after poll_interval, doubling to this
BATCH_GATHER = 0.005  # with a backlog, wait up to this long for a batch's worth of free slots
# A prefetched job waits for a handler thread at most about this long on average: the
# worker holds concurrency * PREFETCH_HORIZON / (mean handler time) jobs beyond its slots.
PREFETCH_HORIZON = 0.05
PREFETCH_MULTIPLIER = 4  # the default prefetch: this many jobs per slot, at most
ABANDON_AFTER_DEFAULT = 10.0
INTERRUPT_AFTER = 1.0
EXIT_NOW_CODE = 1
# The event a stored outcome emits.
_EVENT_OF_STATE = {
    "completed": "errands.job.completed",
    "retryable": "errands.job.retrying",
    "cancelled": "errands.job.cancelled",
    "dead": "errands.job.dead",
}


def _queue_order(row: JobRow) -> tuple[int, float, int]:
    return -row.priority, row.run_at, row.id


def parse_queues(spec: str | Sequence[str] | Mapping[str, int] | None) -> dict[str, int | None]:
    """``"emails=10,payments=2"`` or ``["emails", "payments"]`` -> {queue: limit or None}."""
    if spec is None:
        return {}
    if isinstance(spec, Mapping):
        items: list[tuple[str, int | None]] = [(str(k), v) for k, v in spec.items()]
    else:
        parts = spec.split(",") if isinstance(spec, str) else list(spec)
        items = []
        for part in parts:
            name, _, limit_text = part.strip().partition("=")
            if not name:
                continue
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
        if limit is not None and limit < 1:
            raise ConfigurationError(f"queue {name!r}: concurrency must be at least 1")
        result[name] = limit
    return result


class Worker:
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
        if concurrency < 1:
            raise ConfigurationError("concurrency (-c) must be at least 1")
        self.concurrency = concurrency
        if grace < 0 or poll_interval <= 0:
            raise ConfigurationError("grace must be >= 0 and poll_interval > 0")
        self.grace = grace
        self.abandon_after = abandon_after
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
        if prefetch is not None and prefetch < 0:
            raise ConfigurationError("prefetch must be 0 (off) or more")
        # Prefetch queues claimed jobs for the handler threads; async handlers (all run at
        # once on the loop) and the process pool would run them beyond `concurrency`.
        threads_only = pool == "thread" and not any(d.is_async for d in app.registry.values())
        if prefetch is None:  # as Celery's worker_prefetch_multiplier (4) does
            prefetch = PREFETCH_MULTIPLIER * concurrency
        self.prefetch = prefetch if threads_only else 0
        self.processes: ProcessRunner | None = None
        self.poll_interval = poll_interval
        # keyed by (job id, lease token): after a lease loss the same worker may run a newer
        # attempt of a job while the stale one is still inside its handler
        self._attempts: dict[tuple[int, str], Attempt] = {}
        self._lock = threading.Lock()
        self._running_per_queue: dict[str, int] = dict.fromkeys(limits, 0)
        self._free = concurrency  # slots; below 0 while prefetched jobs wait for a thread
        self._extra = 0  # how many jobs beyond its slots the worker claims now (prefetch)
        self._mean_run: float | None = None  # handler time, moving average (seconds)
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._signals = 0
        self._backlog = False
        # With a backlog, the producer waits (up to BATCH_GATHER) for this many free slots
        # before claiming: one round trip brings a batch instead of one or two jobs.
        self._refill_at = max(1, concurrency // 2)
        self._rotation = 0
        self.threads = ThreadRunner(concurrency)
        self.loop_runner: LoopRunner | None = None
        self.completer = Completer(app, self._on_written, running=self._running_handlers)
        shortest = min([app.lease, *(d.lease for d in app.registry.values() if d.lease)])
        self.leases = LeaseKeeper(self, interval=max(shortest / 3, 0.2), on_timeout=self._timeout)
        tick = maintenance_tick if maintenance_tick is not None else min(1.0, app.lease / 4)
        self.maintenance = Maintenance(app, self.id, tick=tick) if maintenance else None
        self.processed = 0
        self.started_at = 0.0
        self.listener: Any = None
        self._notified = False
        self._limited: set[str] = set()
        self._suspects = 0  # rescued jobs running here (at most one)
        self._settings_due = 0.0
        self._suspect_due = 0.0
        self._wake_at = float("inf")  # a limited queue asked to be looked at again then

    # -- what the services see --------------------------------------------------------
    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self.loop_runner.loop if self.loop_runner else None

    def _running_handlers(self) -> int:
        return self.concurrency - self._free  # an int read: no lock needed for a hint

    def attempts(self) -> list[Attempt]:
        with self._lock:
            return list(self._attempts.values())

    # -- lifecycle ---------------------------------------------------------------------
    def run(self, *, install_signals: bool = True) -> int:
        """Run until stopped (signal or :meth:`stop`); returns the process exit code."""
        install_record_factory()
        self._at_startup("checking the schema", lambda: self.app.backend.schema_check())
        self._at_startup(
            "sizing connections", lambda: self.app.backend.configure_worker(self.concurrency)
        )
        if install_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)
        self.started_at = time.monotonic()
        if self.pool == "process":
            self.processes = ProcessRunner(self.app_path or "", self.app.url, self.concurrency)
        self._register()
        self._at_startup("declaring queue settings", self._declare)
        self._refresh_settings(force=True)
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
        try:
            self._produce()
        finally:
            self._shutdown()
        return 0

    def _at_startup(self, what: str, step: Callable[[], object]) -> None:
        """Run a startup step, retrying while the store errs transiently (a killed session,
        a restart, a busy SQLite file): a worker restarted mid-fault waits it out instead
        of dying with a traceback. Anything else (an outdated schema) fails at once, and a
        store unreachable when the worker opens it is one clear error line (exit 1)."""
        pause = self.poll_interval
        while True:
            try:
                step()
                return
            except Exception as exc:
                if not is_transient(exc) or self._stopping.is_set():
                    raise
                log.warning("%s failed (%s); retrying in %.1f s", what, exc, pause)
                self._stopping.wait(pause)
                pause = min(pause * 2, CLAIM_RETRY_MAX)

    def _register(self) -> None:
        from .. import __version__

        try:
            self.app.backend.worker_register(
                WorkerInfo(
                    id=self.id,
                    host=socket.gethostname(),
                    pid=os.getpid(),
                    queues=",".join(f"{q}={n}" if n else q for q, n in self.queue_limits.items()),
                    concurrency=self.concurrency,
                    version=__version__,
                )
            )
        except Exception:
            log.exception("could not register this worker; it runs unlisted")

    def registry_beat(self) -> None:
        """Tell the registry this worker is alive (dashboard and status show it)."""
        try:
            with self._lock:
                in_flight = self.concurrency - self._free
            self.app.backend.worker_heartbeat(self.id, in_flight, self.processed)
        except Exception as exc:
            log.debug("worker registry heartbeat failed: %s", exc)

    def stop(self) -> None:
        """Begin a graceful stop (what the first SIGTERM does)."""
        self._stopping.set()
        self._wake.set()

    def _on_notify(self, queue: str | None) -> None:
        if queue is None or queue in self.queue_limits:
            self._notified = True
            self._wake.set()

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signals += 1
        if self._signals > 1:
            log.warning("second signal: exiting now; running jobs are rescued after their lease")
            logging.shutdown()
            os._exit(EXIT_NOW_CODE)
        log.info(
            "%s received: finishing in-flight jobs (up to %.0f s), claiming no more",
            signal.Signals(signum).name,
            self.grace,
        )
        self.stop()

    # -- the producer ------------------------------------------------------------------
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
        while not self._stopping.is_set():
            self._extra = self._prefetch_now()
            self._refill_at = max(1, (self.concurrency + self._extra) // 2)
            with self._lock:
                free = self._free
                room = free + self._extra
                plan = self._claim_plan(room) if room > 0 else []
            if not plan:  # every slot busy: a finishing handler wakes us
                self._wake.wait(self.poll_interval)
                self._wake.clear()
                continue
            if self._backlog and room < self._refill_at and not gathered:
                # With a backlog, give finishing handlers a moment to free a batch's worth
                # of slots: one claim then brings many jobs instead of one or two.
                gathered = True
                self._wake.wait(BATCH_GATHER)
                self._wake.clear()
                continue
            gathered = False
            try:
                rows = self._claim(plan, room, free)
                pause = self.poll_interval
            except Exception as exc:
                log.warning("claim failed (%s); retrying in %.1f s", exc, pause)
                self._stopping.wait(pause)
                pause = min(pause * 2, CLAIM_RETRY_MAX)
                continue
            self._start_all(rows)
            self._backlog = bool(rows) and len(rows) >= room
            if self._backlog:
                continue
            # Woken by a notification: look once more shortly after, since notifications
            # are coalesced and a job committed just after this claim may have sent none.
            wait = RECHECK_AFTER_NOTIFY if self._notified else self.poll_interval
            wait = max(min(wait, self._wake_at - time.monotonic()), 0.0)
            self._wake_at = float("inf")
            self._notified = False
            self._wake.wait(wait)
            self._wake.clear()

    def _prefetch_now(self) -> int:
        """Jobs to hold beyond the slots: enough that one claim carries a batch, few enough
        that each waits for a thread about PREFETCH_HORIZON on average (none for slow
        handlers, which another worker may be free to run now)."""
        mean = self._mean_run
        if not self.prefetch or mean is None:
            return 0
        return min(self.prefetch, int(self.concurrency * PREFETCH_HORIZON / max(mean, 1e-6)))

    def _ran_for(self, seconds: float) -> None:
        mean = self._mean_run  # a racy update of a float: a lost sample is harmless
        self._mean_run = seconds if mean is None else mean + (seconds - mean) * 0.1

    def _claim(self, plan: list[QueueClaim], room: int, free: int) -> list[JobRow]:
        """Unlimited queues in one claim; each limited queue on its own serialised path.

        ``room`` counts the prefetch beyond the ``free`` slots; limited queues (counted
        cluster-wide) claim only for free slots, so no waiting job holds their quota.
        """
        self._refresh_settings()
        backend = self.app.backend
        rows: list[JobRow] = []
        if not self._suspect_running and time.monotonic() >= self._suspect_due:
            # Rescued jobs first (one at most): a steady backlog of fresh jobs fills every
            # free slot, and would otherwise keep them waiting until it drains. A suspect
            # goes ahead of the prefetched jobs (the next free thread takes it).
            rows = self._claim_suspect(plan)
            if rows:
                taken = rows[0].queue
                plan = [QueueClaim(q.name, q.limit - (q.name == taken)) for q in plan]
                plan = [q for q in plan if q.limit > 0]
        fast = [q for q in plan if q.name not in self._limited]
        if fast and room > len(rows):
            claimed = backend.job_claim(
                ClaimParams(fast, room - len(rows), self.id, self.app.lease)
            )
            # A claim's rows come back in no set order; a batch starts in queue order
            # (handler threads take them first in, first out).
            rows += sorted(claimed, key=_queue_order)
        for queue in plan:
            take = min(queue.limit, free - len(rows))
            if queue.name in self._limited and take > 0:
                limited = backend.job_claim_limited(
                    QueueClaim(queue.name, take), self.id, self.app.lease
                )
                rows += limited
                retry_in = getattr(limited, "retry_in", None)
                if retry_in is not None:  # a rate window frees up then: look again at that time
                    self._wake_at = min(self._wake_at, time.monotonic() + retry_in)
        return rows

    @property
    def _suspect_running(self) -> bool:
        return self._suspects > 0

    def _claim_suspect(self, plan: list[QueueClaim]) -> list[JobRow]:
        """At most one rescued job, and only while no other one runs here.

        A worker that died may have been killed by any job it held. Running rescued jobs
        (suspects) one at a time per worker, never beside another suspect, means a job
        that keeps crashing its worker takes no bystander along to the DLQ as poison.
        """
        backend = self.app.backend
        fast = [QueueClaim(q.name, 1) for q in plan if q.name not in self._limited]
        if fast:
            rows = backend.job_claim(ClaimParams(fast, 1, self.id, self.app.lease, suspects=True))
            if rows:
                return rows
        for queue in plan:
            if queue.name in self._limited:
                rows = backend.job_claim_limited(
                    QueueClaim(queue.name, 1), self.id, self.app.lease, suspects=True
                )
                if rows:
                    return rows
        # None waiting: look again a poll interval from now. After one was found, the
        # next is looked for as soon as it ends, so a burst of rescued jobs drains at the
        # pace they run, not one per poll interval.
        self._suspect_due = time.monotonic() + self.poll_interval
        return []

    def _refresh_settings(self, force: bool = False) -> None:
        """Learn which queues are limited (cluster-wide limits live in the database)."""
        now = time.monotonic()
        if not force and now < self._settings_due:
            return
        self._settings_due = now + self.poll_interval
        try:
            self._limited = {s.name for s in self.app.backend.queue_settings() if s.limited}
        except Exception as exc:
            log.debug("could not read queue settings (%s); keeping the last ones", exc)

    def _declare(self) -> None:
        """Store the limits this app declares in code, so every worker enforces them."""
        backend = self.app.backend
        keyed = {d.queue for d in self.app.registry.values() if d.limited}
        current = {s.name: s for s in backend.queue_settings()}
        for name in sorted(set(self.app.queues) | keyed):
            declared = self.app.queues.get(name) or current.get(name) or QueueSettings(name)
            backend.queue_declare(replace(declared, has_keys=name in keyed), f"worker:{self.id}")
        for definition in self.app.registry.values():  # a rate removed in code is cleared
            limit, period = definition.rate or (None, None)
            backend.job_limit_declare(definition.name, definition.queue, limit, period)

    def _start(self, row: JobRow) -> None:
        self._start_all([row])

    def _start_all(self, rows: list[JobRow]) -> None:
        """Take on a claim's rows: one hold of the lock for the batch, then dispatch each."""
        registry, lease = self.app.registry, self.app.lease
        attempts = [
            Attempt(
                row=row, definition=registry.get(row.name), lease_seconds=row.lease_seconds or lease
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
            self._free -= len(attempts)
        for attempt in attempts:
            self._dispatch(attempt)

    def _dispatch(self, attempt: Attempt) -> None:
        row, definition = attempt.row, attempt.definition
        if definition is not None and not definition.is_async and self.processes is None:
            # A sync handler: the thread that runs it also prepares it (payload, Context),
            # while this thread is already waiting on the next claim.
            attempt.waiting = True
            attempt.future = self.threads.submit(
                lambda: self._run_in_thread(attempt, definition),
                lambda exc, result: self._handler_result(attempt, exc, result),
                urgent=row.rescues > 0,
            )
            return
        prepared = self._prepare(attempt)
        if prepared is None:
            return
        kwargs, log_ctx = prepared
        assert definition is not None  # _prepare decided an unknown job
        timeout = row.timeout
        if definition.is_async:
            if self.loop_runner is None:
                self.loop_runner = LoopRunner()
            future = self.loop_runner.submit(
                lambda: self._run_async(attempt, definition.fn, kwargs, timeout, log_ctx)
            )
            attempt.future = future
            future.add_done_callback(lambda f: self._handler_done(attempt, f))
            return
        assert self.processes is not None
        if timeout:
            attempt.deadline = attempt.started + timeout
            self.leases.poke()
        child = self.processes.submit(row)
        attempt.future = child
        runner = self.processes

        def kill(exc: BaseException) -> None:
            runner.kill(child, exc)

        attempt.kill = kill
        child.add_done_callback(lambda f: self._handler_done(attempt, f))

    def _prepare(self, attempt: Attempt) -> tuple[dict[str, Any], JobLogContext] | None:
        """Decode the payload and build the Context; None when that decided the outcome
        (an unknown job, an invalid payload)."""
        row, definition = attempt.row, attempt.definition
        if definition is None:
            known = ", ".join(sorted(self.app.registry)) or "none"
            error = UnknownJob(
                f"no handler registered for job {row.name!r} in this worker; it knows: {known}. "
                "Deploy the code that defines it (a newer worker may know it)"
            )
            self._decided(attempt, error, None)
            return None
        try:
            attempt.kwargs = definition.payload.decode(row.args)
        except InvalidPayload as exc:
            self._decided(attempt, exc, None)
            return None
        attempt.runtime = AttemptRuntime(self.app, attempt)
        attempt.ctx = Context(
            job_id=row.id,
            name=row.name,
            queue=row.queue,
            attempt=row.attempt,
            max_attempts=row.max_attempts,
            key=row.idempotency_key,
            worker_id=self.id,
            logger=definition.logger,
            _runtime=attempt.runtime,
        )
        if attempt.stop_reason is not None:  # an interrupt that came before its ctx did
            attempt.ctx._request_cancel(attempt.stop_reason)
        kwargs = dict(attempt.kwargs)
        if definition.payload.context_param:
            kwargs[definition.payload.context_param] = attempt.ctx
        if self.app.events.wants("errands.job.started"):
            self.app.events.emit(
                "errands.job.started",
                **self._job_fields(row),
                args=mask(attempt.kwargs, definition.sensitive),
                queue_wait=max((row.attempted_at or row.run_at) - row.run_at, 0.0),
                meta=row.meta,
            )
        return kwargs, JobLogContext(row.id, row.name, row.queue, row.attempt)

    def _run_in_thread(self, attempt: Attempt, definition: JobDefinition[Any, Any]) -> Any:
        """A sync handler's attempt, in a handler thread, from its start to its return."""
        if not attempt.begin():
            return None  # withdrawn at shutdown before it began: released
        if attempt.stop_reason is not None:  # cancelled, or its lease lost, while it waited
            raise Interrupted(attempt.stop_reason)
        began = time.monotonic()
        if began >= attempt.lease_valid_until:
            # No heartbeat confirmed its lease for a whole lease (this process was frozen,
            # or the store unreachable): another worker may run it by now. Hand the lease
            # back (fenced) instead of running it beside that one.
            attempt.released = True
            self._release([attempt], "released %d prefetched job(s) whose lease may have run out")
            self._slot_freed(attempt)
            return None
        attempt.started = began
        prepared = self._prepare(attempt)
        if prepared is None:
            return None  # decided already; the outcome handed back is ignored
        kwargs, log_ctx = prepared
        if attempt.stop_reason is not None:  # interrupted while it was being prepared
            raise Interrupted(attempt.stop_reason)
        timeout = attempt.row.timeout
        if timeout:
            attempt.deadline = began + timeout
            self.leases.poke()
        events = self.app.events
        try:
            with job_context(log_ctx):
                if not events.wrappers:  # the common case: nothing to wrap it in
                    return definition.fn(**kwargs)
                info = {**self._job_fields(attempt.row), "meta": attempt.row.meta}
                with events.around_handler(info):
                    return definition.fn(**kwargs)
        finally:
            self._ran_for(time.monotonic() - began)

    async def _run_async(
        self,
        attempt: Attempt,
        fn: Any,
        kwargs: dict[str, Any],
        timeout: float | None,
        log_ctx: JobLogContext,
    ) -> Any:
        attempt.task = asyncio.current_task()
        if attempt.ctx is not None and attempt.ctx.cancelled:  # stopped before it began
            raise Interrupted(attempt.ctx.cancel_reason)
        info = {**self._job_fields(attempt.row), "meta": attempt.row.meta}
        with job_context(log_ctx), self.app.events.around_handler(info):
            try:
                if timeout:
                    return await asyncio.wait_for(fn(**kwargs), timeout)
                return await fn(**kwargs)
            except TimeoutError:
                if attempt.ctx is not None and attempt.ctx.cancelled:
                    raise Interrupted(attempt.ctx.cancel_reason) from None
                raise JobTimeout(f"timed out after {timeout:g} s") from None
            except asyncio.CancelledError:
                reason = attempt.ctx.cancel_reason if attempt.ctx else "cancelled"
                raise Interrupted(reason or "cancelled") from None

    def _handler_done(self, attempt: Attempt, future: Any) -> None:
        if future.cancelled():  # an async task cancelled before it began (shutdown)
            self._decided(attempt, Interrupted("shutdown"), None)
            return
        exc = future.exception()
        self._handler_result(attempt, exc, None if exc is not None else future.result())

    def _handler_result(self, attempt: Attempt, exc: BaseException | None, result: Any) -> None:
        if isinstance(result, ChildResult):
            self._child_done(attempt, result)
            return
        if attempt.timed_out:
            # Past its deadline, whatever it did next (returned early on ctx.cancelled,
            # or unwound from the interrupt) is a timeout, never a completion.
            timeout = JobTimeout(f"timed out after {attempt.row.timeout or 0:g} s")
            timeout.__cause__ = exc
            exc, result = timeout, None
        self._decided(attempt, exc, result)

    def _child_done(self, attempt: Attempt, result: ChildResult) -> None:
        """A process-pool attempt returned: record it (the child may have written it)."""
        if attempt.released or not attempt.decide():
            return
        attempt.ended = time.monotonic()
        outcome = outcome_for(attempt, None, result.result_json, self.id)
        if result.children:
            outcome = replace(outcome, children=tuple(result.children))
        self._slot_freed(attempt)
        if result.written is not None:
            self._on_written(attempt, outcome, result.written)
        else:
            self.completer.submit(attempt, outcome)

    def _slot_freed(self, attempt: Attempt) -> None:
        suspect = attempt.row.rescues > 0  # its end lets the next rescued job be claimed
        with self._lock:
            self._free += 1
            self._running_per_queue[attempt.row.queue] -= 1
            self._suspects -= suspect
            room = self._free + self._extra
            refill = self._backlog and (room == 1 or room >= self._refill_at)
        if refill or suspect:
            self._wake.set()

    def _timeout(self, attempt: Attempt) -> None:
        """A sync handler's deadline passed: stop it in three steps, gentlest first.

        1. at the timeout: ``ctx.cancelled`` turns true (a cooperative handler returns);
        2. ``INTERRUPT_AFTER`` later: HandlerInterrupt is raised inside its thread;
        3. ``abandon_after`` after the timeout: the timeout is recorded and the thread,
           blocked in some C call, is left to finish alone.

        Until then the attempt keeps its slot and its heartbeated lease, so its retry can
        never run beside it; whatever the handler does after its deadline is recorded as
        a timeout, never as a completion.
        """
        timeout = attempt.row.timeout or 0
        if attempt.definition is None or attempt.definition.is_async or attempt.kill:
            attempt.deadline = None
            attempt.interrupt("timeout", self.loop)  # wait_for, or the child is killed
            return
        now = time.monotonic()
        if not attempt.timed_out:
            attempt.timed_out = True
            attempt.timeout_at = now
            attempt.interrupt("timeout", self.loop)
            attempt.deadline = now + min(INTERRUPT_AFTER, self.abandon_after)
            log.warning(
                "job %s ran past its %g s timeout; asking its handler to stop", attempt.id, timeout
            )
            return
        if not attempt.interrupted and now < attempt.timeout_at + self.abandon_after:
            attempt.interrupted = True
            if isinstance(attempt.future, Call):
                self.threads.interrupt(attempt.future)
            attempt.deadline = attempt.timeout_at + self.abandon_after
            log.warning("job %s is still running past its timeout; interrupting it", attempt.id)
            return
        attempt.deadline = None
        error = JobTimeout(
            f"timed out after {timeout:g} s; the handler ignored the interrupt for "
            f"{self.abandon_after:g} s and was abandoned (it may still be running)"
        )
        if self._decided(attempt, error, None) and isinstance(attempt.future, Call):
            self.threads.abandon(attempt.future)
            log.error(
                "job %s: handler did not stop %g s after its timeout; thread abandoned",
                attempt.id,
                self.abandon_after,
            )

    def _decided(self, attempt: Attempt, exc: BaseException | None, result: Any) -> bool:
        """The attempt's outcome is known: free its slot and hand the write to the completer.

        Returns False when another outcome was decided first (this one is ignored).
        """
        if attempt.released or not attempt.decide():
            return False
        attempt.ended = time.monotonic()
        result_json = None
        if exc is None and attempt.definition is not None:
            try:
                result_json = attempt.definition.payload.encode_result(result)
            except InvalidPayload as bad:
                exc = bad
        outcome = outcome_for(attempt, exc, result_json, self.id)
        runtime = attempt.runtime
        written: bool | None = None
        if runtime is not None:
            if outcome.state == "completed" and runtime.children:
                outcome = replace(outcome, children=tuple(runtime.children))
            if runtime.tx is not None:
                if outcome.state == "completed":
                    outcome, written = self._commit_transaction(attempt, outcome)
                else:
                    runtime.rollback()
        self._slot_freed(attempt)
        if written is not None:
            self._on_written(attempt, outcome, written)
        else:
            self.completer.submit(attempt, outcome)
        return True

    def _commit_transaction(
        self, attempt: Attempt, outcome: FinishParams
    ) -> tuple[FinishParams, bool | None]:
        """Complete the job inside the handler's own transaction, right here: the
        transaction may hold SQLite's write lock, so no other writer can go first."""
        runtime = attempt.runtime
        assert runtime is not None
        tx, runtime.tx = runtime.tx, None
        try:
            return outcome, self.app.backend.tx_finish(tx, outcome)
        except Exception as exc:
            log.exception("job %s: committing its transaction failed; retrying it", attempt.id)
            failure = outcome_for(attempt, exc, None, self.id)
            return failure, None

    @staticmethod
    def _job_fields(row: JobRow) -> dict[str, Any]:
        return {
            "job_id": row.id,
            "job_name": row.name,
            "queue": row.queue,
            "attempt": row.attempt,
            "max_attempts": row.max_attempts,
        }

    def _on_written(self, attempt: Attempt, outcome: FinishParams, accepted: bool) -> None:
        with self._lock:
            self._attempts.pop((attempt.id, attempt.token), None)
        self.processed += 1
        events = self.app.events
        if not accepted:
            if events.wants("errands.job.stale_write_rejected"):
                fields = self._job_fields(attempt.row)
                events.emit("errands.job.stale_write_rejected", **fields, outcome=outcome.state)
            return
        state = outcome.state
        cancelled = attempt.ctx is not None and attempt.ctx.cancel_reason == "cancelled"
        if state in ("retryable", "dead") and cancelled:
            state = "cancelled"  # the store records a failure after a cancel as cancelled
        name = _EVENT_OF_STATE[state]
        if events.wants(name):  # usually not, for completed (a debug line): build nothing
            fields = self._job_fields(attempt.row)
            fields["duration"] = (attempt.ended or time.monotonic()) - attempt.started
            error = outcome.error or {}
            if state == "retryable":
                fields["delay"] = outcome.delay
            if state in ("retryable", "dead"):
                fields["error_type"] = error.get("type")
                fields["error_message"] = error.get("message")
            if state == "dead":
                fields["reason"] = error.get("kind")
            events.emit(name, **fields)
        if state == "dead":
            self.app.run_dead_hooks(attempt.row.id)

    # -- stopping ----------------------------------------------------------------------
    def _shutdown(self) -> None:
        deadline = time.monotonic() + self.grace
        with self._lock:
            waiting = [a for a in self._attempts.values() if a.waiting]
        withdrawn = [a for a in waiting if a.withdraw()]
        if withdrawn:  # prefetched, never begun: back to the queue at once, not run
            self._release(withdrawn, "stopping: released %d prefetched job(s)", logging.INFO)
        while time.monotonic() < deadline:
            with self._lock:
                running = [a for a in self._attempts.values() if not a.decided]
            if not running:
                break
            time.sleep(0.02)
        with self._lock:
            leftover = [a for a in self._attempts.values() if not a.decided]
        if leftover:
            for attempt in leftover:
                attempt.released = True
                attempt.interrupt("shutdown", self.loop)
                if attempt.runtime is not None:
                    attempt.runtime.rollback()
            self._release(
                leftover, "grace period over: released %d running job(s) back to the queue"
            )
        self.completer.stop(timeout=max(self.grace, 5.0))
        self.leases.stop()
        if self.listener is not None:
            self.listener.stop()
        if self.maintenance:
            self.maintenance.stop()
        self.threads.shutdown()
        if self.processes is not None:
            self.processes.shutdown()
        if self.loop_runner:
            self.loop_runner.shutdown()
        try:
            self.app.backend.worker_deregister(self.id)
        except Exception as exc:
            log.debug("could not deregister worker %s: %s", self.id, exc)
        self.app.events.emit("errands.worker.stopped", worker_id=self.id, processed=self.processed)

    def _release(self, attempts: list[Attempt], message: str, level: int = logging.WARNING) -> None:
        """Give the leases of ``attempts`` back (available again, the attempt not charged)."""
        try:
            released = self.app.backend.job_release_many(
                [LeaseRef(a.id, a.token, a.lease_seconds) for a in attempts]
            )
            log.log(level, message + " (attempt not charged)", sum(released))
            for attempt, ok in zip(attempts, released, strict=True):
                if ok:
                    self.app.events.emit("errands.job.released", **self._job_fields(attempt.row))
        except Exception:
            log.exception("could not release running jobs; they are rescued after their lease")
        with self._lock:
            for attempt in attempts:
                self._attempts.pop((attempt.id, attempt.token), None)

    def stuck_threads(self) -> int:
        """Handler threads that ignored a timeout or shutdown and still run."""
        return self.threads.stuck() + sum(
            1 for a in self.attempts() if a.released and a.future and not a.future.done()
        )
