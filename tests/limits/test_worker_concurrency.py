"""Per-worker concurrency per queue: ``-q emails=10,payments=2`` (issue 5, item 1).

A worker never runs more jobs of a queue at once than that queue's ``=N``, and never more
than ``-c`` in all; without ``-c`` its concurrency is the sum of the per-queue limits.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import errands
from errands.errors import ConfigurationError
from errands.worker.worker import parse_queues

from .helpers import Intervals, LimitsCluster, peak, wait_until, workers


def test_queue_spec_parses_per_queue_limits_and_rejects_bad_ones() -> None:
    assert parse_queues("emails=10,payments=2") == {"emails": 10, "payments": 2}
    assert parse_queues(" emails = 10 , payments") == {"emails": 10, "payments": None}
    assert parse_queues({"emails": 10}) == {"emails": 10}
    assert parse_queues(["emails", "payments"]) == {"emails": None, "payments": None}
    with pytest.raises(ConfigurationError, match="whole number, as in emails=10"):
        parse_queues("emails=ten")
    with pytest.raises(ConfigurationError, match="at least 1"):
        parse_queues("emails=0")


def test_worker_concurrency_defaults_to_the_sum_of_the_per_queue_limits(tmp_path: Path) -> None:
    app = errands.App(f"sqlite:///{tmp_path}/errands.db")
    for queues, concurrency, expected in [
        ("emails=10,payments=2", None, 12),
        ("emails=10,payments=2", 4, 4),
        ("emails=10,payments", None, 10),  # one queue unbounded: the default 10
    ]:
        worker = app.worker(queues=queues, concurrency=concurrency)
        worker.threads.shutdown()  # built, never run
        assert worker.concurrency == expected


def test_in_process_worker_runs_at_most_n_jobs_of_each_queue_at_once(
    store: errands.App,
) -> None:
    runs = Intervals()

    @store.job(name="emails.send", queue="emails")
    def send(n: int) -> None:
        with runs.run("emails"):
            time.sleep(0.25)

    @store.job(name="payments.charge", queue="payments")
    def charge(n: int) -> None:
        with runs.run("payments"):
            time.sleep(0.25)

    store.enqueue_many([send.bind(n=i) for i in range(30)] + [charge.bind(n=i) for i in range(8)])
    with workers([store], queues="emails=10,payments=2") as [worker]:
        assert worker.concurrency == 12
        wait_until(
            lambda: len(store.jobs(state="completed", limit=100)) == 38, 30, "38 completed jobs"
        )
    assert runs.peak_by_label() == {"emails": 10, "payments": 2}


def test_worker_process_honours_per_queue_limits_given_on_the_command_line(
    cluster: LimitsCluster,
) -> None:
    app = cluster.app("limits_app")
    emails, payments = app.registry["emails.send"], app.registry["payments.charge"]
    app.enqueue_many(
        [emails.bind(seconds=0.3) for _ in range(12)]
        + [payments.bind(seconds=0.3) for _ in range(4)]
    )
    cluster.start_worker("-q", "emails=3,payments=1", "-c", "10", app="limits_app:app")
    wait_until(lambda: len(app.jobs(state="completed", limit=100)) == 16, 60, "16 completed jobs")
    queue_of = {j.id: j.queue for j in app.jobs(limit=100)}
    runs = cluster.runs()
    assert len(runs) == 16
    assert peak((s, e) for job_id, _, s, e in runs if queue_of[job_id] == "emails") == 3
    assert peak((s, e) for job_id, _, s, e in runs if queue_of[job_id] == "payments") == 1


def test_worker_command_rejects_a_bad_queue_spec_with_a_clear_error(tmp_path: Path) -> None:
    cluster = LimitsCluster(tmp_path, f"sqlite:///{tmp_path}/errands.db")
    try:
        result = cluster.cli("worker", "limits_app:app", "-q", "emails=ten")
    finally:
        cluster.stop_all()
    assert result.code == 1, result
    assert "error: queue spec 'emails=ten'" in result.stderr, result
    assert "Traceback" not in result.stderr
