"""Priorities within a queue and delayed jobs (item 7).

Claims take due jobs by priority (higher first), then due time, then id. A delayed job
is due at its ``run_at``; nothing wakes a worker at that moment (SQLite's commit
wake-ups and PostgreSQL's NOTIFY fire when jobs are *written*), so an idle worker starts
it at its next poll: within one poll interval (plus the claim's own latency) of its time,
never before.
"""

from __future__ import annotations

import pytest

import errands

from .helpers import wait_until, workers

POLL = 0.5


@pytest.mark.parametrize("limited", [False, True], ids=["plain-queue", "limited-queue"])
def test_with_one_slot_jobs_run_by_priority_then_in_enqueue_order(
    store: errands.App, limited: bool
) -> None:
    order: list[str] = []
    if limited:
        store.queue("ranked", limit=1)

    @store.job(name="ranked.run", queue="ranked")
    def run(label: str) -> None:
        order.append(label)

    plan = [("low-1", 0), ("mid-1", 5), ("high", 10), ("low-2", 0), ("mid-2", 5), ("neg", -3)]
    store.enqueue_many([run.bind(label=label, priority=p) for label, p in plan])
    with workers([store], concurrency=1):
        wait_until(lambda: len(order) == len(plan), 20, "every job to run")
    assert order == ["high", "mid-1", "mid-2", "low-1", "low-2", "neg"]


def test_delayed_jobs_start_within_one_poll_interval_of_their_time_and_never_before(
    store: errands.App,
) -> None:
    """Given an idle worker polling every 0.5 s (no leader duties, so no other commits
    wake it), then each delayed job starts at or after its run_at and at most one poll
    interval (plus a generous 0.5 s for the claim itself) later."""

    @store.job(name="delayed.tick", retries=0)
    def tick(n: int) -> None: ...

    with workers([store], poll_interval=POLL, maintenance=False):
        handles = [tick.enqueue(n=i, delay=0.6 + 0.35 * i) for i in range(6)]
        for handle in handles:
            handle.result(timeout=20)
    lateness = []
    for handle in handles:
        job = handle.job()
        assert job.attempted_at is not None
        lateness.append(job.attempted_at.timestamp() - job.run_at.timestamp())
    assert min(lateness) >= 0, f"a delayed job started early: {lateness}"
    assert max(lateness) <= POLL + 0.5, f"started late by {max(lateness):.3f} s"
