"""Limits are enforced from the job row: whatever queue the job is in, whichever worker
declared what (issue 16, A5).

A job's concurrency key and limit, and its job type's rate, travel on its row. A worker
claims such rows only through the limited path, which counts them across every queue
and holds a lock per key and per rate bucket while it does. So a keyed job enqueued into
another queue (``queue=``), two job types of different queues sharing a key, and a
cluster where another worker's code declares the job without its limits (or an older
worker clears the queue's flag) all keep the limit. Each test runs on both backends with
several workers, each its own App (its own connections).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import closing
from typing import Any

import pytest

import errands

from .helpers import Intervals, is_postgres, most_in_window, wait_until, workers

SLOW = 0.05


def _completed(app: errands.App, n: int) -> Callable[[], bool]:
    return lambda: len(app.jobs(state="completed", limit=n + 1)) == n


def _peer(app: errands.App) -> errands.App:
    return errands.App(app.url, lease=2)


def _raw(app: errands.App, sql: str) -> None:
    """Run one statement on the store through a connection of the test's own."""
    if is_postgres(app):
        import psycopg

        backend: Any = app.backend
        with psycopg.connect(backend.config.conninfo, autocommit=True) as conn:
            conn.execute(sql.replace("errands_", f'"{backend.schema}".errands_', 1))
        return
    import sqlite3

    with closing(sqlite3.connect(app.backend.path, timeout=30)) as conn, conn:  # type: ignore[attr-defined]
        conn.execute(sql)


def test_a_keyed_job_enqueued_into_another_queue_keeps_its_key_limit(store: errands.App) -> None:
    """Given a job type of queue 'default' with a per-key limit of 1, when six of its jobs
    for one account are enqueued into queue 'other' (which no code declares limited) and
    two workers serve 'other', then no two of them ever run at once."""
    runs = Intervals()

    def sync(account_id: int, n: int) -> None:
        with runs.run(f"account:{account_id}"):
            time.sleep(SLOW)

    keyed = {"concurrency_key": "account:{account_id}", "concurrency_limit": 1}
    job = store.job(name="rows.sync", **keyed)(sync)
    store.enqueue_many([job.bind(account_id=7, n=i, queue="other") for i in range(6)])
    peer = _peer(store)
    peer.job(name="rows.sync", **keyed)(sync)
    try:
        with workers([store, peer], queues="other", concurrency=4):
            wait_until(_completed(store, 6), 60, "6 completed jobs")
    finally:
        peer.close()
    assert runs.peak("account:7") == 1
    assert {j.queue for j in store.jobs(limit=10)} == {"other"}


def test_a_rate_limited_job_enqueued_into_another_queue_keeps_its_rate(
    store: errands.App,
) -> None:
    """Given a job type with rate '2/s', when six of its jobs are enqueued into another
    queue and served there by two workers, then no second holds more than two claims."""
    starts: list[float] = []

    def ping(n: int) -> None:
        starts.append(time.monotonic())

    job = store.job(name="rows.ping", rate="2/s")(ping)
    store.enqueue_many([job.bind(n=i, queue="elsewhere") for i in range(6)])
    peer = _peer(store)
    peer.job(name="rows.ping", rate="2/s")(ping)
    try:
        with workers([store, peer], queues="elsewhere", concurrency=4):
            wait_until(_completed(store, 6), 60, "6 completed jobs")
    finally:
        peer.close()
    assert len(starts) == 6
    # The rate paces claims, so the claims' times in the store are measured (a handler's
    # own start can lag its claim on a busy machine and bunch up with the next one's).
    claimed = [j.attempted_at.timestamp() for j in store.jobs(name="rows.ping") if j.attempted_at]
    assert len(claimed) == 6
    assert most_in_window(claimed, 1.0) <= 2, sorted(t - min(claimed) for t in claimed)


def test_job_types_of_different_queues_sharing_a_key_never_run_together(
    store: errands.App,
) -> None:
    """Given two job types in queues 'qa' and 'qb' whose concurrency key is the same
    ('account:{account_id}', limit 1), when both are enqueued for one account and two
    workers serve both queues at once, then no two jobs of that account ever overlap:
    the key is counted across queues, under one lock per key."""
    runs = Intervals()

    def make(name: str, queue: str) -> Callable[[errands.App], Any]:
        def handler(account_id: int, n: int) -> None:
            with runs.run(f"account:{account_id}"):
                time.sleep(SLOW)

        def register(app: errands.App) -> Any:
            return app.job(
                name=name, queue=queue, concurrency_key="account:{account_id}", concurrency_limit=1
            )(handler)

        return register

    register_a, register_b = make("rows.a", "qa"), make("rows.b", "qb")
    a, b = register_a(store), register_b(store)
    store.enqueue_many(
        [a.bind(account_id=1, n=i) for i in range(8)]
        + [b.bind(account_id=1, n=i) for i in range(8)]
    )
    peers = [_peer(store) for _ in range(2)]
    for peer in peers:
        register_a(peer)
        register_b(peer)
    try:
        with workers([store, *peers], queues="qa,qb", concurrency=4):
            wait_until(_completed(store, 16), 60, "16 completed jobs")
    finally:
        for peer in peers:
            peer.close()
    assert runs.peak("account:1") == 1


def test_a_worker_whose_code_lacks_the_limit_still_holds_the_rows_to_it(
    store: errands.App,
) -> None:
    """Given keyed jobs enqueued by code that declares the key limit, when the only
    workers run code that declares the same job type without any limit (an older or a
    newer deploy) and the queue's 'has keys' flag has been cleared (as an older worker's
    start-up did), then the limit still holds: it is read from the rows."""
    runs = Intervals()

    def sync(account_id: int, n: int) -> None:
        with runs.run(f"account:{account_id}"):
            time.sleep(SLOW)

    job = store.job(name="rows.mixed", concurrency_key="account:{account_id}")(sync)
    store.enqueue_many([job.bind(account_id=3, n=i) for i in range(6)])
    _raw(store, "UPDATE errands_queues SET has_keys = false")
    unaware = [_peer(store) for _ in range(2)]
    for peer in unaware:
        peer.job(name="rows.mixed")(sync)  # no concurrency_key in this code
    try:
        with workers(unaware, concurrency=4):
            wait_until(_completed(store, 6), 60, "6 completed jobs")
    finally:
        for peer in unaware:
            peer.close()
    assert runs.peak("account:3") == 1


def test_the_plain_claim_never_takes_a_row_that_carries_a_limit(store: errands.App) -> None:
    """The claim for plain queues leaves keyed and rate-limited rows alone, so a worker
    that has not yet learned a queue holds such rows cannot claim them around their
    limits; the limited claim takes them."""
    from errands.backends.base import ClaimParams, QueueClaim

    keyed = store.job(name="rows.k", concurrency_key="k:{n}")(lambda n: None)
    rated = store.job(name="rows.r", rate="5/s")(lambda n: None)
    plain = store.job(name="rows.p")(lambda n: None)
    store.enqueue_many([keyed.bind(n=1), rated.bind(n=2), plain.bind(n=3)])
    backend = store.backend
    rows = backend.job_claim(ClaimParams([QueueClaim("default", 10)], 10, "w-test", 30.0))
    assert [r.name for r in rows] == ["rows.p"]
    assert backend.queues_with_limits(["default", "nothing-here"]) == {"default"}
    limited = backend.job_claim_limited(QueueClaim("default", 10), "w-test", 30.0)
    assert sorted(r.name for r in limited) == ["rows.k", "rows.r"]


def test_a_failed_read_of_the_limited_queues_is_tried_again_at_the_next_round(
    store: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker reads which queues are limited (by any deployment) at start and every
    poll interval; a read that failed was not tried again for a poll interval, and
    meanwhile such a queue was claimed plainly, past its max_running or its rate."""
    from errands.worker.claiming import Claimer

    claimer = Claimer(store, "w-test", ["reports"], poll_interval=3600.0)

    answers: list[object] = [ConnectionError("server closed the connection")]

    def flaky(queues: Any) -> Any:
        if answers:
            raise answers.pop()  # type: ignore[misc]
        return {"reports"}

    monkeypatch.setattr(store.backend, "queues_with_limits", flaky)
    claimer.refresh(force=True)
    assert "reports" not in claimer.with_limits
    claimer.refresh()  # the next round, well within the hour's poll interval
    assert "reports" in claimer.with_limits
