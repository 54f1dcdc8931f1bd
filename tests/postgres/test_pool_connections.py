"""A pool connection handed out by the backend (``PostgresBackend._conn``) ends as
psycopg's own ``with conn:`` ends it: a transaction left open commits when the block ends
cleanly and rolls back when it raises, the connection goes back to the pool with no
transaction open, and a rollback that itself fails never hides the block's error."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import errands


@pytest.fixture
def backend(pg_url: str) -> Iterator[Any]:
    app = errands.App(pg_url)
    backend: Any = app.backend
    with backend._conn() as conn:
        conn.execute(f'CREATE TABLE "{backend.schema}".pool_probe (x int)')
    try:
        yield backend
    finally:
        app.close()


def _probes(backend: Any) -> list[int]:
    with backend._conn() as conn:
        rows = conn.execute(f'SELECT x FROM "{backend.schema}".pool_probe ORDER BY x')
        return [r[0] for r in rows.fetchall()]


def test_a_transaction_left_open_commits_when_the_block_ends_cleanly(backend: Any) -> None:
    with backend._conn() as conn:
        conn.execute("BEGIN")
        conn.execute(f'INSERT INTO "{backend.schema}".pool_probe VALUES (1)')
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert _probes(backend) == [1]


def test_a_block_that_raises_rolls_its_transaction_back_and_returns_a_clean_connection(
    backend: Any,
) -> None:
    with pytest.raises(RuntimeError, match="halfway"), backend._conn() as conn:
        conn.execute("BEGIN")
        conn.execute(f'INSERT INTO "{backend.schema}".pool_probe VALUES (2)')
        raise RuntimeError("halfway")
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert _probes(backend) == []


def test_a_failing_rollback_is_logged_and_the_blocks_own_error_is_raised(
    backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The server ended the session inside the block: the rollback fails too; the caller
    sees its own error, the rollback's is a warning, and the next call gets a live
    connection."""
    with (
        caplog.at_level(logging.WARNING, logger="errands.postgres"),
        pytest.raises(RuntimeError, match="halfway"),
        backend._conn() as conn,
    ):
        conn.execute("BEGIN")
        pid = conn.info.backend_pid
        with psycopg.connect(backend.config.conninfo, autocommit=True) as other:
            other.execute("SELECT pg_terminate_backend(%s)", (pid,))
        raise RuntimeError("halfway")
    assert "error ignored in rollback" in caplog.text
    assert _probes(backend) == []


def test_a_handlers_session_state_never_reaches_errands_writes_or_the_next_handler(
    pg_url: str,
) -> None:
    """A handler sets dict rows, a setting and a session advisory lock on its
    ctx.transaction() connection: its outcome is still written (errands read its rows by
    position: KeyError: 0 made the job retry forever), and the next job's handler, on
    the same connection (a pool of one), gets it as the pool gave it."""
    from psycopg.rows import dict_row

    from errands.testing import Tester

    sep = "&" if "?" in pg_url else "?"
    app = errands.App(f"{pg_url}{sep}tx_pool_size=1")
    seen: list[tuple[int, str, str, int]] = []

    @app.job(name="pool.tenant")
    def tenant(ctx: errands.Context, name: str) -> str:
        tx = ctx.transaction()
        pid = tx.execute("SELECT pg_backend_pid()").fetchone()
        setting = tx.execute("SHOW application_name").fetchone()
        locks = tx.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        ).fetchone()
        seen.append(  # each value read as the connection gives rows: tuples expected
            (pid[0], type(setting).__name__, setting[0], locks[0])  # type: ignore[index]
        )
        tx.row_factory = dict_row  # type: ignore[assignment]
        tx.execute(f"SET application_name = 'tenant-{name}'")
        tx.execute("SELECT pg_advisory_lock(42)")
        return name

    try:
        tester = Tester(app)
        first, second = tenant.enqueue(name="a"), tenant.enqueue(name="b")
        assert tester.drain().completed == 2
        assert (first.result(timeout=5), second.result(timeout=5)) == ("a", "b")
        (pid_a, type_a, name_a, locks_a), (pid_b, type_b, name_b, locks_b) = seen
        assert (type_a, locks_a) == ("tuple", 0)
        assert pid_a == pid_b  # the same connection served both
        assert (type_b, name_b, locks_b) == ("tuple", name_a, 0)
        assert name_b != "tenant-a"
    finally:
        app.close()


def test_a_refused_statement_is_its_own_error_even_if_the_pool_closes_the_connection_after(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool closes a connection given back past its max_lifetime (or while closing):
    a statement the server refused on it looked like a lost connection, so a certain
    failure came back as EnqueueUncertain ('may or may not have been stored')."""
    real_putconn = backend.pool.putconn

    def closing_putconn(conn: psycopg.Connection[Any]) -> None:
        conn.close()  # as psycopg_pool does with a connection past its max_lifetime
        real_putconn(conn)

    def refused(conn: psycopg.Connection[Any], progress: Any) -> None:
        progress.committing = True
        conn.execute("SELECT 1 / 0")

    monkeypatch.setattr(backend.pool, "putconn", closing_putconn)
    with pytest.raises(psycopg.errors.DivisionByZero):
        backend._again_if_lost(refused, lambda exc: RuntimeError("uncertain"))


def test_a_lock_wait_past_the_callers_deadline_is_database_busy_and_rolled_back(
    backend: Any,
) -> None:
    """Under a caller's deadline that bounds lock waits (base.calls_until), the block runs
    in a transaction whose lock_timeout is the time left: a statement waiting longer for
    a lock another session holds raises DatabaseBusy, what the block wrote is rolled
    back, and the connection goes back to the pool with no transaction open."""
    import time

    from errands.backends.base import calls_until
    from errands.errors import DatabaseBusy

    schema = backend.schema
    with psycopg.connect(backend.config.conninfo) as other:  # a transaction: holds the lock
        other.execute(f'LOCK TABLE "{schema}".pool_probe')
        with (
            calls_until(time.monotonic() + 0.3),
            pytest.raises(DatabaseBusy, match="stayed held by another session"),
            backend._conn() as conn,
        ):
            conn.execute(f'INSERT INTO "{schema}".pool_probe VALUES (4)')
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert _probes(backend) == []


def test_a_checkout_is_entered_and_left_once(backend: Any) -> None:
    """A checkout entered while it holds a connection, or left twice, is refused: entered
    again, it would have dropped the connection it held (never given back, its interrupt
    shield's mark lost); left twice, it gave one connection back to the pool twice."""
    available = backend.pool.get_stats().get("pool_available")
    checkout = backend._conn()
    with checkout as conn:
        with pytest.raises(RuntimeError):
            checkout.__enter__()
        assert conn.execute("SELECT 1").fetchone() == (1,)
    with pytest.raises(RuntimeError):
        checkout.__exit__(None, None, None)  # left again: nothing given back twice
    assert backend.pool.get_stats().get("pool_available") == available
    with backend._conn() as again:  # the pool is as it was
        assert again.execute("SELECT 2").fetchone() == (2,)
