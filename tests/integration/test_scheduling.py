"""Per-queue concurrency, priorities and delayed jobs on one worker (DESIGN §7, I7)."""

import asyncio
import threading
import time
from typing import Any

import errands
from errands import JobState
from tests.conftest import running_worker


class Gauge:
    """Counts handlers running at once, per queue, and remembers the peak."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current: dict[str, int] = {}
        self.peak: dict[str, int] = {}

    def enter(self, queue: str) -> None:
        with self._lock:
            self.current[queue] = self.current.get(queue, 0) + 1
            self.peak[queue] = max(self.peak.get(queue, 0), self.current[queue])

    def leave(self, queue: str) -> None:
        with self._lock:
            self.current[queue] -= 1


def test_per_queue_concurrency_is_never_exceeded(app: errands.App, worker_factory) -> None:
    gauge = Gauge()

    @app.job(name="sched.in_a", queue="a")
    def in_a(n: int) -> None:
        gauge.enter("a")
        try:
            threading.Event().wait(0.08)
        finally:
            gauge.leave("a")

    @app.job(name="sched.in_b", queue="b")
    async def in_b(n: int) -> None:
        gauge.enter("b")
        try:
            await asyncio.sleep(0.08)
        finally:
            gauge.leave("b")

    handles = [in_a.enqueue(n=i) for i in range(6)] + [in_b.enqueue(n=i) for i in range(6)]
    with worker_factory(queues={"a": 1, "b": 2}) as worker:
        assert worker.concurrency == 3
        for handle in handles:
            handle.result(timeout=20)

    assert gauge.peak == {"a": 1, "b": 2}
    assert {h.status() for h in handles} == {JobState.COMPLETED}


def test_with_one_slot_higher_priority_jobs_run_first(app: errands.App, worker_factory) -> None:
    order: list[str] = []

    @app.job(name="sched.ranked")
    def ranked(label: str) -> None:
        order.append(label)

    plan = [("low", -1), ("normal-1", 0), ("urgent-1", 10), ("high", 5), ("urgent-2", 10)]
    handles = [ranked.enqueue(label=label, priority=p) for label, p in plan]
    with worker_factory(concurrency=1):
        for handle in handles:
            handle.result(timeout=10)

    # priority first; equal priorities in the order they were enqueued
    assert order == ["urgent-1", "urgent-2", "high", "normal-1", "low"]


def test_job_priority_option_from_the_definition_is_used(app: errands.App, worker_factory) -> None:
    order: list[str] = []

    @app.job(name="sched.background", priority=-5)
    def background() -> None:
        order.append("background")

    @app.job(name="sched.interactive", priority=5)
    def interactive() -> None:
        order.append("interactive")

    handles = [background.enqueue(), interactive.enqueue()]
    with worker_factory(concurrency=1):
        for handle in handles:
            handle.result(timeout=10)

    assert order == ["interactive", "background"]


def test_delayed_jobs_do_not_start_before_their_run_at(app: errands.App, worker_factory) -> None:
    started_at: dict[str, float] = {}

    @app.job(name="sched.timed")
    def timed(label: str) -> None:
        started_at[label] = time.time()

    with worker_factory():
        enqueued_at = time.time()
        delayed = timed.enqueue(label="delayed", delay=0.5)
        assert delayed.status() is JobState.SCHEDULED
        immediate = timed.enqueue(label="immediate")
        immediate.result(timeout=10)
        assert delayed.status() is JobState.SCHEDULED
        delayed.result(timeout=10)

    job = delayed.job()
    assert (job.run_at - job.inserted_at).total_seconds() >= 0.5 - 0.001
    assert job.attempted_at is not None and job.attempted_at >= job.run_at
    # wall clock vs the database's millisecond clock: allow for its rounding
    assert started_at["delayed"] >= job.run_at.timestamp() - 0.002
    assert started_at["delayed"] - enqueued_at >= 0.5 - 0.002
    assert started_at["immediate"] < started_at["delayed"]


def test_an_embedded_worker_warns_of_periodic_jobs_in_a_queue_no_live_worker_serves(
    app: errands.App, caplog: Any
) -> None:
    """The start-up warning is the worker's, not the CLI's: a worker run from Python (or a
    framework's embedded worker) serving only `emails` names the periodic job waiting in
    `default`; a worker that serves `default` says nothing."""

    @app.periodic("0 3 * * *", name="reconcile")
    def reconcile() -> None:
        pass

    caplog.set_level("WARNING", logger="errands.worker")
    with running_worker(app, queues=["emails"]):
        pass
    warned = [r.getMessage() for r in caplog.records if "periodic job(s)" in r.getMessage()]
    assert warned == [
        "periodic job(s) reconcile run in queue default, which this worker (-q emails) and "
        "no other live worker serves: their runs wait there; add default to -q or start a "
        "worker for it"
    ]
    caplog.clear()
    with running_worker(app, queues=["default"]):
        pass
    assert not [r for r in caplog.records if "periodic job(s)" in r.getMessage()]
