"""Keyed enqueues that meet on the same keys, on real PostgreSQL locks.

A keyed row takes its key's lock in the unique index as it goes in, held to the end of
its transaction (and waited for while another transaction holds the key uncommitted). A
batch took its keys in the order it was given: two batches with overlapping keys in
opposite orders each held half and waited for the other's, and one got a raw
``DeadlockDetected`` (13 of 60 such batches in a review). Keyed rows now go in in the
unique index's order (name, key), so batches never wait on each other in a cycle; and a
transaction of errands' own that the server still aborts to break a cycle (one a caller's
transaction closed) runs again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from urllib.parse import quote

import psycopg
import pytest

import errands
from errands.backends.postgres.config import parse_postgres_url
from tests.pg import in_thread

ROUNDS = 20
KEYS = 300
CYCLE_BROKEN = "broke a lock cycle"


@pytest.fixture
def app(pg_url: str) -> Iterator[errands.App]:
    app = errands.App(pg_url)
    try:
        yield app
    finally:
        app.close()


def _wait_until_blocked(app: errands.App, what: str) -> None:
    """Until one of the app's statements waits for a lock (another transaction's key)."""
    schema = app.backend.schema  # type: ignore[attr-defined]
    conninfo = parse_postgres_url(app.url).conninfo
    deadline = time.monotonic() + 60
    with psycopg.connect(conninfo, autocommit=True) as watcher:
        while time.monotonic() < deadline:
            (waiting,) = watcher.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND pid <> pg_backend_pid() AND query LIKE %s",
                (f"%{schema}%errands_jobs%",),
            ).fetchone() or (0,)
            if waiting:
                return
            time.sleep(0.02)
    raise AssertionError(f"{what} never waited for the key held by the other transaction")


def test_two_keyed_batches_with_the_same_keys_in_opposite_orders_store_each_key_once(
    app: errands.App, caplog: pytest.LogCaptureFixture
) -> None:
    @app.job(name="keys.both_ways")
    def job(n: int) -> None: ...

    barrier = threading.Barrier(2)
    errors: list[BaseException] = []
    handles: dict[int, dict[str, int]] = {0: {}, 1: {}}

    def enqueue(side: int) -> None:
        for round_ in range(ROUNDS):
            keys = [f"{round_}:{k}" for k in range(KEYS)]
            if side:
                keys.reverse()
            barrier.wait(60)
            try:
                got = app.enqueue_many([job.bind(n=side, key=key) for key in keys])
            except BaseException as exc:  # handed to the test
                errors.append(exc)
                continue
            handles[side].update({key: h.id for key, h in zip(keys, got, strict=True)})

    caplog.set_level(logging.INFO, logger="errands.postgres")
    threads = [threading.Thread(target=enqueue, args=(side,)) for side in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    assert not any(t.is_alive() for t in threads), "a batch is still blocked"
    assert errors == []  # not DeadlockDetected
    assert handles[0] == handles[1]  # each side got the job holding each key
    stored = app.jobs(name="keys.both_ways", limit=ROUNDS * KEYS * 2)
    assert len(stored) == ROUNDS * KEYS
    assert sorted(j.idempotency_key or "" for j in stored) == sorted(handles[0])
    assert not [r for r in caplog.records if CYCLE_BROKEN in r.getMessage()]


def test_a_keyed_batch_takes_its_keys_in_key_order_whatever_order_it_is_given(
    app: errands.App, caplog: pytest.LogCaptureFixture
) -> None:
    """A caller's transaction holds key "a"; a batch given ["b", "a"] waits for "a"
    without holding "b" (it takes "a" first), so the caller can go on to take "b": no
    lock cycle for the server to break. Taking "b" first, the batch held it while it
    waited for "a", and the caller's enqueue of "b" closed the cycle."""

    @app.job(name="keys.ordered")
    def job(n: int) -> None: ...

    caplog.set_level(logging.INFO, logger="errands.postgres")
    with psycopg.connect(parse_postgres_url(app.url).conninfo) as caller:
        held_a = job.enqueue(n=1, key="a", conn=caller)
        thread, batch = in_thread(
            lambda: app.enqueue_many([job.bind(n=2, key="b"), job.bind(n=2, key="a")])
        )
        _wait_until_blocked(app, "the batch")
        held_b = job.enqueue(n=1, key="b", conn=caller)  # raised DeadlockDetected
        caller.commit()
    thread.join(120)
    assert not thread.is_alive()
    assert "error" not in batch, batch
    b, a = batch["result"]
    assert (b.id, a.id) == (held_b.id, held_a.id) and b.deduplicated and a.deduplicated
    assert not [r for r in caplog.records if CYCLE_BROKEN in r.getMessage()]


def test_a_keyed_batch_whose_transaction_the_server_aborts_to_break_a_cycle_runs_again(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A caller's transaction holds key "b"; errands' batch of ["a", "b"] takes "a" and
    waits for "b"; the caller then enqueues "a" and waits for the batch: a cycle. The
    server aborts the batch's transaction (its deadlock check comes first: the caller's
    session checks only after 10 minutes), and the batch runs again, waits for the
    caller's commit, and returns the caller's jobs. It raised DeadlockDetected."""
    # the batch's session looks for a cycle 3 s into a wait: by then the caller waits too
    app = errands.App(pg_url + "&options=" + quote("-cdeadlock_timeout=3s"))
    try:

        @app.job(name="keys.again")
        def job(n: int) -> None: ...

        caplog.set_level(logging.INFO, logger="errands.postgres")
        with psycopg.connect(parse_postgres_url(app.url).conninfo) as caller:
            caller.execute("SET deadlock_timeout = '10min'")
            held_b = job.enqueue(n=1, key="b", conn=caller)
            thread, batch = in_thread(
                lambda: app.enqueue_many([job.bind(n=2, key="a"), job.bind(n=2, key="b")])
            )
            _wait_until_blocked(app, "the batch")
            held_a = job.enqueue(n=1, key="a", conn=caller)  # waits until the batch is aborted
            caller.commit()
        thread.join(120)
        assert not thread.is_alive()
        assert "error" not in batch, batch  # not DeadlockDetected
        a, b = batch["result"]
        assert (a.id, b.id) == (held_a.id, held_b.id) and a.deduplicated and b.deduplicated
        assert len([r for r in caplog.records if CYCLE_BROKEN in r.getMessage()]) == 1
        assert len(app.jobs(name="keys.again")) == 2
    finally:
        app.close()
