"""Idempotency keys, enqueue in the caller's transaction, enqueue_many (DESIGN §1, §3, I2, I8)."""

import sqlite3
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing

import pytest

import errands
from errands import JobState

from .helpers import connect, count_jobs, execute_sql, query


def test_concurrent_enqueues_of_one_key_create_one_job_and_every_caller_gets_its_id(
    app: errands.App, worker_factory
) -> None:
    callers = 16
    runs: list[int] = []

    @app.job(name="enqueue.welcome")
    def welcome(user_id: int) -> int:
        runs.append(user_id)
        return user_id

    app.migrate()  # the schema exists before the race starts
    barrier = threading.Barrier(callers)

    def enqueue(_: int) -> errands.JobHandle:
        barrier.wait(timeout=10)
        return welcome.enqueue(user_id=42, key="welcome:42")

    with ThreadPoolExecutor(max_workers=callers) as pool:
        handles = list(pool.map(enqueue, range(callers)))

    assert len({h.id for h in handles}) == 1
    assert count_jobs(app) == 1
    assert sorted(h.deduplicated for h in handles) == [False] + [True] * (callers - 1)

    with worker_factory():
        assert handles[0].result(timeout=10) == 42
    assert runs == [42]
    assert welcome.enqueue(user_id=42, key="welcome:42").deduplicated  # while the row exists


def test_enqueue_on_the_callers_connection_rolls_back_with_the_callers_transaction(
    app: errands.App,
) -> None:
    @app.job(name="enqueue.receipt")
    def receipt(order_id: int) -> None:
        raise AssertionError("a rolled-back job must never run")

    with closing(connect(app)) as conn:
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
        conn.execute("INSERT INTO orders (id) VALUES (1)")  # opens the caller's transaction
        assert conn.in_transaction
        handle = receipt.enqueue(order_id=1, conn=conn)
        assert handle.id >= 1
        conn.rollback()

    assert count_jobs(app) == 0
    assert query(app, "SELECT count(*) FROM orders") == [(0,)]


def test_enqueue_on_the_callers_connection_commits_with_the_callers_transaction_and_runs(
    app: errands.App, worker_factory
) -> None:
    @app.job(name="enqueue.receipt")
    def receipt(order_id: int) -> str:
        return f"receipt for {order_id}"

    with closing(connect(app)) as conn:
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
        conn.execute("INSERT INTO orders (id) VALUES (7)")
        handle = receipt.enqueue(order_id=7, conn=conn)
        # not visible to anyone else before the caller commits
        assert count_jobs(app) == 0
        conn.commit()

    assert count_jobs(app) == 1
    assert query(app, "SELECT id FROM orders") == [(7,)]
    with worker_factory():
        assert handle.result(timeout=10) == "receipt for 7"


def test_enqueue_many_with_an_invalid_bind_fails_at_bind_time_and_writes_nothing(
    app: errands.App,
) -> None:
    @app.job(name="enqueue.notify")
    def notify(user_id: int) -> None:
        pass

    with pytest.raises(errands.InvalidPayload, match="user_id"):
        app.enqueue_many([notify.bind(user_id=1), notify.bind(user_id="two"), notify.bind(3)])
    assert count_jobs(app) == 0


def test_enqueue_many_is_one_transaction(app: errands.App, worker_factory) -> None:
    @app.job(name="enqueue.notify")
    def notify(user_id: int) -> int:
        return user_id

    # make the store refuse the third row of the batch (test-only trigger)
    execute_sql(
        app,
        "CREATE TRIGGER refuse_third BEFORE INSERT ON errands_jobs "
        """WHEN NEW.args = '{"user_id":3}' BEGIN SELECT RAISE(ABORT, 'refused'); END""",
    )
    with pytest.raises(sqlite3.IntegrityError, match="refused"):
        app.enqueue_many([notify.bind(user_id=i) for i in (1, 2, 3, 4)])
    assert count_jobs(app) == 0  # rows 1 and 2 were rolled back with the failing one

    execute_sql(app, "DROP TRIGGER refuse_third")
    handles = app.enqueue_many([notify.bind(user_id=i) for i in (1, 2, 3, 4)])
    assert count_jobs(app) == 4
    with worker_factory():
        assert [h.result(timeout=10) for h in handles] == [1, 2, 3, 4]
    assert {h.status() for h in handles} == {JobState.COMPLETED}


def test_enqueue_many_on_the_callers_connection_rolls_back_as_a_whole(app: errands.App) -> None:
    @app.job(name="enqueue.notify")
    def notify(user_id: int) -> None:
        pass

    with closing(connect(app)) as conn:
        conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY)")
        conn.execute("INSERT INTO users (id) VALUES (1), (2)")
        handles = app.enqueue_many([notify.bind(user_id=1), notify.bind(user_id=2)], conn=conn)
        assert len(handles) == 2
        conn.rollback()

    assert count_jobs(app) == 0
