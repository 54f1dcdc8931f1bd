"""Prometheus metrics: counters fed by events, queue gauges from one cached query per
scrape, the ASGI /metrics route, and the PostgreSQL health gauges (issue 6)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import errands
from errands.observability.events import Event
from errands.observability.metrics import asgi_app, install_metrics
from tests.integration.helpers import wait_until

from .conftest import metric_names, metric_value

GRAFANA = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "errands.json"


def scrape(asgi: Any, path: str = "/metrics", root_path: str = "") -> tuple[int, str]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "root_path": root_path, "headers": []}
    asyncio.run(asgi(scope, receive, send))
    status = sent[0]["status"]
    body = b"".join(m.get("body", b"") for m in sent[1:]).decode()
    return status, body


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_after_100_completions_10_retries_and_5_dead_jobs_match_exactly(
    app: errands.App, worker_factory: Any
) -> None:
    metrics = install_metrics(app, cache_seconds=0)
    registry = metrics.registry

    @app.job(name="m.ok", queue="fast")
    def ok(n: int) -> None:
        pass

    @app.job(name="m.flaky", retries=1, backoff=0.01)
    def flaky(ctx: errands.Context, n: int) -> None:
        if ctx.attempt == 1:
            raise ConnectionError("try again")

    @app.job(name="m.broken", retries=0)
    def broken(n: int) -> None:
        raise ValueError("always")

    app.enqueue_many(
        [ok.bind(n=i) for i in range(90)]
        + [flaky.bind(n=i) for i in range(10)]
        + [broken.bind(n=i) for i in range(5)]
    )
    assert metric_value(registry, "errands_jobs_enqueued_total") == 105
    assert metric_value(registry, "errands_jobs", state="available") == 105

    with worker_factory(queues="fast,default", concurrency=10):
        wait_until(
            lambda: metric_value(registry, "errands_jobs_completed_total") == 115,
            timeout=20,
            what="115 attempt outcomes",
        )
        wait_until(lambda: metric_value(registry, "errands_leader") == 1, what="leader gauge")
    completed = metric_value(registry, "errands_jobs_completed_total", outcome="completed")
    retried = metric_value(registry, "errands_jobs_completed_total", outcome="retry")
    dead = metric_value(registry, "errands_jobs_completed_total", outcome="dead")
    assert (completed, retried, dead) == (100, 10, 5)
    assert metric_value(registry, "errands_jobs_completed_total", job="m.ok", queue="fast") == 90
    assert metric_value(registry, "errands_jobs_completed_total", job="m.flaky") == 20
    assert metric_value(registry, "errands_job_duration_seconds_count") == 115
    assert metric_value(registry, "errands_job_queue_wait_seconds_count") == 115
    assert metric_value(registry, "errands_jobs_in_flight") == 0
    assert metric_value(registry, "errands_leader") == 0  # resigned at the graceful stop
    assert metric_value(registry, "errands_jobs", state="completed") == 100
    assert metric_value(registry, "errands_jobs", state="dead") == 5
    assert metric_value(registry, "errands_dead_letter_jobs") == 5
    assert metric_value(registry, "errands_dead_letter_jobs", queue="default") == 5
    assert metric_value(registry, "errands_build_info", version=errands.__version__) == 1

    # the same numbers through the ASGI /metrics route, as Prometheus reads them
    status, text = scrape(asgi_app(app))
    assert status == 200
    read = samples(text)
    key = frozenset({"queue": "default", "job": "m.broken", "outcome": "dead"}.items())
    assert read[("errands_jobs_completed_total", key)] == 5
    assert read[("errands_dead_letter_jobs", frozenset({"queue": "default"}.items()))] == 5
    labels = {name for (_, pairs) in read for name, _ in pairs}
    assert labels <= {"queue", "job", "state", "outcome", "le", "version"}


def test_queue_gauges_come_from_one_cached_query_per_scrape_never_per_job(
    app: errands.App, worker_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = app.queue_stats

    def counting() -> Any:
        calls.append(1)
        return real()

    monkeypatch.setattr(app, "queue_stats", counting)
    metrics = install_metrics(app, cache_seconds=60)
    assert calls == []  # registering never queries

    @app.job(name="m.many")
    def many(n: int) -> None:
        pass

    handles = app.enqueue_many([many.bind(n=i) for i in range(50)])
    with worker_factory():
        for handle in handles:
            handle.result(timeout=10)
    assert calls == []  # events feed the counters; jobs never query

    for _ in range(3):
        metric_value(metrics.registry, "errands_jobs")
    assert len(calls) == 1  # cached for cache_seconds

    metrics.store.cache_seconds = 0
    metric_value(metrics.registry, "errands_jobs")
    assert len(calls) == 2


def test_each_install_gets_its_own_registry_unless_one_is_given(tmp_path: Path) -> None:
    first = errands.App(f"sqlite:///{tmp_path}/a.db")
    second = errands.App(f"sqlite:///{tmp_path}/b.db")
    try:
        a, b = install_metrics(first), install_metrics(second)
        assert a.registry is not b.registry

        @first.job(name="m.one")
        def one() -> None:
            pass

        one.enqueue()
        assert metric_value(a.registry, "errands_jobs_enqueued_total") == 1
        assert metric_value(b.registry, "errands_jobs_enqueued_total") == 0

        shared = CollectorRegistry()
        assert install_metrics(first, shared) is install_metrics(first, shared)
        with pytest.raises(errands.ConfigurationError, match="Another App"):
            install_metrics(second, shared)
    finally:
        first.close()
        second.close()


def test_the_asgi_route_serves_metrics_at_its_path_and_mounted_and_404_elsewhere(
    app: errands.App,
) -> None:
    metrics = install_metrics(app)
    asgi = asgi_app(app)
    status, text = scrape(asgi)
    assert status == 200 and "errands_build_info" in text
    assert scrape(asgi, "/metrics", root_path="/metrics")[0] == 200  # Mount("/metrics", ...)
    assert scrape(asgi, "/admin")[0] == 404
    assert metrics.registry is not None


def test_sqlite_stores_report_file_gauges_and_no_postgres_gauges(app: errands.App) -> None:
    names = metric_names(install_metrics(app, cache_seconds=0).registry)
    assert {"errands_store_pages", "errands_store_free_pages", "errands_store_wal_bytes"} <= names
    assert "errands_store_dead_tuples" not in names
    assert "errands_store_oldest_transaction_age_seconds" not in names


def test_postgres_stores_report_dead_tuples_and_the_oldest_open_transaction(pg_url: str) -> None:
    import psycopg

    from tests.pg import pg_base_url

    app = errands.App(pg_url)
    try:

        @app.job(name="m.pg")
        def pg_job() -> None:
            pass

        pg_job.enqueue()
        registry = install_metrics(app, cache_seconds=0).registry
        names = metric_names(registry)
        assert "errands_store_dead_tuples" in names
        assert "errands_store_oldest_transaction_age_seconds" in names
        assert "errands_store_pages" not in names
        assert metric_value(registry, "errands_store_dead_tuples") >= 0
        assert metric_value(registry, "errands_jobs", state="available") == 1

        with psycopg.connect(pg_base_url()) as idle:  # an open transaction, left idle
            idle.execute("SELECT 1")
            wait_until(
                lambda: (
                    metric_value(registry, "errands_store_oldest_transaction_age_seconds") >= 0.3
                ),
                timeout=10,
                interval=0.05,
                what="the idle transaction's age",
            )
            idle.rollback()
    finally:
        app.close()


def test_the_grafana_dashboard_is_valid_json_with_the_promised_panels() -> None:
    dashboard = json.loads(GRAFANA.read_text())
    exprs = " ".join(
        target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])
    )
    for metric in (
        "errands_jobs_completed_total",
        "errands_job_duration_seconds_bucket",
        "errands_jobs{",
        "errands_oldest_available_job_age_seconds",
        "errands_dead_letter_jobs",
        "errands_jobs_in_flight",
        "errands_rescues_total",
        "errands_stale_writes_rejected_total",
        "errands_store_dead_tuples",
    ):
        assert metric in exprs, metric
    assert "histogram_quantile(0.95" in exprs and "histogram_quantile(0.5" in exprs
    assert "by (outcome)" in exprs and "by (state)" in exprs
    # with every worker down there is no errands_leader series at all: 0, not "no data"
    assert "sum(errands_leader) or vector(0)" in exprs


def test_the_documented_no_leader_alert_fires_when_no_worker_reports_at_all() -> None:
    """sum() of no series is an empty vector, never < 1: the alert stayed silent exactly
    when every worker was down."""
    docs = (GRAFANA.parents[1] / "observability.md").read_text()
    [rule] = re.findall(r"alert: ErrandsNoLeader.*\n\s+expr: (.+)", docs)
    assert rule.strip() == "(sum(errands_leader) or vector(0)) < 1"


def test_fair_queues_report_per_key_share_and_dwell_for_the_top_keys_and_other(
    app: errands.App, worker_factory: Any
) -> None:
    """A fair queue with 13 tenants: the metrics carry at most 10 keys plus "other", so
    the label count stays bounded however many tenants there are."""
    app.queue("reports", fair=True)

    @app.job(name="m.report", queue="reports", fair_key="tenant:{tenant}")
    def report(tenant: int, n: int) -> None:
        pass

    handles = app.enqueue_many([report.bind(tenant=n % 13, n=n) for n in range(39)])
    with worker_factory(queues=["reports"]):
        for handle in handles:
            handle.result(timeout=30)
    metrics = install_metrics(app, cache_seconds=0)
    status, body = scrape(asgi_app(app, metrics.registry))
    assert status == 200
    found = samples(body)
    keys = {
        dict(labels)["key"]
        for name, labels in found
        if name == "errands_fair_key_worker_seconds" and dict(labels)["queue"] == "reports"
    }
    assert len(keys) == 11 and "other" in keys
    dwell = [v for (name, _), v in found.items() if name == "errands_fair_key_mean_dwell_seconds"]
    assert len(dwell) == 11 and all(v >= 0 for v in dwell)
    shares = [v for (name, _), v in found.items() if name == "errands_fair_key_worker_share"]
    assert sum(shares) == pytest.approx(1.0, abs=0.01)


def test_a_suspended_attempt_leaves_the_in_flight_gauge(app: errands.App, worker_factory) -> None:  # type: ignore[no-untyped-def]
    """ctx.wait_for_signal ends the attempt ('waiting'): in flight stayed up for good."""
    registry = install_metrics(app, cache_seconds=0).registry

    @app.job(name="m.waits")
    def waits(ctx: errands.Context) -> str:
        return str(ctx.wait_for_signal("go"))

    handle = waits.enqueue()
    with worker_factory(concurrency=2):
        wait_until(lambda: handle.job().state.value == "waiting", what="the suspension")
        wait_until(
            lambda: metric_value(registry, "errands_jobs_in_flight") == 0,
            what="the suspended attempt out of the gauge",
        )
        app.signal(handle.id, "go", "yes")
        assert handle.result(timeout=10) == "yes"
    assert metric_value(registry, "errands_jobs_in_flight") == 0


def test_a_signal_wait_that_times_out_counts_as_a_failed_attempt(
    app: errands.App, worker_factory
) -> None:  # type: ignore[no-untyped-def]
    """A wait past its timeout is a failed attempt: one ending dead was counted (its
    errands.job.dead), one ending retryable in no counter at all."""
    from errands.maintenance.service import Maintenance

    registry = install_metrics(app, cache_seconds=0).registry

    @app.job(name="m.times_out", retries=1, backoff=0.05)
    def times_out(ctx: errands.Context) -> str:
        return str(ctx.wait_for_signal("go", timeout=0.1))

    handle = times_out.enqueue()
    leader = Maintenance(app, "w-leader")
    with worker_factory(concurrency=1, maintenance=False):
        for _ in range(2):
            wait_until(lambda: handle.job().state.value == "waiting", what="a suspension")
            time.sleep(0.2)  # past its timeout
            leader.run_once()  # its duties: the wait's timeout among them
        wait_until(lambda: handle.job().state.value == "dead", what="the job dead")
    retry = metric_value(registry, "errands_jobs_completed_total", outcome="retry")
    dead = metric_value(registry, "errands_jobs_completed_total", outcome="dead")
    assert (retry, dead) == (1, 1)


def test_a_fair_key_named_other_is_counted_in_the_aggregate_not_beside_it() -> None:
    """A tenant whose key is literally "other", among the top keys, was a row beside the
    aggregate "other": two series with one label set in one scrape."""
    from errands.backends.base import FairKeyFigures
    from errands.observability.fair_keys import top_keys

    def key(name: str, seconds: float) -> FairKeyFigures:
        return FairKeyFigures(name, seconds, seconds, 1, 0.0, 0, 1, 1.0)

    rows = top_keys([key("other", 5.0), key("acme", 4.0), key("zeta", 1.0)], n=2)
    assert [r.figures.key for r in rows] == ["acme", "other"]
    assert (rows[-1].keys, rows[-1].figures.recent_seconds) == (2, 6.0)
    assert top_keys([key("acme", 1.0), key("other", 1.0)], n=10)[-1].keys == 1


class _StuckJob:
    """A job type whose handler runs until the test lets it go (it ignores ctx.cancelled,
    so a graceful stop's grace period runs out and the worker releases the job)."""

    def __init__(self, app: errands.App, name: str) -> None:
        self.started = threading.Event()
        self.done = threading.Event()

        @app.job(name=name, retries=3, backoff=3600)
        def stuck() -> str:
            self.started.set()
            while not self.done.is_set():
                time.sleep(0.01)
            return "late"

        self.job = stuck


def test_a_release_refused_because_the_job_was_rescued_ends_the_attempt_for_metrics_and_traces(
    db_url: str, spans: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker whose job was rescued elsewhere (the leader took it after a self-fence, or
    before a graceful stop's release) gives it back; the store refuses the release (the
    lease is another's). No event ended the attempt: errands_jobs_in_flight stayed at 1
    and its process span stayed open, for good, and the log said 'released 0 job(s)'."""
    from errands.observability.tracing import install_tracing
    from tests.integration.helpers import WorkerThread, force_rescue

    app = errands.App(db_url, lease=600)  # no heartbeat finds the loss first (one in 200 s)
    leader = errands.App(db_url)  # the maintenance leader, in another process
    registry = install_metrics(app, cache_seconds=0).registry
    plugin = install_tracing(app, tracer_provider=spans.provider)
    seen: list[str] = []
    app.events.subscribe(lambda e: seen.append(e.name))
    stuck = _StuckJob(app, "m.stuck")
    _StuckJob(leader, "m.stuck")  # its backoff (an hour): the rescued job waits
    handle = stuck.job.enqueue()
    worker = WorkerThread(app, grace=0.2).start()
    try:
        assert stuck.started.wait(10)
        assert metric_value(registry, "errands_jobs_in_flight") == 1
        force_rescue(leader, handle.id)
        with caplog.at_level(logging.WARNING, logger="errands.worker"):
            worker.stop()
    finally:
        stuck.done.set()
        leader.close()
    assert handle.job().state.value == "retryable"  # the rescue's, untouched by the release
    wait_until(lambda: "errands.job.stale_write_rejected" in seen, what="the refusal's event")
    assert "errands.job.released" not in seen
    assert metric_value(registry, "errands_jobs_in_flight") == 0
    assert metric_value(registry, "errands_stale_writes_rejected_total") == 1
    [span] = spans.named("process default")
    assert span.attributes["errands.job.outcome"] == "stale"
    assert plugin._running == {}
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "released 0 job(s)" in m], messages
    assert [m for m in messages if f"could not release job(s) {handle.id}:" in m], messages
    app.close()


def test_a_release_the_store_could_not_take_ends_the_attempt_as_write_failed(
    db_url: str, spans: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release itself failed (the store out of reach at a self-fence or a stop): the
    job is rescued after its lease, and the attempt ends here as write_failed."""
    import sqlite3

    from errands.observability.tracing import install_tracing
    from tests.integration.helpers import WorkerThread

    app = errands.App(db_url, lease=600)
    registry = install_metrics(app, cache_seconds=0).registry
    plugin = install_tracing(app, tracer_provider=spans.provider)
    seen: list[Event] = []
    app.events.subscribe(seen.append)
    stuck = _StuckJob(app, "m.stuck")
    handle = stuck.job.enqueue()

    def unreachable(*args: Any, **kwargs: Any) -> Any:
        raise sqlite3.OperationalError("disk I/O error")

    worker = WorkerThread(app, grace=0.2).start()
    try:
        assert stuck.started.wait(10)
        monkeypatch.setattr(app.backend, "job_release_many", unreachable)
        worker.stop()
    finally:
        stuck.done.set()
    assert handle.job().state.value == "running"  # rescued when its lease runs out
    assert metric_value(registry, "errands_jobs_in_flight") == 0  # (inline: at once)
    wait_until(
        lambda: any(e.name == "errands.job.write_failed" for e in list(seen)),
        what="the write_failed event",
    )
    [failed] = [e for e in seen if e.name == "errands.job.write_failed"]
    assert (failed["job_id"], failed["outcome"]) == (handle.id, "released")
    [span] = spans.named("process default")
    assert span.attributes["errands.job.outcome"] == "write_failed"
    assert span.status.status_code.name == "ERROR"
    assert plugin._running == {}
    app.close()


def test_an_outcome_that_cannot_be_stored_at_all_ends_the_attempt_as_write_failed(
    app: errands.App, worker_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The completer gave up on an outcome (refused for its content, the fallback too):
    on_written(None) emitted nothing, and the in-flight gauge stayed up for good."""
    registry = install_metrics(app, cache_seconds=0).registry
    seen: list[Event] = []
    app.events.subscribe(seen.append)

    @app.job(name="m.unstorable")
    def unstorable() -> str:
        return "done"

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("the store refuses this outcome")  # not transient: never retried

    monkeypatch.setattr(app.backend, "job_finish_many", refused)
    handle = unstorable.enqueue()
    with worker_factory(concurrency=1, maintenance=False):
        wait_until(lambda: any(e.name == "errands.job.started" for e in list(seen)), what="start")
        wait_until(
            lambda: metric_value(registry, "errands_jobs_in_flight") == 0,
            what="the attempt out of the in-flight gauge",
        )
        wait_until(
            lambda: any(e.name == "errands.job.write_failed" for e in list(seen)),
            what="the write_failed event",
        )
        [failed] = [e for e in seen if e.name == "errands.job.write_failed"]
        assert (failed["job_id"], failed["outcome"]) == (handle.id, "dead")  # (the fallback)


def test_every_rescued_attempt_counts_once_in_completed_total_whatever_its_outcome(
    app: errands.App,
) -> None:
    """A rescue to dead was counted in errands_jobs_completed_total (its errands.job.dead),
    a rescue to retry or to cancelled was not: the same lost attempt counted or not by
    where it went."""
    from errands.maintenance.service import Maintenance
    from tests.integration.helpers import claim_as_dead_worker, expire_lease

    registry = install_metrics(app, cache_seconds=0).registry

    @app.job(name="m.again", retries=1, backoff=3600)
    def again() -> None: ...

    @app.job(name="m.last", retries=0)
    def last() -> None: ...

    @app.job(name="m.stopped", retries=1)
    def stopped() -> None: ...

    handles = [again.enqueue(), last.enqueue(), stopped.enqueue()]
    for handle in handles:
        claim_as_dead_worker(app, handle.id)
    app.cancel(handles[2].id)
    for handle in handles:
        expire_lease(app, handle.id)
    assert Maintenance(app, "test-leader").rescue() == 3
    assert [h.job().state.value for h in handles] == ["retryable", "dead", "cancelled"]
    for job, outcome in (("m.again", "retry"), ("m.last", "dead"), ("m.stopped", "cancelled")):
        assert metric_value(registry, "errands_rescues_total", job=job, outcome=outcome) == 1
        assert metric_value(registry, "errands_jobs_completed_total", job=job) == 1, job
        assert (
            metric_value(registry, "errands_jobs_completed_total", job=job, outcome=outcome) == 1
        ), job
