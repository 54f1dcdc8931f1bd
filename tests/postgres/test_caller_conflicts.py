"""An enqueue on the caller's connection that PostgreSQL aborts for a conflict with
another transaction says what became of the caller's transaction and what to do.

On errands' own transaction such an abort is simply run again; on the caller's, errands
cannot run the caller's other work again, so it raises :class:`DatabaseBusy`. The
driver's raw ``DeadlockDetected`` or ``SerializationFailure`` came through before,
saying neither whether anything was stored nor that the transaction must be run again.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

import errands
from errands.backends.postgres.config import parse_postgres_url
from errands.errors import DatabaseBusy

NOT_SEEN = r"committed after yours began"
DEADLOCK = r"deadlock with another transaction"


@pytest.fixture
def app(pg_url: str) -> Iterator[errands.App]:
    app = errands.App(pg_url)
    try:
        yield app
    finally:
        app.close()


def _conninfo(app: errands.App) -> str:
    return parse_postgres_url(app.url).conninfo


def _in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = call()
        except BaseException as exc:  # handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    return thread, outcome


def _wait_until_blocked(app: errands.App, pid: int) -> None:
    """Until the session ``pid`` waits for a lock."""
    deadline = time.monotonic() + 60
    with psycopg.connect(_conninfo(app), autocommit=True) as watcher:
        while time.monotonic() < deadline:
            row = watcher.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
            ).fetchone()
            if row and row[0] == "Lock":
                return
            time.sleep(0.02)
    raise AssertionError(f"session {pid} never waited for a lock")


def test_a_keyed_enqueue_in_a_repeatable_read_transaction_whose_key_was_taken_since_says_to_run_it_again(  # noqa: E501
    app: errands.App,
) -> None:
    """The key was taken by a transaction that committed after the caller's snapshot:
    the caller's transaction can neither see that job nor wait for it. DatabaseBusy says
    so; nothing of the enqueue was stored, the transaction is still open, and run again
    the enqueue returns the job holding the key."""

    @app.job(name="rr.keyed")
    def job(n: int) -> None: ...

    with psycopg.connect(_conninfo(app)) as caller:
        caller.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        caller.execute("SELECT 1")  # the snapshot
        holder = job.enqueue(n=1, key="rr")  # committed after it
        with pytest.raises(DatabaseBusy, match=NOT_SEEN) as raised:
            job.enqueue(n=2, key="rr", conn=caller)
        assert "rolled back to its savepoint" in str(raised.value)
        assert "roll it back and run it again" in str(raised.value)
        assert isinstance(raised.value.__cause__, psycopg.errors.SerializationFailure)
        assert caller.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        caller.rollback()
        again = job.enqueue(n=2, key="rr", conn=caller)
        caller.commit()
    assert (again.id, again.deduplicated) == (holder.id, True)
    assert len(app.jobs(name="rr.keyed")) == 1


def test_a_keyed_batch_in_a_serializable_async_transaction_whose_key_was_taken_since_says_to_run_it_again(  # noqa: E501
    app: errands.App,
) -> None:
    @app.job(name="rr.batch")
    def job(n: int) -> None: ...

    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(_conninfo(app)) as caller:
            await caller.set_isolation_level(psycopg.IsolationLevel.SERIALIZABLE)
            await caller.execute("SELECT 1")  # the snapshot
            await asyncio.to_thread(lambda: job.enqueue(n=1, key="s"))  # committed after
            with pytest.raises(DatabaseBusy, match=NOT_SEEN):
                await app.aenqueue_many([job.bind(n=2), job.bind(n=3, key="s")], conn=caller)
            await caller.rollback()

    asyncio.run(scenario())
    assert [j.args for j in app.jobs(name="rr.batch")] == [{"n": 1}]


def test_a_callers_transaction_aborted_to_break_a_deadlock_gets_database_busy_saying_to_run_it_again(  # noqa: E501
    app: errands.App,
) -> None:
    """Caller A holds key "a", caller B holds "b" and waits for "a"; A's enqueue of "b"
    closes the cycle and the server aborts it (A's deadlock check comes first: B's only
    after 10 minutes)."""

    @app.job(name="dl.caller")
    def job(n: int) -> None: ...

    a = psycopg.connect(_conninfo(app))
    b = psycopg.connect(_conninfo(app))
    try:
        b.execute("SET deadlock_timeout = '10min'")
        job.enqueue(n=1, key="a", conn=a)
        job.enqueue(n=2, key="b", conn=b)
        thread, b_takes_a = _in_thread(lambda: job.enqueue(n=2, key="a", conn=b))
        _wait_until_blocked(app, b.info.backend_pid)
        with pytest.raises(DatabaseBusy, match=DEADLOCK) as raised:
            job.enqueue(n=1, key="b", conn=a)
        assert "rolled back to its savepoint" in str(raised.value)
        assert "roll it back and run it again" in str(raised.value)
        assert isinstance(raised.value.__cause__, psycopg.errors.DeadlockDetected)
        a.rollback()  # B goes on
        thread.join(60)
        assert not thread.is_alive() and "error" not in b_takes_a, b_takes_a
        b.commit()
    finally:
        a.close()  # (first: B may wait for it)
        b.close()
    assert sorted(j.idempotency_key or "" for j in app.jobs(name="dl.caller")) == ["a", "b"]


def test_an_autocommit_callers_batch_aborted_to_break_a_deadlock_says_nothing_was_stored(
    app: errands.App,
) -> None:
    """On an autocommit connection the batch runs in a transaction of its own: aborted,
    nothing of it stays, and the error says to call it again."""

    @app.job(name="dl.autocommit")
    def job(n: int) -> None: ...

    a = psycopg.connect(_conninfo(app), autocommit=True)
    b = psycopg.connect(_conninfo(app))
    try:
        b.execute("SET deadlock_timeout = '10min'")
        job.enqueue(n=2, key="b", conn=b)
        batch = [job.bind(n=1), job.bind(n=1, key="a"), job.bind(n=1, key="b")]
        thread, a_batch = _in_thread(lambda: app.enqueue_many(batch, conn=a))
        _wait_until_blocked(app, a.info.backend_pid)  # holds "a", waits for "b"
        thread_b, b_takes_a = _in_thread(lambda: job.enqueue(n=2, key="a", conn=b))
        thread.join(60)
        assert not thread.is_alive()
        error = a_batch.get("error")
        assert isinstance(error, DatabaseBusy), a_batch
        assert DEADLOCK in str(error) and "nothing of it was stored" in str(error)
        assert "call it again" in str(error)
        assert a.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        thread_b.join(60)
        assert not thread_b.is_alive() and "error" not in b_takes_a, b_takes_a
        b.commit()
    finally:
        a.close()
        b.close()
    stored = app.jobs(name="dl.autocommit")
    assert sorted((j.idempotency_key, j.args["n"]) for j in stored) == [("a", 2), ("b", 2)]
