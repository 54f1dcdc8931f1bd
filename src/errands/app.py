"""``errands.App``: the registry of jobs, the store they live in, and the admin calls."""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar, overload

from pydantic_core import PydanticSerializationError, to_json

from . import offloop
from .backends import SQLITE_URL_DEFAULT, Backend, open_backend, redact_url
from .backends.base import (
    ActionParams,
    ActionResult,
    AuditEvent,
    CancelResult,
    EditParams,
    FairKeyFigures,
    JobEdit,
    ListParams,
    QueueSettings,
    QueueStats,
    SignalResult,
)
from .backends.fair import UNKEYED, CallableWeights, check_weight
from .backends.limits import LIMIT_MAX, parse_rate
from .backends.workflow_store import WorkflowInserted, WorkflowSpec
from .definition import (
    KEY_MAX_BYTES,
    BoundJob,
    EnqueueOptions,
    JobDefinition,
    check_name,
    check_text,
    checked_epoch,
    checked_id,
    checked_ids,
    checked_limit,
    checked_priority,
    seconds,
    shown,
)
from .errors import (
    ConfigurationError,
    InvalidPayload,
    InvalidTransition,
    JobNotFound,
    connection_lost,
    is_transient,
)
from .forking import reset_at_fork
from .handle import JobHandle
from .hooks import (
    BACKOFF_TIMEOUT,
    HOOK_TIMEOUT_DEFAULT,
    HookRunner,
    HookTimeout,
    LaneClosed,
    close_shared,
)
from .hooks import describe as describe_callable
from .interrupts import shielded
from .jobs import Job, JobRow, Step, listed_by_priority, parse_cursor, parse_state
from .observability.events import EventBus
from .observability.lifecycle_log import log_event
from .payload import MAX_PAYLOAD_BYTES_DEFAULT, MAX_RESULT_BYTES_DEFAULT, unstorable_json
from .results import ResultHub
from .retry import BackoffPolicy
from .suggest import did_you_mean
from .worker.txmark import marking
from .workflows import WORKFLOW_STATES, Member, Workflow, WorkflowHandle, WorkflowStatus

if TYPE_CHECKING:
    from .maintenance.scheduler import Periodic, PeriodicInfo
    from .worker.worker import Worker

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
log = logging.getLogger("errands")
CLOSE_MARGIN = 10.0  # seconds App.close() waits for a worker past its grace period
# App.close() gives the hooks running or queued (on_dead, event subscribers) hook_timeout
# and this much more (the watchdog's look at a call past its limit) before it drops the
# queued ones and abandons a running one.
HOOKS_CLOSE_MARGIN = 1.0

LEASE_DEFAULT = 30.0
RETENTION_DEFAULT = timedelta(days=7)
POISON_AFTER_DEFAULT = 3
DEAD_HOOK_RETRY_AFTER = 0.1  # seconds before an on_dead hook that lost its connection runs again
DEAD_JOB_RETRY_FOR = 2.0  # seconds the on_dead hooks retry reading their job (transient errors)
# The leader runs the on_dead hooks of a death that no worker marked done within
# max(DEAD_HOOKS_GRACE_MIN, DEAD_HOOKS_GRACE_TIMEOUTS * hook_timeout) seconds.
DEAD_HOOKS_GRACE_MIN = 60.0
DEAD_HOOKS_GRACE_TIMEOUTS = 3
DEFAULT_QUEUE = "default"
# A queue's jobs not yet over: a queue holding any is not forgotten (its paused flag and
# limits would go from under them). ``waiting`` too: a workflow's dependent and a job
# waiting for a signal become available in their queue again.
UNFINISHED_STATES = ("scheduled", "available", "running", "retryable", "waiting")
EDIT_READ_CHUNK = 1000  # jobs an edit of new arguments or queue reads at once

DeadHook = Callable[[Job], None]
TEXT_MAX_BYTES = 10_000  # a filter, reason or actor name
SIGNAL_NAME_MAX = 200  # bytes of a signal's name
# the events an async enqueue emits: their subscribers, user code, run off the event loop
_JOB_ENQUEUED = ("errands.job.enqueued",)
_WORKFLOW_ENQUEUED = ("errands.job.enqueued", "errands.workflow.enqueued")
QUEUE_LIMIT_MAX = LIMIT_MAX  # app.queue(limit=): PostgreSQL's integer column, on every store


def _members(spec: WorkflowSpec) -> list[Any]:
    """The requests of a workflow's job members, nested workflows' included (its
    callbacks, inserted when it settles, are not inserted with it)."""
    found: list[Any] = []
    for node in spec.nodes:
        if node.request is not None:
            found.append(node.request)
        if node.child is not None:
            found.extend(_members(node.child))
    return found


def _cursor(after: Job | str) -> tuple[int, float, int]:
    """``after=`` of :meth:`App.jobs`: a Job, or its ``cursor``."""
    return parse_cursor(after.cursor if isinstance(after, Job) else after)


def _filter(what: str, value: str | None) -> str | None:
    """A queue or name filter: any text matches or not, but must be storable text."""
    return None if value is None else check_text(f"{what} filter", value, TEXT_MAX_BYTES)


def _actor(value: str) -> str:
    """Who acts, for the audit log: storable text, and not blank (an audit entry by ''
    names nobody)."""
    check_text("actor", value, TEXT_MAX_BYTES)
    if not value.strip():
        raise ConfigurationError(
            f"actor {value!r} is blank: name who acts, for the audit log (actor='ops:alice'; "
            "on the command line --actor ops:alice, or leave --actor out for cli:user@host)"
        )
    return value


_NO_WEIGHT = object()  # fair_weight(key) without a weight: a mistake, named

# Every App of this process (weakly: an App dropped is collected as before).
_APPS: weakref.WeakSet[App] = weakref.WeakSet()


def _live_apps() -> list[App]:
    """The Apps of this process now."""
    while True:
        try:
            return list(_APPS)
        except RuntimeError:  # an App made on another thread as it was read: again
            continue


class App:
    """One application's jobs and the database that holds them.

    ``url`` defaults to the ``ERRANDS_URL`` environment variable, else ``sqlite:///errands.db``.
    Nothing touches the database until the first call that needs it.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        default_queue: str = DEFAULT_QUEUE,
        lease: float | timedelta = LEASE_DEFAULT,
        max_payload_bytes: int = MAX_PAYLOAD_BYTES_DEFAULT,
        max_result_bytes: int = MAX_RESULT_BYTES_DEFAULT,
        retention: float | timedelta = RETENTION_DEFAULT,
        poison_after: int = POISON_AFTER_DEFAULT,
        hook_timeout: float | timedelta = HOOK_TIMEOUT_DEFAULT,
        dead_hooks_grace: float | timedelta | None = None,
    ) -> None:
        self.url = url or os.environ.get("ERRANDS_URL") or SQLITE_URL_DEFAULT
        self.default_queue = check_name("queue", default_queue)
        lease_seconds = seconds(lease, "lease")
        if lease_seconds is None or lease_seconds < 1:
            raise ConfigurationError(f"App(lease={lease!r}): a lease must be at least 1 second")
        self.lease = lease_seconds
        if max_payload_bytes < 1:
            raise ConfigurationError("App(max_payload_bytes=...) must be positive")
        self.max_payload_bytes = max_payload_bytes
        if max_result_bytes < 1:
            raise ConfigurationError("App(max_result_bytes=...) must be positive")
        self.max_result_bytes = max_result_bytes
        # retention=None keeps finished rows forever (no pruning)
        self.retention = seconds(retention, "retention") or 0.0
        if poison_after < 1:
            raise ConfigurationError("App(poison_after=...) must be at least 1")
        self.poison_after = poison_after
        limit = seconds(hook_timeout, "hook_timeout")
        if limit is None or limit <= 0:
            raise ConfigurationError(
                f"App(hook_timeout={hook_timeout!r}): give the seconds an on_dead hook or an "
                "event subscriber may run (more than 0)"
            )
        # on_dead hooks and event subscribers: off the worker's own threads (errands.hooks)
        self.hooks = HookRunner(limit)
        grace = seconds(dead_hooks_grace, "dead_hooks_grace")
        if grace is None:
            grace = max(DEAD_HOOKS_GRACE_MIN, DEAD_HOOKS_GRACE_TIMEOUTS * limit)
        if grace <= limit:
            raise ConfigurationError(
                f"App(dead_hooks_grace={dead_hooks_grace!r}): the leader runs the on_dead "
                "hooks of a death its worker did not mark done within this many seconds, so "
                f"it must exceed hook_timeout ({limit:g} s), or every slow hook runs twice"
            )
        # after this long, the leader runs the hooks of a death no worker marked done
        self.dead_hooks_grace = grace
        # Replaced, never changed in place, as jobs are registered (:meth:`_registry_put`):
        # a worker's threads iterate it while the code still registers jobs (an embedded
        # worker, a module imported late), and a dict changed in place under an iteration
        # raised "dictionary changed size during iteration" (the worker's start died).
        # Read it (app.registry[name], its values); register with @app.job: a write into
        # a copy taken earlier never reaches the App's current one.
        self.registry: dict[str, JobDefinition[Any, Any]] = {}
        self._registry_lock = threading.Lock()
        self.dead_hooks: list[DeadHook] = []
        self._dead_hooks_queued: set[int] = set()  # job ids whose hooks wait on the lane
        self._dead_hooks_lock = threading.Lock()
        self.queues: dict[str, QueueSettings] = {}
        self.schedules: dict[str, Periodic] = {}
        self.events = EventBus(self.hooks)
        self.events.subscribe(log_event, inline=True)
        self._backend: Backend | None = None
        self._backend_lock = threading.Lock()
        self._opening_lock = threading.Lock()
        self._registry_lock = threading.Lock()  # never held while the store opens
        self._opening: concurrent.futures.Future[Backend] | None = None  # abackend's
        self._results: ResultHub | None = None
        self.fair_weights: CallableWeights | None = None  # app.fair_weight(fn)
        self._workers: set[Worker] = set()  # this App's workers running now (close)
        self._workers_lock = threading.Lock()
        _APPS.add(self)
        reset_at_fork(self)  # its locks start afresh in a forked child (_forked)

    def __repr__(self) -> str:
        return f"<errands.App {redact_url(self.url)} jobs={len(self.registry)}>"

    def _forked(self) -> None:
        """In a child forked from this process, right after the fork, on its only thread
        (os.register_at_fork; no I/O, no logging): the App's locks start afresh. A lock
        another thread of the parent held at the fork (opening the store: App.backend,
        or abackend's thread) was copied held, by a thread that does not exist in the
        child: the child's first use of the store hung for good. An opening under way on
        abackend's thread is forgotten too (that thread is not in the child, its answer
        would never come): the child opens the store itself at its first use, as one
        forked before any opening does. A backend opened before the fork is the child's
        to use as it is (each backend starts its own connections afresh in the child).

        The workers running in the parent (embedded ones) are the parent's: their
        threads are not in the child, and the child has none of this App's running. It
        forgot them: its close() stopped each (one that never ends: it waited its grace
        period and a margin for each, 40 s by default). Neither the child's close() nor
        the stop of a worker it starts stops, deregisters or resigns them (the parent's
        still run, in the store as in the parent). The on_dead hooks the parent queued
        are the parent's to run (its lane runs them; the child's lanes start afresh:
        errands.hooks): none waits in the child."""
        self._backend_lock = threading.Lock()
        self._opening_lock = threading.Lock()
        self._registry_lock = threading.Lock()
        # Forgotten unasked: Future.done() takes the future's lock, which another thread
        # may have held at the fork (the child hung for good in this hook). A store opened
        # is in _backend already; else the child opens its own.
        self._opening = None
        self._dead_hooks_lock = threading.Lock()
        self._dead_hooks_queued = set()
        self._workers_lock = threading.Lock()
        self._workers = set()

    def _registry_put(self, name: str, definition: JobDefinition[Any, Any]) -> None:
        """Register ``definition`` under ``name`` in a copy of the registry that then
        replaces it (the caller holds _registry_lock): an iteration of the one before,
        on another thread, goes on over what it held (see ``registry``)."""
        registry = copy.copy(self.registry)  # (a subclass's kind and attributes kept)
        registry[name] = definition
        self.registry = registry

    # -- the store ---------------------------------------------------------------------
    @property
    def backend(self) -> Backend:
        if self._backend is None:
            with self._backend_lock:
                if self._backend is None:
                    # Shielded: a handler's or hook's interrupt landing as the store
                    # opened (a pool's open returning, a migration) left an open pool, its
                    # threads and connections, held by nobody (one more at each try). The
                    # wait is bounded by the connect timeout.
                    with shielded():
                        self._backend = open_backend(self.url)
        return self._backend

    async def abackend(self) -> Backend:
        """:attr:`backend` for async code: opened (a connection pool, a migration) in a
        thread the first time, so the event loop never waits on it (a database that
        accepts connections and never answers stalled the loop for the pool's timeout,
        at every call until it answered)."""
        if self._backend is not None:
            return self._backend
        # One opening for every caller, on a thread of its own: a to_thread per caller
        # had each of them hold a default-executor thread, blocked behind the first one's
        # lock, and 32 callers left none for the loop's other work (its getaddrinfo).
        with self._opening_lock:
            opening = self._opening
            if opening is None or opening.done():
                opening = self._opening = concurrent.futures.Future()
                opening.set_running_or_notify_cancel()  # a caller's cancel leaves it be
                threading.Thread(
                    target=self._open_for, args=(opening,), name="errands-open", daemon=True
                ).start()
        return await asyncio.wrap_future(opening)

    def _open_for(self, opening: concurrent.futures.Future[Backend]) -> None:
        try:
            opening.set_result(self.backend)
        except BaseException as exc:  # each waiting caller gets it; the next one tries again
            opening.set_exception(exc)

    @property
    def results(self) -> ResultHub:
        """The waiters on this App's results, woken by one watcher of the store."""
        if self._results is None:
            with self._backend_lock:
                if self._results is None:
                    self._results = ResultHub(self)
        return self._results

    def close(self) -> None:
        """Close the store and what this App started. A worker of this App still running
        (an embedded one) is stopped first, as a SIGTERM stops it, and waited for (its
        grace period, then a margin): closed under it, the store was opened again by its
        threads (the maintenance leader, the completer, the lease keeper) and never
        closed. Then the hook lanes' threads end: the on_dead hooks and event subscribers
        queued get ``hook_timeout`` (and a second) to run; what is still queued then is
        dropped (an on_dead hook's death is left to the maintenance leader), what still
        runs is abandoned, both logged (errands.hooks). The App may be used after
        close(): the store opens again, and the lanes start again, when needed. The
        process's backoff lane (shared by its Apps) ends too, unless a worker of another
        App still runs."""
        self._stop_workers()
        self.hooks.close(self.hooks.hook_timeout + HOOKS_CLOSE_MARGIN)
        self._close_process_lanes()
        if self.fair_weights is not None:
            self.fair_weights.close()
        if self._results is not None:
            self._results.close()
        if self._backend is not None:
            self._backend.close()
            self._backend = None

    def _close_process_lanes(self, stopping: Worker | None = None) -> None:
        """End the thread of the process's backoff lane (errands.hooks.shared_runner: the
        job types' backoff policies, of every App, run there with a time limit) and its
        watchdog, unless a worker of an App of this process still runs (other than
        ``stopping``, the last worker of this App, which calls this as it stops): it
        would only start them again. Called by close() and by that worker's stop, as
        the App's own lanes end; the next backoff policy called starts them again.
        Nothing ever ended them: every process that had called one kept the lane's
        thread and a watchdog for good."""
        if any(app._workers - {stopping} for app in _live_apps()):
            return
        close_shared(BACKOFF_TIMEOUT + HOOKS_CLOSE_MARGIN)

    def _stop_workers(self) -> None:
        with self._workers_lock:
            running = list(self._workers)
        me = threading.current_thread()
        running = [w for w in running if w.thread is not me]  # never wait for itself
        for worker in running:
            worker.stop()
        for worker in running:
            if not worker.ended.wait(worker.grace + CLOSE_MARGIN):
                log.warning(
                    "App.close(): worker %s has not stopped within its grace period "
                    "(%.0f s) and %.0f s more; the store is closed under it",
                    worker.id, worker.grace, CLOSE_MARGIN,
                )  # fmt: skip

    def migrate(self) -> list[str]:
        """Apply pending schema migrations; returns the names applied."""
        if self._backend is None:
            # Open without auto-migration, or opening would apply (and hide) them first.
            with self._backend_lock:
                if self._backend is None:
                    self._backend = open_backend(self.url, auto_migrate=False)
        return self.backend.migrate()

    # -- definitions -------------------------------------------------------------------
    @overload
    def job(self, fn: F, /) -> JobDefinition[Any, Any]: ...

    @overload
    def job(
        self,
        fn: None = None,
        /,
        *,
        name: str | None = None,
        queue: str | None = None,
        priority: int = 0,
        retries: int = 3,
        backoff: BackoffPolicy | Callable[[int], float] | float | None = None,
        timeout: float | timedelta | None = None,
        lease: float | timedelta | None = None,
        permanent: Iterable[type[BaseException]] = (),
        sensitive: Iterable[str] = (),
        unique_for: float | timedelta | None = None,
        concurrency_key: str | None = None,
        concurrency_limit: int | None = None,
        rate: str | None = None,
        fair_key: str | None = None,
    ) -> Callable[[F], JobDefinition[Any, Any]]: ...

    def job(
        self,
        fn: Callable[..., Any] | None = None,
        /,
        *,
        name: str | None = None,
        queue: str | None = None,
        priority: int = 0,
        retries: int = 3,
        backoff: BackoffPolicy | Callable[[int], float] | float | None = None,
        timeout: float | timedelta | None = None,
        lease: float | timedelta | None = None,
        permanent: Iterable[type[BaseException]] = (),
        sensitive: Iterable[str] = (),
        unique_for: float | timedelta | None = None,
        concurrency_key: str | None = None,
        concurrency_limit: int | None = None,
        rate: str | None = None,
        fair_key: str | None = None,
    ) -> Any:
        """Register a function as a job. Usable bare (``@app.job``) or with options."""

        def register(func: Callable[..., Any]) -> JobDefinition[Any, Any]:
            definition = JobDefinition(
                self,
                func,
                name=name,
                queue=queue,
                priority=priority,
                retries=retries,
                backoff=backoff,
                timeout=timeout,
                lease=lease,
                permanent=permanent,
                sensitive=sensitive,
                unique_for=unique_for,
                concurrency_key=concurrency_key,
                concurrency_limit=concurrency_limit,
                rate=rate,
                fair_key=fair_key,
            )
            with self._registry_lock:
                if definition.name in self.registry:
                    raise ConfigurationError(
                        f"a job named {definition.name!r} is already registered; pass name= "
                        "to give one of them another name"
                    )
                self._registry_put(definition.name, definition)
            return definition

        return register(fn) if fn is not None else register

    def queue(
        self,
        name: str,
        *,
        limit: int | None = None,
        rate: str | None = None,
        fair: bool = False,
        aging: float | timedelta | None = None,
    ) -> None:
        """Declare a queue's cluster-wide limits: at most ``limit`` jobs running at once
        across every worker and host, at most ``rate`` starts (``"100/m"``). ``fair=True``
        shares its workers among the jobs' fair keys (``@app.job(fair_key=...)``) by
        recent worker time and weight; ``aging`` (fair queues) moves a job waiting that
        many seconds up one priority level, and one more per further ``aging``. Workers
        store the declaration when they start; ``errands queues`` shows it."""
        check_name("queue", name)
        # Stored by each worker as it starts, in PostgreSQL's integer: 2**40 passed here and
        # every worker then failed at its start ("integer out of range"); True passed as 1.
        if limit is not None and (
            isinstance(limit, bool)
            or not isinstance(limit, int)
            or not 1 <= limit <= QUEUE_LIMIT_MAX
        ):
            raise ConfigurationError(
                f"app.queue({name!r}, limit={shown(limit)}): limit must be >= 1, an int of at "
                f"most {QUEUE_LIMIT_MAX:,}: how many of the queue's jobs may run at once "
                "across the cluster, as in limit=10 (None: no limit)"
            )
        rate_limit, rate_period = parse_rate(rate) if rate is not None else (None, None)
        if not isinstance(fair, bool):
            raise ConfigurationError(f"app.queue({name!r}, fair={fair!r}): fair must be a bool")
        aging_seconds = seconds(aging, "aging", f"app.queue({name!r}): ")
        if aging_seconds is not None and not fair:
            raise ConfigurationError(
                f"app.queue({name!r}, aging={aging!r}): aging applies to fair queues; pass "
                "fair=True as well"
            )
        if aging_seconds is not None and aging_seconds < 1:
            raise ConfigurationError(
                f"app.queue({name!r}, aging={aging!r}): aging must be at least 1 second"
            )
        self.queues[name] = QueueSettings(
            name=name,
            max_running=limit,
            rate_limit=rate_limit,
            rate_period=rate_period,
            fair=fair,
            aging=aging_seconds,
        )

    @overload
    def fair_weight(self, key: str, weight: float | None, *, actor: str = "api") -> None: ...

    @overload
    def fair_weight(self, key: Callable[[str], float], /) -> Callable[[str], float]: ...

    def fair_weight(
        self,
        key: str | Callable[[str], float],
        weight: object = _NO_WEIGHT,
        *,
        actor: str = "api",
    ) -> Callable[[str], float] | None:
        """Store fair key ``key``'s weight (persisted and audited; None: back to 1). In a
        fair queue a key of weight 5 gets five times the worker time of a key of weight 1
        while both have jobs waiting. Takes effect at the next claim.

        ``app.fair_weight(fn)`` (or ``@app.fair_weight`` on a function) gives the weight
        of every key without a stored one by code: ``fn(key) -> weight``, asked by this
        app's workers off the claim, its answer used for a minute. A stored weight wins
        (an operator's override). A callable that raises or returns a bad value gives
        weight 1 (logged); one slower than 20 ms leaves the key at its previous weight
        until it answers, so it never holds a claim up. Returns ``fn``."""
        if callable(key):
            if weight is not _NO_WEIGHT:
                raise ConfigurationError(
                    "fair_weight(fn): a callable gives every key its weight; pass it alone, "
                    "as app.fair_weight(fn), or store one key's weight: fair_weight(key, 5)"
                )
            if self.fair_weights is not None:
                self.fair_weights.close()
            self.fair_weights = CallableWeights(key)
            return key
        if weight is _NO_WEIGHT:
            raise ConfigurationError(
                f"fair_weight({key!r}): give the key's weight, as fair_weight({key!r}, 5), "
                "or None to reset it to 1; or pass a callable, fair_weight(fn), to weigh "
                "every key by code"
            )
        key = check_text("fair_weight key", key, KEY_MAX_BYTES)
        if key == UNKEYED and weight is not None:  # (a reset of one stored before: allowed)
            raise ConfigurationError(
                "fair_weight(''): the empty key is how errands marks a fair queue's jobs "
                "without a fair key (a template that built '' gives no key), not a key to "
                "weigh; give a key as your fair_key templates build it, as "
                "fair_weight('tenant:42', 5)"
            )
        value = None if weight is None else check_weight(key, weight)
        self.backend.fair_weight_set(key, value, _actor(actor))
        return None

    def pause(self, queue: str, *, actor: str = "api", force: bool = False) -> None:
        """Stop every worker from claiming from ``queue`` (persisted and audited); running
        jobs finish. Takes effect within one poll interval.

        A queue nobody knows (see :meth:`known_queues`) is refused, naming the close ones,
        so a typo is not paused (and listed) for ever; ``force=True`` pauses a queue ahead
        of its first job and worker."""
        check_name("queue", queue)
        if not force:
            self._check_known_queue(queue, "pause", "pass force=True (--force)")
        self.backend.queue_set_paused(queue, True, _actor(actor))

    def resume(self, queue: str, *, actor: str = "api") -> None:
        """Let workers claim from a paused queue again (audited)."""
        check_name("queue", queue)
        self._check_known_queue(queue, "resume", "")
        self.backend.queue_set_paused(queue, False, _actor(actor))

    def forget_queue(self, queue: str, *, actor: str = "api") -> bool:
        """Delete a queue's stored settings (its paused flag and limits; audited), so a
        mistyped queue stops being listed. Refused while jobs wait in it (pending, or
        waiting for their workflow's parents or a signal) or run. Returns
        False when nothing was stored. Limits declared in code come back when a worker
        starts."""
        check_name("queue", queue)
        counts = next((s.counts for s in self.backend.queue_stats() if s.queue == queue), {})
        waiting = {s: n for s, n in counts.items() if n and s in UNFINISHED_STATES}
        if waiting:
            shown = ", ".join(f"{n} {s}" for s, n in sorted(waiting.items()))
            raise InvalidTransition(
                f"queue {queue!r} still has jobs ({shown}); forgetting it would resume a paused "
                "queue under them: cancel them or let them finish first"
            )
        if self.backend.queue_forget(queue, _actor(actor)):
            return True
        if any(s.name == queue for s in self.backend.queue_settings()):  # jobs came meanwhile
            raise InvalidTransition(
                f"queue {queue!r} got jobs while it was being forgotten; its settings stay: "
                "cancel them or let them finish first"
            )
        return False

    def known_queues(self) -> set[str]:
        """Every queue this app's code uses or declares, stored settings name, jobs are in,
        or a live worker serves."""
        from .fleet import served_queues

        known = {d.queue for d in self.registry.values()} | set(self.queues)
        known |= {self.default_queue, *(s.name for s in self.backend.queue_settings())}
        known |= {s.queue for s in self.backend.queue_stats()}
        return known | served_queues(self.backend.worker_list(), self.lease)

    def _check_known_queue(self, queue: str, verb: str, override: str) -> None:
        known = self.known_queues()
        if queue not in known:
            how = f"; to {verb} it all the same, {override}" if override else ""
            raise ConfigurationError(
                f"cannot {verb}: {did_you_mean('queue', queue, known)}: no job, worker, "
                f"stored setting or code of this app uses it{how}"
            )

    def queue_settings(self) -> list[QueueSettings]:
        """Every queue's persisted settings: paused, limits, who changed them last."""
        return self.backend.queue_settings()

    def periodic(
        self,
        expression: str,
        *,
        tz: str = "UTC",
        args: dict[str, Any] | None = None,
        catch_up: bool | None = None,
        **job_options: Any,
    ) -> Callable[[F], JobDefinition[Any, Any]]:
        """Run a job on a cron schedule, once per slot across the whole cluster.

        ``expression`` has five fields (minute hour day-of-month month day-of-week) and is
        read in time zone ``tz`` (a name, or a ZoneInfo). ``args`` are the job's
        arguments, validated now. ``catch_up``: None runs the latest missed slot once,
        True runs every missed slot, False skips missed slots. Other keyword arguments are
        ``@app.job`` options; on a function already decorated with ``@app.job``, give
        them there.
        """
        from .maintenance.scheduler import (
            Periodic,
            check_catch_up,
            check_one_schedule,
            check_schedule,
        )
        from .payload import RESERVED_OPTIONS

        def register(fn: F) -> JobDefinition[Any, Any]:
            existing = fn if isinstance(fn, JobDefinition) else None
            what = str(job_options.get("name") or getattr(existing or fn, "__qualname__", fn))
            if existing is not None:
                what = existing.name
                if existing.app is not self:
                    raise ConfigurationError(
                        f"periodic job {what!r} is a job of another App: schedule it there"
                    )
                if job_options:
                    raise ConfigurationError(
                        f"periodic job {what!r}: give {sorted(job_options)} to its @app.job; "
                        "@app.periodic on top of it takes only the schedule"
                    )
            zone = check_schedule(expression, tz, what)
            catch = check_catch_up(catch_up, what)
            if args is not None and not isinstance(args, Mapping):
                raise ConfigurationError(
                    f"periodic job {what!r}: args={args!r}; give a dict of the job's "
                    "arguments, as in args={'region': 'eu'}"
                )
            fixed = dict(args or {})
            if not all(isinstance(key, str) for key in fixed):
                raise ConfigurationError(
                    f"periodic job {what!r}: args={args!r}; its keys are the job's parameter "
                    "names (strings)"
                )
            options = sorted(RESERVED_OPTIONS & set(fixed))
            if options:
                raise ConfigurationError(
                    f"periodic job {what!r}: args names {options}, enqueue option(s) a "
                    "periodic job does not take per run (its key and time are its slot's); "
                    "give queue= and priority= to @app.periodic (or its @app.job)"
                )
            if job_options.get("unique_for") is not None or (
                existing is not None and existing.unique_for is not None
            ):
                raise ConfigurationError(
                    f"periodic job {what!r}: unique_for= does not apply: each run is keyed by "
                    "its slot (cron:<time>), once per slot; drop unique_for="
                )
            if existing is not None and existing.name in self.schedules:
                check_one_schedule(self.schedules[existing.name], expression, zone, fixed, catch)
                return existing  # the same schedule again (its module run twice)
            definition: JobDefinition[Any, Any] = existing or self.job(**job_options)(fn)
            try:
                bound = definition.bind(**fixed)  # validate the arguments at definition time
            except Exception:
                if existing is None:  # bad args register nothing
                    with self._registry_lock:
                        registry = copy.copy(self.registry)
                        registry.pop(definition.name, None)
                        self.registry = registry
                raise
            self.schedules[definition.name] = Periodic(
                definition, expression, zone, fixed, catch, bound
            )
            return definition

        return register

    def periodic_jobs(self) -> list[PeriodicInfo]:
        """Every periodic job with its next run (from now) and its last enqueued slot."""
        from .maintenance.scheduler import describe

        return describe(self)

    def on_dead(self, fn: DeadHook) -> DeadHook:
        """Call ``fn(job)`` in the worker whenever a job enters the dead-letter queue.

        Hooks run on a thread of their own, in order, never on the threads that write
        outcomes or rescue jobs; each may run ``hook_timeout`` seconds (App option,
        default 10 s), after which it is interrupted and logged, and the next one runs.
        A hook that raises is logged and changes nothing.

        At least once per death: the death and the record that its hooks are due are one
        write; the worker that runs them deletes the record, and the maintenance leader
        runs the hooks of a record older than ``dead_hooks_grace`` (the worker died, or
        fell that far behind). So a crash never loses them, and may run them twice.
        """
        self.dead_hooks.append(fn)
        return fn

    def dead_hooks_later(self, job_id: int) -> None:
        """Queue the ``on_dead`` hooks of a job that died (the worker and the maintenance
        leader call this; it never waits for the hooks). A job's hooks already queued in
        this process are not queued twice."""
        if not self.dead_hooks:
            return
        with self._dead_hooks_lock:
            if job_id in self._dead_hooks_queued:
                return
            self._dead_hooks_queued.add(job_id)
        future = self.hooks.lane("dead").submit(
            self.run_dead_hooks, job_id, what=f"on_dead hooks of job {job_id}"
        )
        if future is None:  # the lane is full (logged): the leader runs them after the grace
            with self._dead_hooks_lock:
                self._dead_hooks_queued.discard(job_id)
        else:
            future.add_done_callback(functools.partial(self._dead_hooks_dropped, job_id))

    def _dead_hooks_dropped(self, job_id: int, future: concurrent.futures.Future[Any]) -> None:
        """The hooks of ``job_id`` were dropped unrun (their lane closed first: logged):
        no longer queued, so the leader's run after the grace is not skipped as a
        duplicate in this App, should it be used again."""
        if isinstance(future.exception(), LaneClosed):
            with self._dead_hooks_lock:
                self._dead_hooks_queued.discard(job_id)

    def run_dead_hooks(self, job_id: int) -> None:
        """Call every ``on_dead`` hook with the job, here and now; a failing hook is logged,
        not fatal (one failing on a lost connection is called once more: see
        _call_dead_hook). Then mark the
        death's hooks done in the store, even when a hook failed or ran past its time
        limit (a hook that hangs is not run again and again); only a crash before that
        leaves the record for the leader."""
        try:
            if not self.dead_hooks:
                return
            try:
                job = self._dead_job(job_id)
            except Exception:
                log.exception("could not load dead job %s for the on_dead hooks", job_id)
                return
            if job.state != "dead":  # replayed (or discarded) since: nothing to tell
                return
            try:
                # Each hook has its own hook_timeout (Lane.timed; a retry may only take
                # what half of it leaves), also after the hook before it was stopped at
                # its limit. The death's hooks shared one: a first slow hook got the next
                # one interrupted, and its death was marked done, so that hook never ran.
                lane = self.hooks.lane("dead")
                for hook in self.dead_hooks:
                    retry_until = time.monotonic() + self.hooks.hook_timeout / 2
                    try:
                        with lane.timed(f"on_dead hook {describe_callable(hook)} for job {job_id}"):
                            self._call_dead_hook(hook, job, retry_until)
                    except HookTimeout:  # stopped at its limit (logged by the lane): next
                        log.error(
                            "on_dead hook %r was stopped at its %g s limit for job %s",
                            hook,
                            self.hooks.hook_timeout,
                            job_id,
                        )
                    except Exception:
                        log.exception("on_dead hook %r failed for job %s", hook, job_id)
            finally:
                self._dead_hooks_done(job)
        finally:
            with self._dead_hooks_lock:
                self._dead_hooks_queued.discard(job_id)

    @staticmethod
    def _call_dead_hook(hook: Callable[[Job], Any], job: Job, retry_until: float) -> None:
        """``hook(job)``; called once more, DEAD_HOOK_RETRY_AFTER later, when it failed on
        a lost or refused connection (its pager or database away for a moment: that
        death's alert was lost) and ``retry_until`` leaves the time. Once: a pager that
        is down costs each death one more call, not a loop."""
        try:
            hook(job)
        except Exception as exc:
            if not connection_lost(exc) or time.monotonic() + DEAD_HOOK_RETRY_AFTER > retry_until:
                raise
            log.warning(
                "on_dead hook %r failed for job %s (%s); calling it once more", hook, job.id, exc
            )
            time.sleep(DEAD_HOOK_RETRY_AFTER)
            hook(job)

    def _dead_hooks_done(self, job: Job) -> None:
        if job.finished_at is None:
            return
        died_at = job.finished_at.timestamp()
        try:
            self._retrying_blips(
                f"mark the on_dead hooks of job {job.id} done",
                lambda: self.backend.dead_hooks_done(job.id, died_at),
            )
        except Exception as exc:  # the leader runs them again after the grace
            log.warning(
                "could not mark the on_dead hooks of job %s done (%s): they may run again",
                job.id,
                exc,
            )

    def _dead_job(self, job_id: int) -> Job:
        """The dead job for its hooks (see :meth:`_retrying_blips`)."""
        return self._retrying_blips(f"load dead job {job_id}", lambda: self.get_job(job_id))

    def _retrying_blips(self, what: str, call: Callable[[], T]) -> T:
        """``call()``, made again while the store errs transiently (a killed session, a
        busy SQLite file) for up to DEAD_JOB_RETRY_FOR seconds, and at most half the
        hooks' time limit: one blip must not drop (or repeat) every hook of a job."""
        give_up = time.monotonic() + min(DEAD_JOB_RETRY_FOR, self.hooks.hook_timeout / 2)
        pause = 0.05
        while True:
            try:
                return call()
            except Exception as exc:
                if not is_transient(exc) or time.monotonic() + pause > give_up:
                    raise
                log.warning("could not %s (%s); retrying", what, exc)
            time.sleep(pause)
            pause *= 2

    # -- enqueue -----------------------------------------------------------------------
    def enqueue_many(self, jobs: Iterable[BoundJob], conn: Any = None) -> list[JobHandle]:
        """Store many jobs in one transaction (the caller's, when ``conn`` is given).
        ``jobs``: any iterable of ``job.bind(...)`` (a list, a generator), read once."""
        given = self._given(jobs)
        requests = self._requests(given)
        if not requests:
            return []
        if conn is not None:
            with self._inserting(requests), marking(conn):  # (ctx.transaction(): its errors)
                results = self.backend.job_insert_many(requests, conn=conn)
            return self._enqueued(requests, results)
        try:  # _inserting, inline: an enqueue one call per job pays no context manager
            results = self.backend.job_insert_many(requests)
        except BaseException as exc:
            self._insert_failed(requests, exc)
            raise
        return self._enqueued(requests, results)

    async def aenqueue_many(self, jobs: Iterable[BoundJob], conn: Any = None) -> list[JobHandle]:
        """:meth:`enqueue_many` for async code: the event loop never blocks on the store.

        ``conn``: the caller's async connection — a psycopg ``AsyncConnection``, an
        aiosqlite connection, or an SQLAlchemy ``AsyncSession``/``AsyncConnection`` on
        one — whose transaction the jobs commit or roll back with. Without it, the store's
        own connection is used in a worker thread: cancelling the awaiting task then
        does not undo an insert already sent (enqueue with ``key=`` to retry safely); the
        jobs it stored are announced (``errands.job.enqueued``) all the same.

        .. versionadded:: 0.2
        """
        given = self._given(jobs)
        requests = await self._off_loop(bool(self.events.inserters), self._requests, given)
        if not requests:
            return []
        with self._inserting(requests):
            backend = await self.abackend()
        if conn is None:
            # The insert and its announcement on one thread: a task cancelled while it
            # waits leaves the thread to finish, and what it stored is announced all the
            # same (errands.job.enqueued: metrics, traces, subscribers missed those jobs);
            # the app's subscribers run there, off the event loop.
            return await offloop.run(self._insert_announced, backend, requests)
        with self._inserting(requests):
            results = await backend.ajob_insert_many(requests, conn=conn)
        return await self._off_loop(
            self._announces(_JOB_ENQUEUED), self._enqueued, requests, results
        )

    def _insert_announced(self, backend: Backend, requests: list[Any]) -> list[JobHandle]:
        with self._inserting(requests):
            results = backend.job_insert_many(requests)
        return self._enqueued(requests, results)

    @contextmanager
    def _inserting(self, requests: list[Any]) -> Iterator[None]:
        """Around the insert of ``requests`` (prepared by the before-insert hooks): if it
        raises, the insert-failed hooks learn of it (tracing ends the send spans it
        started for them, as errors: they waited for an enqueued event that never came,
        and were dropped unexported, 10,000 enqueues later)."""
        try:
            yield
        except BaseException as exc:
            self._insert_failed(requests, exc)
            raise

    def _insert_failed(self, requests: list[Any], exc: BaseException) -> None:
        """The insert of ``requests`` raised ``exc``: the insert-failed hooks learn of it."""
        if self.events.insert_failures:
            self.events.insert_failed(requests, exc)

    async def _off_loop(self, user_code: bool, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, on a thread of its own when it would run ``user_code``: a
        before_insert hook, an event subscriber (a slow one held the event loop, and every
        task on it, for as long as it ran); at once when it would not."""
        if not user_code:
            return fn(*args)
        return await offloop.run(fn, *args)

    def _announces(self, names: tuple[str, ...]) -> bool:
        """Whether emitting any of ``names`` from this thread would run a subscriber that
        is user code (not one of errands' own quick, inline ones)."""
        return any(self.events.wants_later(name) for name in names)

    @staticmethod
    def _given(jobs: Iterable[BoundJob]) -> list[BoundJob]:
        """``jobs`` as a list, read once: a generator was used up by the checks, and the
        jobs it gave were then neither stored nor reported (an empty list came back)."""
        if type(jobs) is list:  # the common case (job.enqueue's own), none of the below
            return jobs[:]
        if isinstance(jobs, BoundJob):
            raise ConfigurationError(
                "enqueue_many takes several jobs (a list of job.bind(...)); for one job, "
                "call job.enqueue(...) or pass [job.bind(...)]"
            )
        if isinstance(jobs, (str, bytes, dict)) or not isinstance(jobs, Iterable):
            raise ConfigurationError(
                f"enqueue_many takes a list (or any iterable) of jobs made with "
                f"job.bind(...), got {type(jobs).__name__}"
            )
        return list(jobs)

    def _requests(self, jobs: Sequence[BoundJob], *, stored_later: bool = False) -> list[Any]:
        """Check ``jobs`` belong here; their requests, after the before-insert hooks
        (``stored_later``: see Events.prepare_insert). The hooks change a copy of each
        request's meta: a BoundJob enqueued again (a template, a retried call, a job added
        to two workflows) kept the first enqueue's keys, and tracing (which stores its
        context once) put every later job in the first request's trace."""
        for bound in jobs:
            if not isinstance(bound, BoundJob):
                raise ConfigurationError(
                    f"enqueue_many takes jobs made with job.bind(...), got {type(bound).__name__}"
                )
            if bound.definition.app is not self:
                raise ConfigurationError(f"job {bound.definition.name!r} belongs to another App")
        if not jobs:
            return []
        requests = [b.request for b in jobs]
        if stored_later or self.events.inserters:  # (nothing changes them without hooks)
            requests = [replace(r, meta=dict(r.meta)) for r in requests]
        return self.events.prepare_insert(requests, stored_later=stored_later)

    def _enqueued(self, requests: Sequence[Any], results: Sequence[Any]) -> list[JobHandle]:
        """Emit the enqueued events of ``requests`` (as the hooks left them); the handles
        of what was stored."""
        if self.events.wants("errands.job.enqueued"):
            emit = self.events.emit
            for request, result in zip(requests, results, strict=True):
                emit(
                    "errands.job.enqueued",
                    job_id=result.id,
                    job_name=request.name,
                    queue=request.queue,
                    attempt=0,
                    deduplicated=result.deduplicated,
                    meta=request.meta,
                )
        return [
            JobHandle(self, result.id, request.name, result.deduplicated)
            for request, result in zip(requests, results, strict=True)
        ]

    # -- workflows ---------------------------------------------------------------------
    def enqueue_workflow(self, workflow: Workflow, conn: Any = None) -> WorkflowHandle:
        """Store a workflow (or batch) — members, edges and callbacks — in one transaction
        (the caller's, when ``conn`` is given). See docs/workflows.md."""
        self._check_workflow(workflow)
        spec = self._workflow_spec(workflow)
        with self._inserting(_members(spec)), marking(conn):
            inserted = self.backend.workflow_insert(spec, conn=conn)
        return self._workflow_enqueued(workflow, spec, inserted)

    async def aenqueue_workflow(self, workflow: Workflow, conn: Any = None) -> WorkflowHandle:
        """:meth:`enqueue_workflow` for async code: ``conn`` is the caller's async
        connection (as :meth:`aenqueue_many` takes), and the event loop never blocks (the
        event subscribers run on a worker thread). Without ``conn``, a workflow whose
        insert was sent is announced even when the awaiting task is cancelled."""
        self._check_workflow(workflow)
        spec = await self._off_loop(bool(self.events.inserters), self._workflow_spec, workflow)
        members = _members(spec)
        with self._inserting(members):
            backend = await self.abackend()
        if conn is None:  # the insert and its announcement on one thread (aenqueue_many)
            return await offloop.run(self._workflow_inserted, backend, workflow, spec)
        with self._inserting(members):
            inserted = await backend.aworkflow_insert(spec, conn=conn)
        return await self._off_loop(
            self._announces(_WORKFLOW_ENQUEUED), self._workflow_enqueued, workflow, spec, inserted
        )

    def _workflow_inserted(
        self, backend: Backend, workflow: Workflow, spec: WorkflowSpec
    ) -> WorkflowHandle:
        with self._inserting(_members(spec)):
            inserted = backend.workflow_insert(spec)
        return self._workflow_enqueued(workflow, spec, inserted)

    @staticmethod
    def _check_workflow(workflow: Any) -> None:
        if not isinstance(workflow, Workflow):
            raise ConfigurationError(
                "enqueue_workflow takes an errands.Workflow or errands.Batch, got "
                f"{type(workflow).__name__}"
            )
        if not workflow.nodes:
            raise ConfigurationError(
                f"workflow {workflow.name!r} has no members; add some with wf.add(job.bind(...))"
            )

    def _workflow_spec(self, workflow: Workflow) -> WorkflowSpec:
        """The store's view of ``workflow`` (nested ones included), hooks applied."""
        members = workflow.jobs()
        requests = self._requests(members) if members else []
        callbacks = list(workflow.callbacks.values())
        # inserted when the workflow settles, by the store: no enqueued event now
        hooked = self._requests(callbacks, stored_later=True) if callbacks else []
        children = {
            node.index: self._workflow_spec(member)
            for node, member, _ in workflow.nodes
            if isinstance(member, Workflow)
        }
        return workflow.spec(requests, dict(zip(workflow.callbacks, hooked, strict=True)), children)

    def _workflow_enqueued(
        self, workflow: Workflow, spec: WorkflowSpec, inserted: WorkflowInserted
    ) -> WorkflowHandle:
        """Emit the enqueued events (of the requests in ``spec``, as the hooks left them);
        the workflow's handle (with its nested ones')."""
        requests = [node.request for node in spec.nodes if node.request is not None]
        handles = iter(self._enqueued(requests, inserted.jobs) if requests else [])
        if self.events.wants("errands.workflow.enqueued"):
            self.events.emit(
                "errands.workflow.enqueued",
                workflow_id=inserted.id,
                workflow_name=workflow.name,
                kind=workflow.kind,
                members=len(workflow.nodes),
            )
        jobs: dict[str, JobHandle] = {}
        children: dict[str, WorkflowHandle] = {}
        for (node, member, _), node_spec in zip(workflow.nodes, spec.nodes, strict=True):
            if isinstance(member, Workflow):
                assert node_spec.child is not None
                nested = inserted.children[node.index]
                children[node.name] = self._workflow_enqueued(member, node_spec.child, nested)
            else:
                jobs[node.name] = next(handles)
        return WorkflowHandle(self, inserted.id, jobs, children)

    def workflow(self, workflow_id: int) -> WorkflowHandle:
        """The handle of a stored workflow (raises JobNotFound if there is none)."""
        workflow_id = checked_id(workflow_id, "workflow id")
        self.workflow_status(workflow_id)
        return WorkflowHandle(self, workflow_id)

    def workflow_status(self, workflow_id: int) -> WorkflowStatus:
        workflow_id = checked_id(workflow_id, "workflow id")
        row = self.backend.workflow_get(workflow_id)
        if row is None:
            raise JobNotFound(f"no workflow with id {workflow_id}")
        return WorkflowStatus.of(row)

    def workflows(
        self, *, state: str | None = None, before_id: int | None = None, limit: int = 100
    ) -> list[WorkflowStatus]:
        """Workflows newest first; ``state``: running, succeeded, failed or cancelled."""
        if state is not None and state not in WORKFLOW_STATES:
            raise ValueError(
                f"unknown workflow state {state!r}; choose one of: {', '.join(WORKFLOW_STATES)}"
            )
        if before_id is not None:
            before_id = checked_id(before_id, "workflows: before_id")
        limit = checked_limit(limit, "limit")
        rows = self.backend.workflow_list(state=state, before_id=before_id, limit=limit)
        return [WorkflowStatus.of(r) for r in rows]

    def workflow_members(self, workflow_id: int) -> list[Member]:
        """Every member of a workflow with its node, state and parents, in id order."""
        workflow_id = checked_id(workflow_id, "workflow id")
        members: list[Member] = []
        after = 0  # from the start (nested workflows, with negative ids, included)
        while True:
            page = self.backend.workflow_members(workflow_id, after=after, limit=1000)
            members.extend(Member.of(r) for r in page)
            if len(page) < 1000:
                return members
            after = page[-1].job_id

    def cancel_workflow(self, workflow_id: int, *, actor: str = "api") -> int:
        """Cancel a workflow: its pending members (dependents included) at once, its
        running ones asked to stop; it then settles ``cancelled``. The number cancelled.
        ``errands.CancelIncomplete`` when it was requested but stopped part way: run it
        again (it is safe to repeat)."""
        workflow_id = checked_id(workflow_id, "workflow id")
        actor = _actor(actor)
        self.backend.workflow_take_settled()
        try:
            cancelled = self.backend.workflow_cancel(workflow_id, actor)
        finally:
            self.workflows_settled()  # what committed settled, even when a step failed
        if self.events.wants("errands.workflow.cancelled"):
            self.events.emit(
                "errands.workflow.cancelled",
                workflow_id=workflow_id,
                actor=actor,
                cancelled=cancelled,
            )
        return cancelled

    def workflows_settled(self, *, later: bool = False, settled: list[Any] | None = None) -> None:
        """Emit ``errands.workflow.settled`` for what this thread's last store calls
        settled (called after a finish, rescue or cancel committed), or for ``settled``
        (a child process's). ``later``: the subscribers run on the events lane whatever
        the thread (a worker's handler thread: a slow one held the job's slot)."""
        if settled is None:
            settled = self.backend.workflow_take_settled()
        if settled and self.events.wants("errands.workflow.settled"):
            emit = self.events.emit_later if later else self.events.emit
            for s in settled:
                emit(
                    "errands.workflow.settled",
                    workflow_id=s.id,
                    workflow_name=s.name,
                    kind=s.kind,
                    state=s.state,
                    callbacks=s.fired,
                )

    def job_result(self, job_id: int) -> Any:
        """A completed job's result, decoded as its handler's return annotation says."""
        job = self.get_job(job_id)
        return JobHandle(self, job.id, job.name)._outcome(job)

    # -- reading -------------------------------------------------------------------------
    def get_job(self, job_id: int) -> Job:
        row = self.backend.job_get(checked_id(job_id))
        if row is None:
            raise JobNotFound(f"no job with id {job_id}")
        return row.to_job()

    async def aget_job(self, job_id: int) -> Job:
        """:meth:`get_job` for async code (read in a worker thread; the loop never blocks).

        .. versionadded:: 0.2
        """
        await self.abackend()  # opened once, off the executor (see abackend)
        return await offloop.run(self.get_job, job_id)

    def jobs(
        self,
        *,
        state: str | None = None,
        queue: str | None = None,
        name: str | None = None,
        limit: int = 100,
        before_id: int | None = None,
        parent_id: int | None = None,
        after: Job | str | None = None,
    ) -> list[Job]:
        """Jobs newest first; page with ``before_id=<last id of the previous page>``.

        Available jobs of one queue (``state="available"`` and a ``queue``) come by
        priority, then due time, then id instead (a plain queue's claim order, next
        first; a fair queue rotates among its keys, and aging or limits reorder it too);
        page them with ``after=<the previous page's last Job>`` (or its ``cursor``).

        ``parent_id`` lists the children a job inserted with ``ctx.enqueue``.
        """
        if state is not None:
            state = parse_state(state).value
        limit = checked_limit(limit)
        if before_id is not None:
            before_id = checked_id(before_id, "before_id")
        if parent_id is not None:
            parent_id = checked_id(parent_id, "parent_id")
        queue, name = _filter("queue", queue), _filter("name", name)
        by_priority = listed_by_priority(state, queue)
        if by_priority and before_id is not None:
            raise ConfigurationError(
                "available jobs of one queue are listed by priority and due time, not by "
                "id: page them with after=<the last Job of the previous page> (or its "
                "cursor), not before_id"
            )
        if after is not None and not by_priority:
            raise ConfigurationError(
                "after= pages the available jobs of one queue (state='available' and a "
                "queue); other listings are newest first: page them with before_id"
            )
        rows = self.backend.job_list(
            ListParams(
                state=state,
                queue=queue,
                name=name,
                limit=limit,
                before_id=before_id,
                parent_id=parent_id,
                after=None if after is None else _cursor(after),
            )
        )
        return [r.to_job() for r in rows]

    def job_steps(self, job_id: int) -> list[Step]:
        """The durable steps a job stored with ``ctx.step``, oldest first."""
        return self.backend.step_list(checked_id(job_id))

    def queue_stats(self) -> list[QueueStats]:
        return self.backend.queue_stats()

    def fair_figures(self, queue: str, *, weight_wait: float = 1.0) -> list[FairKeyFigures]:
        """Per fair key of ``queue``: recent and total worker seconds, attempts, dwell
        (due -> start), jobs running and due, and the weight its claims use: the stored
        one, else the answer of this app's ``fair_weight`` callable (waited for
        ``weight_wait`` seconds at most; a key it has not answered by then shows 1, as
        a claim would use it), else 1; ``weight_source`` says which."""
        figures = self.backend.fair_figures(check_name("queue", queue))
        stored = {w.key for w in self.backend.fair_weights()}
        figures = [replace(f, weight_source="stored") if f.key in stored else f for f in figures]
        if self.fair_weights is None:
            return figures
        asked = [f.key for f in figures if f.key not in stored]
        answers = self.fair_weights(asked, budget=weight_wait) if asked else {}
        return [
            replace(f, weight=answers[f.key], weight_source="code") if f.key in answers else f
            for f in figures
        ]

    def unrunnable_jobs(self) -> dict[str, int]:
        """Pending jobs per job type that no live worker's code defines: a worker never
        claims a job type it does not know (a rolling deploy's newer types wait, uncharged,
        for one that does), so these wait until such a worker runs. Live: a worker not
        presumed dead by its own heartbeat (errands.fleet)."""
        from .fleet import presumed_dead

        live = [w for w in self.backend.worker_list() if not presumed_dead(w, self.lease)]
        known = {name for w in live for name in (w.jobs or ())}
        return {
            name: count
            for name, count in sorted(self.backend.job_count_pending_by_name().items())
            if name not in known
        }

    def audit(self, *, job_id: int | None = None, limit: int = 100) -> list[AuditEvent]:
        limit = checked_limit(limit)
        job_id = None if job_id is None else checked_id(job_id)
        return self.backend.audit_list(limit=limit, job_id=job_id)

    # -- admin actions ---------------------------------------------------------------------
    def replay(
        self,
        ids: Iterable[int] = (),
        *,
        all: bool = False,
        queue: str | None = None,
        name: str | None = None,
        dry_run: bool = False,
        fresh: bool = False,
        actor: str = "api",
    ) -> ActionResult:
        """Put dead jobs back to available (same id, key and steps; attempts reset).

        ``fresh=True`` forgets the jobs' stored steps, so every step runs again.
        """
        params = ActionParams(
            actor=_actor(actor),
            ids=checked_ids(ids, "replay"),
            all_matching=all,
            queue=_filter("queue", queue),
            name=_filter("name", name),
            dry_run=dry_run,
            fresh=fresh,
        )
        self._check_selection(params, "replay")
        result = self.backend.job_replay(params)
        if not dry_run:
            for job_id in result.matched:
                self.events.emit("errands.job.replayed", job_id=job_id, actor=actor)
        return result

    def discard(
        self,
        ids: Iterable[int] = (),
        *,
        reason: str,
        all: bool = False,
        queue: str | None = None,
        name: str | None = None,
        dry_run: bool = False,
        actor: str = "api",
    ) -> ActionResult:
        """Take dead jobs out of the DLQ without running them; the row and reason stay."""
        check_text("discard reason", reason)  # a string, before it is stripped
        if not reason.strip():
            raise InvalidTransition("discard needs a reason: pass --reason TEXT (reason=...)")
        params = ActionParams(
            actor=_actor(actor),
            ids=checked_ids(ids, "discard"),
            all_matching=all,
            queue=_filter("queue", queue),
            name=_filter("name", name),
            reason=check_text("discard reason", reason.strip(), TEXT_MAX_BYTES),
            dry_run=dry_run,
        )
        self._check_selection(params, "discard")
        result = self.backend.job_discard(params)
        if not dry_run:
            for job_id in result.matched:
                self.events.emit("errands.job.discarded", job_id=job_id, actor=actor, reason=reason)
        return result

    # -- editing pending jobs ---------------------------------------------------------------
    def edit(
        self,
        ids: Iterable[int],
        *,
        run_at: datetime | None = None,
        delay: float | timedelta | None = None,
        priority: int | None = None,
        queue: str | None = None,
        args: dict[str, Any] | None = None,
        dry_run: bool = False,
        actor: str = "api",
    ) -> ActionResult:
        """Change pending jobs (``scheduled``, ``available`` or ``retryable`` only): when
        they run (``run_at=`` or ``delay=``), their ``priority``, their ``queue``, or their
        arguments (``args=``, validated against each job's payload contract now:
        InvalidPayload and nothing written when they do not fit). Each job's write is
        guarded by its state, so an edit never lands on a running or finished job, and is
        audited with ``actor``. ``dry_run`` changes nothing and reports what would be
        changed. Returns the jobs changed and, for the others, why not.

        .. versionadded:: 0.2
        """
        job_ids = list(dict.fromkeys(checked_ids(ids, "edit")))
        if not job_ids:
            raise ConfigurationError("edit: give at least one job id")
        if run_at is None and delay is None and priority is None and queue is None and args is None:
            raise ConfigurationError(
                "edit: nothing to change; give run_at=, delay=, priority=, queue= or args="
            )
        if run_at is not None and delay is not None:
            raise ConfigurationError("edit: give run_at= or delay=, not both")
        when: float | None = None
        if run_at is not None:
            if not isinstance(run_at, datetime) or run_at.tzinfo is None:
                raise ConfigurationError(
                    f"edit: run_at={run_at!r} must be a datetime with a time zone"
                )
            when = checked_epoch(run_at.timestamp(), "edit: run_at")
        if priority is not None:
            checked_priority(priority, "edit: priority")
        edits, skipped = self._edits(
            job_ids, args, None if queue is None else check_name("queue", queue)
        )
        result = self.backend.job_edit(
            EditParams(
                actor=_actor(actor),
                edits=edits,
                run_at=when,
                delay=seconds(delay, "delay"),
                priority=priority,
                queue=None if queue is None else check_name("queue", queue),
                dry_run=dry_run,
            )
        )
        result = ActionResult(result.matched, {**skipped, **result.skipped})
        if not dry_run:
            changes = sorted(
                k
                for k, v in {"run_at": when if delay is None else delay, "priority": priority,
                             "queue": queue, "args": args}.items()
                if v is not None
            )  # fmt: skip
            for job_id in result.matched:
                self.events.emit("errands.job.edited", job_id=job_id, actor=actor, changes=changes)
        return result

    def _edits(
        self, job_ids: list[int], args: dict[str, Any] | None, queue: str | None = None
    ) -> tuple[list[JobEdit], dict[int, str]]:
        """Each job's edit; with ``args``, validated against the job's own definition.
        With new arguments or another ``queue``, its keys are derived anew, for the queue
        it will be in (the fair key of a job type without a template depends on it: an
        edit of a fair queue's job computed it for the definition's default queue and
        left the job unkeyed, and a move into a fair queue kept it unkeyed)."""
        if args is None and queue is None:
            return [JobEdit(i) for i in job_ids], {}
        if args is not None and not isinstance(args, dict):
            raise ConfigurationError("edit: args= takes a dict of the job's arguments")
        edits: list[JobEdit] = []
        skipped: dict[int, str] = {}
        rows: dict[int, JobRow] = {}
        for start in range(0, len(job_ids), EDIT_READ_CHUNK):  # a bulk move: one read a chunk
            chunk = job_ids[start : start + EDIT_READ_CHUNK]
            rows.update((r.id, r) for r in self.backend.job_get_many(chunk))
        for job_id in job_ids:
            row = rows.get(job_id)
            if row is None:
                skipped[job_id] = "no such job"
                continue
            definition = self.registry.get(row.name)
            if definition is None:
                if args is None:  # moved as it is: its keys stay as they were
                    edits.append(JobEdit(job_id))
                    continue
                skipped[job_id] = (
                    f"this app has no job {row.name!r} to validate the new arguments against; "
                    "edit it from an app that registers it"
                )
                continue
            target = queue or row.queue
            if args is None:
                try:
                    ckey = definition._format_key(
                        "concurrency_key", definition.concurrency_key, row.args
                    )
                    fair = definition._fair_key_for(target, row.args)
                except InvalidPayload:  # stored before its template changed: as it is
                    edits.append(JobEdit(job_id))
                    continue
                rate = definition.rate or (None, None)
                edits.append(
                    JobEdit(job_id, None, ckey, fair, True, definition.concurrency_limit, *rate)
                )
                continue
            try:
                request = definition.request((), dict(args), EnqueueOptions(queue=target))
            except InvalidPayload as exc:
                raise InvalidPayload(
                    f"job {job_id}: the new arguments do not fit {row.name}: {exc}",
                    errors=exc.errors,
                ) from None
            edits.append(
                JobEdit(
                    job_id,
                    request.args_json,
                    request.concurrency_key,
                    request.fair_key,
                    True,
                    request.concurrency_limit,
                    request.rate_limit,
                    request.rate_period,
                )
            )
        return edits, skipped

    def reschedule(
        self,
        ids: Iterable[int],
        *,
        run_at: datetime | None = None,
        delay: float | timedelta | None = None,
        dry_run: bool = False,
        actor: str = "api",
    ) -> ActionResult:
        """Move pending jobs to ``run_at`` (or ``delay`` from now); see :meth:`edit`.

        .. versionadded:: 0.2
        """
        if run_at is None and delay is None:
            raise ConfigurationError("reschedule: give run_at= or delay=")
        return self.edit(ids, run_at=run_at, delay=delay, dry_run=dry_run, actor=actor)

    def reprioritise(
        self, ids: Iterable[int], priority: int, *, dry_run: bool = False, actor: str = "api"
    ) -> ActionResult:
        """Give pending jobs a new priority; see :meth:`edit`.

        .. versionadded:: 0.2
        """
        return self.edit(ids, priority=priority, dry_run=dry_run, actor=actor)

    def move(
        self, ids: Iterable[int], queue: str, *, dry_run: bool = False, actor: str = "api"
    ) -> ActionResult:
        """Move pending jobs to another queue; see :meth:`edit`.

        .. versionadded:: 0.2
        """
        return self.edit(ids, queue=queue, dry_run=dry_run, actor=actor)

    def replace_args(
        self,
        ids: Iterable[int],
        args: dict[str, Any],
        *,
        dry_run: bool = False,
        actor: str = "api",
    ) -> ActionResult:
        """Replace pending jobs' arguments, validated against each job's payload contract;
        see :meth:`edit`.

        .. versionadded:: 0.2
        """
        return self.edit(ids, args=args, dry_run=dry_run, actor=actor)

    # -- durable signals ----------------------------------------------------------------------
    def signal(
        self, job_id: int, name: str, payload: Any = None, *, actor: str = "api"
    ) -> SignalResult:
        """Send signal ``name`` (with a JSON ``payload``) to a job: kept for the job's
        ``ctx.wait_for_signal(name)``, and a job waiting for it now becomes available
        (``resumed``). Audited. A signal sent before the wait is kept; a completed,
        cancelled or discarded job refuses it (InvalidTransition), as does an unknown id
        (JobNotFound).

        .. versionadded:: 0.2
        """
        check_text("signal name", name, SIGNAL_NAME_MAX)
        if not name:
            raise ConfigurationError("a signal needs a name")
        try:
            payload_json = to_json(payload).decode("utf-8")
        except (PydanticSerializationError, ValueError, TypeError) as exc:
            raise InvalidPayload(f"signal {name!r}: the payload is not JSON: {exc}") from None
        check_text(f"signal {name!r} payload", payload_json, self.max_payload_bytes)
        problem = unstorable_json(f"signal {name!r}: the payload", payload_json)
        if problem is not None:
            raise problem
        result = self.backend.job_signal(checked_id(job_id), name, payload_json, _actor(actor))
        self.events.emit(
            "errands.job.signalled", job_id=result.id, actor=actor, signal=name,
            resumed=result.resumed,
        )  # fmt: skip
        return result

    async def asignal(
        self, job_id: int, name: str, payload: Any = None, *, actor: str = "api"
    ) -> SignalResult:
        """:meth:`signal` for async code.

        .. versionadded:: 0.2
        """
        await self.abackend()
        return await offloop.run(self.signal, job_id, name, payload, actor=actor)

    async def acancel(self, job_id: int, *, actor: str = "api") -> CancelResult:
        """:meth:`cancel` for async code.

        .. versionadded:: 0.2
        """
        await self.abackend()
        return await offloop.run(self.cancel, job_id, actor=actor)

    def cancel(self, job_id: int, *, actor: str = "api") -> CancelResult:
        """Cancel a pending job at once, or ask a running one to stop."""
        job_id, actor = checked_id(job_id), _actor(actor)
        self.backend.workflow_take_settled()
        result = self.backend.job_cancel(job_id, actor)
        self.workflows_settled()
        self.events.emit(
            "errands.job.cancel_requested",
            job_id=result.id,
            actor=actor,
            previous_state=result.previous_state,
        )
        return result

    @staticmethod
    def _check_selection(params: ActionParams, verb: str) -> None:
        if params.all_matching and params.ids:
            raise ConfigurationError(f"{verb}: give job ids or all=True, not both")
        if not params.all_matching and not params.ids:
            raise ConfigurationError(f"{verb}: give at least one job id, or all=True")
        if not params.all_matching and (params.queue or params.name):
            raise ConfigurationError(f"{verb}: queue= and name= filter only with all=True")

    # -- workers -------------------------------------------------------------------------
    def worker(self, **options: Any) -> Worker:
        """A worker for this app (see errands.worker.Worker for the options)."""
        from .worker.worker import Worker

        return Worker(self, **options)
