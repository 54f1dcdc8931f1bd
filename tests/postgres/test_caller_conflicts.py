"""An enqueue on the caller's connection that PostgreSQL aborts for a conflict with
another transaction says what became of the caller's transaction and what to do.

On errands' own transaction such an abort is simply run again; on the caller's, errands
cannot run the caller's other work again, so it raises :class:`DatabaseBusy`, which is
also an instance of the driver's error class (a retry loop on it goes on working). The
driver's raw ``DeadlockDetected``, ``SerializationFailure`` or ``LockNotAvailable`` came
through before, saying neither whether anything was stored nor what to run again.
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
from tests.pg import in_thread

NOT_SEEN = r"committed after yours began"
DEADLOCK = r"deadlock with another transaction"
LOCK_TIMEOUT = r"another transaction holds a job key.*lock_timeout ran out"


@pytest.fixture
def app(pg_url: str) -> Iterator[errands.App]:
    app = errands.App(pg_url)
    try:
        yield app
    finally:
        app.close()


def _conninfo(app: errands.App) -> str:
    return parse_postgres_url(app.url).conninfo


STARTED: list[threading.Thread] = []  # joined before a test closes their connections


def _in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    thread, outcome = in_thread(call)
    STARTED.append(thread)
    return thread, outcome


def _close(*conns: psycopg.Connection[Any]) -> None:
    """Close ``conns`` in order, the first before the test's threads end (they may wait
    for its locks), the others after (closing one a thread still uses crashed psycopg)."""
    conns[0].close()
    while STARTED:
        STARTED.pop().join(60)
    for conn in conns[1:]:
        conn.close()


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
        assert isinstance(raised.value, psycopg.errors.SerializationFailure)  # as well
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
        assert isinstance(raised.value, psycopg.errors.DeadlockDetected)  # as well
        a.rollback()  # B goes on
        thread.join(60)
        assert not thread.is_alive() and "error" not in b_takes_a, b_takes_a
        b.commit()
    finally:
        _close(a, b)
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
        _close(a, b)
    stored = app.jobs(name="dl.autocommit")
    assert sorted((j.idempotency_key, j.args["n"]) for j in stored) == [("a", 2), ("b", 2)]


def test_a_serializable_transactions_retry_loop_on_serialization_failure_still_runs_it_again(
    app: errands.App,
) -> None:
    """A SERIALIZABLE transaction needs a loop that runs it again on SQLSTATE 40001; one
    catching psycopg's SerializationFailure still catches the DatabaseBusy (it is both),
    and the transaction run again returns the job holding the key."""

    @app.job(name="rr.loop")
    def job(n: int) -> None: ...

    errors: list[BaseException] = []
    with psycopg.connect(_conninfo(app)) as caller:
        caller.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
        for attempt in range(3):
            try:
                caller.execute("SELECT 1")  # the snapshot
                if attempt == 0:
                    job.enqueue(n=1, key="loop")  # committed after it
                handle = job.enqueue(n=2, key="loop", conn=caller)
                caller.commit()
                break
            except psycopg.errors.SerializationFailure as exc:
                errors.append(exc)
                caller.rollback()
    assert len(errors) == 1 and isinstance(errors[0], DatabaseBusy)
    assert errors[0].sqlstate == "40001"  # type: ignore[attr-defined]
    assert handle.deduplicated and len(app.jobs(name="rr.loop")) == 1


def test_a_keyed_enqueue_past_its_connections_lock_timeout_leaves_the_transaction_usable(
    app: errands.App,
) -> None:
    """Another transaction holds the key uncommitted: the enqueue waits for it, here no
    longer than the caller's lock_timeout. DatabaseBusy (a LockNotAvailable too) says
    so; nothing of the enqueue is stored and the caller's transaction goes on."""

    @app.job(name="lock.timeout")
    def job(n: int) -> None: ...

    with (
        psycopg.connect(_conninfo(app)) as holder,
        psycopg.connect(_conninfo(app)) as caller,
    ):
        job.enqueue(n=1, key="held", conn=holder)
        caller.execute("SET lock_timeout = '200ms'")
        for call in (
            lambda: job.enqueue(n=2, key="held", conn=caller),
            lambda: app.enqueue_many([job.bind(n=3), job.bind(n=4, key="held")], conn=caller),
        ):
            with pytest.raises(DatabaseBusy, match=LOCK_TIMEOUT) as raised:
                call()
            assert isinstance(raised.value, psycopg.errors.LockNotAvailable)
            assert "still open and usable" in str(raised.value)
        job.enqueue(n=5, conn=caller)  # the transaction goes on
        caller.commit()
        holder.rollback()
    assert [j.args for j in app.jobs(name="lock.timeout")] == [{"n": 5}]
