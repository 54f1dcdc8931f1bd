"""Prometheus metrics for errands (the ``errands[metrics]`` extra: prometheus-client).

::

    metrics = install_metrics(app)                 # a new CollectorRegistry of its own
    metrics = install_metrics(app, registry=prometheus_client.REGISTRY)   # the global one

Counters and histograms are fed by the event bus (``app.events``): they count what
happens in *this* process — enqueues where the app enqueues, attempts where a worker
runs them. Queue gauges (jobs by state, oldest available age, dead jobs) and the store's
health gauges come from the database: one aggregate query (``app.queue_stats()``) plus
one health query per scrape, cached for ``cache_seconds``, never one per job.

Serve them with ``errands worker --metrics-port N``, :func:`serve_metrics`, or the ASGI
app :func:`asgi_app` (``/metrics``). Labels are limited to ``queue``, ``job`` (the job
name), ``state`` and ``outcome``, so the number of series stays small.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from .. import offloop
from ..errors import ConfigurationError
from ..forking import fresh_lock_at_fork
from ..jobs import ALL_STATES
from .events import Event
from .fair_keys import KeyRow, top_keys

try:
    from prometheus_client import (
        REGISTRY,
        CollectorRegistry,
        Counter,
        Gauge,
        Histogram,
        Info,
        start_http_server,
    )
    from prometheus_client.core import GaugeMetricFamily, Metric
    from prometheus_client.exposition import choose_encoder
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ConfigurationError(
        "Prometheus metrics need the metrics extra: pip install 'errands[metrics]'"
    ) from exc

if TYPE_CHECKING:
    from ..app import App
    from ..backends.base import QueueStats, StoreHealth

log = logging.getLogger("errands.metrics")

CACHE_SECONDS_DEFAULT = 5.0
DURATION_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
    600.0, 1800.0, 3600.0,
)  # fmt: skip
QUEUE_WAIT_BUCKETS = (
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 14400.0,
    86400.0,
)  # fmt: skip

# event name -> the ``outcome`` label of errands_jobs_completed_total
OUTCOMES = {
    "errands.job.completed": "completed",
    "errands.job.retrying": "retry",
    "errands.job.dead": "dead",
    "errands.job.cancelled": "cancelled",
}
# events that end an attempt this process started (for errands_jobs_in_flight)
# (a suspension too: ctx.wait_for_signal ends the attempt; in flight stayed up for good;
# and an outcome or release the store could not take: write_failed)
ATTEMPT_ENDS = frozenset(
    [
        *OUTCOMES,
        "errands.job.stale_write_rejected",
        "errands.job.write_failed",
        "errands.job.released",
        "errands.job.waiting",
    ]
)
RESCUE_OUTCOMES = {"retryable": "retry", "dead": "dead", "cancelled": "cancelled"}

_installed: weakref.WeakKeyDictionary[App, list[ErrandsMetrics]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
fresh_lock_at_fork(globals(), "_lock")  # a new one in a forked child


class ErrandsMetrics:
    """The metrics of one App in one registry (made by :func:`install_metrics`)."""

    def __init__(
        self,
        app: App,
        registry: CollectorRegistry,
        *,
        cache_seconds: float = CACHE_SECONDS_DEFAULT,
        store_health: bool = True,
    ) -> None:
        from .. import __version__

        self.registry = registry
        self.enqueued = Counter(
            "errands_jobs_enqueued",
            "Jobs stored by this process's enqueues (deduplicated ones not counted, nor the "
            "jobs the store inserts later: ctx.enqueue children, ctx.add_to_workflow "
            "members, workflow callbacks); an enqueue with conn= is counted when it returns, "
            "before the caller's transaction commits or rolls back",
            ["queue", "job"],
            registry=registry,
        )
        self.completed = Counter(
            "errands_jobs_completed",
            "Attempts ended, by outcome (completed, retry, dead, cancelled): by the worker "
            "that ran them, or by the maintenance leader that rescued them or timed their "
            "signal wait out (then counted where the leader runs)",
            ["queue", "job", "outcome"],
            registry=registry,
        )
        self.duration = Histogram(
            "errands_job_duration_seconds",
            "Time from an attempt's start to its outcome",
            ["queue", "job"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.queue_wait = Histogram(
            "errands_job_queue_wait_seconds",
            "Time a job waited past its run_at before an attempt started",
            ["queue", "job"],
            buckets=QUEUE_WAIT_BUCKETS,
            registry=registry,
        )
        self.in_flight = Gauge(
            "errands_jobs_in_flight",
            "Attempts running in this process now",
            ["queue", "job"],
            registry=registry,
        )
        self.rescues = Counter(
            "errands_rescues",
            "Expired leases rescued by this process's maintenance leader, by outcome",
            ["queue", "job", "outcome"],
            registry=registry,
        )
        self.stale_writes = Counter(
            "errands_stale_writes_rejected",
            "Outcomes refused because the attempt no longer held the job's lease",
            ["queue", "job"],
            registry=registry,
        )
        self.workflows = Counter(
            "errands_workflows_settled",
            "Workflows whose settling this process committed, by kind and final state",
            ["kind", "state"],
            registry=registry,
        )
        self.leader = Gauge(
            "errands_leader",
            "1 while this process's worker is the maintenance leader",
            registry=registry,
        )
        self.build_info = Info("errands_build", "The errands version", registry=registry)
        self.build_info.info({"version": __version__})
        self.store = StoreCollector(app, cache_seconds=cache_seconds, store_health=store_health)
        registry.register(self.store)
        self._running: dict[tuple[Any, Any], tuple[str, str]] = {}
        self._running_lock = threading.Lock()

    # -- the event subscriber ------------------------------------------------------------
    def on_event(self, event: Event) -> None:
        name = event.name
        f = event.fields
        if not name.startswith("errands.job."):
            if name == "errands.leader.elected":
                self.leader.set(1)
            elif name == "errands.leader.resigned":
                self.leader.set(0)
            elif name == "errands.workflow.settled":
                self.workflows.labels(str(f.get("kind")), str(f.get("state"))).inc()
            return
        queue, job = str(f.get("queue", "")), str(f.get("job_name", ""))
        if name == "errands.job.enqueued":
            if not f.get("deduplicated"):
                self.enqueued.labels(queue, job).inc()
        elif name == "errands.job.started":
            with self._running_lock:
                self._running[(f.get("job_id"), f.get("attempt"))] = (queue, job)
            self.in_flight.labels(queue, job).inc()
            wait = f.get("queue_wait")
            if wait is not None:
                self.queue_wait.labels(queue, job).observe(max(float(wait), 0.0))
        elif name == "errands.job.rescued":
            state = str(f.get("state"))
            rescued_as = RESCUE_OUTCOMES.get(state, state)
            self.rescues.labels(queue, job, rescued_as).inc()
            if state != "dead":  # (a rescue to dead comes as errands.job.dead, counted below)
                # the lost attempt ended, as a retrying or cancelled one does: only a
                # rescue to dead was counted as an attempt's outcome
                self.completed.labels(queue, job, rescued_as).inc()
        elif name == "errands.job.stale_write_rejected":
            self.stale_writes.labels(queue, job).inc()
        elif name == "errands.job.wait_timed_out" and f.get("state") == "retryable":
            # a failed attempt, as a retrying one is (one ending dead comes as
            # errands.job.dead): it was counted nowhere
            self.completed.labels(queue, job, "retry").inc()
        outcome: str | None = OUTCOMES.get(name)
        if outcome is not None:
            self.completed.labels(queue, job, outcome).inc()
            duration = f.get("duration")
            if duration is not None:
                self.duration.labels(queue, job).observe(max(float(duration), 0.0))
        if name in ATTEMPT_ENDS:
            with self._running_lock:
                labels = self._running.pop((f.get("job_id"), f.get("attempt")), None)
            if labels is not None:
                self.in_flight.labels(*labels).dec()


class StoreCollector(Collector):
    """Gauges read from the database at scrape time: one cached aggregate query."""

    def __init__(
        self,
        app: App,
        *,
        cache_seconds: float = CACHE_SECONDS_DEFAULT,
        store_health: bool = True,
    ) -> None:
        self._app = weakref.ref(app)
        self.cache_seconds = cache_seconds
        self.store_health = store_health
        self._lock = threading.Lock()
        self._read_at = -float("inf")
        self._stats: list[QueueStats] = []
        self._health: StoreHealth | None = None
        self._fair: dict[str, list[KeyRow]] = {}  # per fair queue: its top keys
        self.queries = 0  # how many times the store was asked (tests and debugging)

    def describe(self) -> Iterable[Metric]:
        # Named without samples, so registering never queries the database.
        return [*self._families(describing=True), *_fair_families({})]

    def collect(self) -> Iterable[Metric]:
        self._refresh()
        return [*self._families(self._stats, self._health), *_fair_families(self._fair)]

    def _refresh(self) -> None:
        with self._lock:
            if time.monotonic() - self._read_at < self.cache_seconds:
                return
            app = self._app()
            if app is None:
                return
            try:
                self._stats = app.queue_stats()
                self._health = app.backend.store_health() if self.store_health else None
                self._fair = {
                    s.name: top_keys(app.fair_figures(s.name, weight_wait=0.05))
                    for s in app.queue_settings()
                    if s.fair
                }
                self.queries += 1
            except Exception as exc:  # a scrape must not fail; show what we last knew
                log.warning("metrics: reading queue statistics failed: %s", exc)
            self._read_at = time.monotonic()

    @staticmethod
    def _families(
        stats: list[QueueStats] | None = None,
        health: StoreHealth | None = None,
        describing: bool = False,
    ) -> Iterator[Metric]:
        jobs = GaugeMetricFamily(
            "errands_jobs", "Jobs in the store by queue and state", labels=["queue", "state"]
        )
        oldest = GaugeMetricFamily(
            "errands_oldest_available_job_age_seconds",
            "How long the oldest due job of each queue has waited (0 when none waits)",
            labels=["queue"],
        )
        dead = GaugeMetricFamily(
            "errands_dead_letter_jobs",
            "Jobs in the dead-letter queue (state dead)",
            labels=["queue"],
        )
        stalled = GaugeMetricFamily(
            "errands_stalled_jobs",
            "Running jobs whose lease has expired, awaiting rescue (their worker is gone)",
            labels=["queue"],
        )
        for s in stats or ():
            for state in ALL_STATES:
                jobs.add_metric([s.queue, state], s.counts.get(state, 0))
            oldest.add_metric([s.queue], s.oldest_available_age or 0.0)
            dead.add_metric([s.queue], s.counts.get("dead", 0))
            stalled.add_metric([s.queue], s.stalled)
        yield from (jobs, oldest, dead, stalled)
        gauges = [
            (
                "errands_store_dead_tuples",
                "PostgreSQL: dead row versions in errands_jobs (vacuum falls behind)",
                "dead_tuples",
            ),
            (
                "errands_store_oldest_transaction_age_seconds",
                "PostgreSQL: age of the oldest open transaction in the database (it holds "
                "back vacuum)",
                "oldest_transaction_age",
            ),
            ("errands_store_pages", "SQLite: pages in the database file", "page_count"),
            ("errands_store_free_pages", "SQLite: unused pages in the file", "freelist_count"),
            ("errands_store_wal_bytes", "SQLite: size of the write-ahead log", "wal_bytes"),
        ]
        for name, doc, attribute in gauges:
            value = getattr(health, attribute, None)
            if describing:
                yield GaugeMetricFamily(name, doc)
            elif value is not None:  # only the gauges this kind of store has
                yield GaugeMetricFamily(name, doc, value=value)


def _fair_families(fair: dict[str, list[KeyRow]]) -> Iterator[Metric]:
    """Per fair queue, its top keys by recent worker time and one "other" (bounded)."""
    labels = ["queue", "key"]
    share = GaugeMetricFamily(
        "errands_fair_key_worker_share",
        "Fair queues: each key's share of the queue's recent worker time (decayed, 0..1)",
        labels=labels,
    )
    seconds = GaugeMetricFamily(
        "errands_fair_key_worker_seconds",
        "Fair queues: worker seconds of each key's ended attempts, in all",
        labels=labels,
    )
    dwell = GaugeMetricFamily(
        "errands_fair_key_mean_dwell_seconds",
        "Fair queues: each key's mean dwell, from due to start, over its ended attempts",
        labels=labels,
    )
    due = GaugeMetricFamily(
        "errands_fair_key_due_jobs", "Fair queues: each key's jobs due now", labels=labels
    )
    for queue, rows in fair.items():
        for row in rows:
            f = row.figures
            share.add_metric([queue, f.key], row.share)
            seconds.add_metric([queue, f.key], f.seconds_total)
            if f.mean_dwell is not None:
                dwell.add_metric([queue, f.key], f.mean_dwell)
            due.add_metric([queue, f.key], f.due)
    yield from (share, seconds, dwell, due)


def install_metrics(
    app: App,
    registry: CollectorRegistry | None = None,
    *,
    cache_seconds: float = CACHE_SECONDS_DEFAULT,
    store_health: bool = True,
) -> ErrandsMetrics:
    """Subscribe Prometheus metrics to ``app``'s events; returns them (``.registry``).

    ``registry``: None makes a new :class:`CollectorRegistry` for this call; pass
    ``prometheus_client.REGISTRY`` to use the global one (with the process metrics).
    Installing twice into the same registry returns the first installation.
    """
    if cache_seconds < 0:
        raise ConfigurationError("install_metrics(cache_seconds=...) must be >= 0")
    with _lock:
        existing = _installed.setdefault(app, [])
        if registry is not None:
            for metrics in existing:
                if metrics.registry is registry:
                    return metrics
        target = registry if registry is not None else CollectorRegistry()
        try:
            metrics = ErrandsMetrics(
                app, target, cache_seconds=cache_seconds, store_health=store_health
            )
        except ValueError as exc:  # "Duplicated timeseries": another App's metrics are there
            raise ConfigurationError(
                f"cannot register errands metrics in this registry: {exc}. Another App's "
                "metrics are already in it; pass registry=CollectorRegistry() for each App"
            ) from None
        existing.append(metrics)
    app.events.subscribe(metrics.on_event, inline=True)
    return metrics


def installed_metrics(app: App) -> ErrandsMetrics | None:
    """The metrics most recently installed on ``app``, if any."""
    with _lock:
        found = _installed.get(app)
        return found[-1] if found else None


def serve_metrics(
    app: App,
    port: int,
    addr: str = "0.0.0.0",
    registry: CollectorRegistry | None = None,
) -> tuple[Any, threading.Thread]:
    """Install metrics (global registry by default) and serve them over HTTP on ``port``.

    ``addr``: the address it binds; ``0.0.0.0`` (every interface, as prometheus_client's
    own server) so that a Prometheus on another host can scrape it. There is no login,
    and the metrics name queues, job types and fair queues' top keys: ``127.0.0.1`` (this
    host only), a private address or a firewall keeps them in (docs/observability.md).
    Returns prometheus_client's ``(server, thread)``; call ``server.shutdown()`` to stop.
    """
    metrics = install_metrics(app, registry if registry is not None else REGISTRY)
    return start_http_server(port, addr=addr, registry=metrics.registry)  # type: ignore[no-any-return]


ASGIApp = Callable[
    [dict[str, Any], Callable[[], Awaitable[dict[str, Any]]], Callable[..., Awaitable[None]]],
    Awaitable[None],
]


def asgi_app(app: App, registry: CollectorRegistry | None = None) -> ASGIApp:
    """An ASGI application serving the metrics at ``/metrics`` (or wherever it is mounted).

    Uses the metrics already installed on ``app`` (the latest), else installs them.
    The scrape runs in a thread: reading the queue statistics is a blocking query.
    """
    metrics = None if registry is not None else installed_metrics(app)
    if metrics is None:
        metrics = install_metrics(app, registry)
    target = metrics.registry

    async def respond(send: Any, status: int, body: bytes, content_type: str) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", content_type.encode()),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def metrics_asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]  # mounted under a prefix (Starlette's Mount)
        if path.rstrip("/") not in ("", "/metrics"):
            await respond(send, 404, b"not found; metrics are at /metrics\n", "text/plain")
            return
        method = scope.get("method", "GET")
        if method not in ("GET", "HEAD"):
            await respond(send, 405, b"method not allowed\n", "text/plain")
            return
        accept = ""
        for key, value in scope.get("headers", []):
            if key.lower() == b"accept":
                accept = value.decode("latin-1")
        encoder, content_type = choose_encoder(accept)
        body = await offloop.run(encoder, target)
        await respond(send, 200, b"" if method == "HEAD" else body, content_type)

    return metrics_asgi
