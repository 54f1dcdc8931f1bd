"""SQL on the effects tables, for the test process and the worker processes alike.

One small wrapper over a SQLite file or a PostgreSQL schema (named by an errands URL), so
the same handler and the same checks run on both backends. SQL is written with ``%s``
placeholders; SQLite gets them as ``?``. Each thread has its own connection.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any

from errands.backends.sqlite.backend import parse_sqlite_url

PAYMENT_TABLES = (
    # The provider's charges: at most one per idempotency key (what real providers promise).
    """CREATE TABLE IF NOT EXISTS charges (
        id {serial}, order_id INTEGER NOT NULL, idempotency_key TEXT NOT NULL UNIQUE,
        amount INTEGER NOT NULL)""",
    # Every call that reached the provider, with the attempt that made it.
    """CREATE TABLE IF NOT EXISTS psp_calls (
        id {serial}, order_id INTEGER NOT NULL, idempotency_key TEXT NOT NULL,
        attempt INTEGER NOT NULL, pid INTEGER NOT NULL)""",
)
TX_TABLES = (
    """CREATE TABLE IF NOT EXISTS tx_effects (
        id {serial}, job_id INTEGER NOT NULL, n INTEGER NOT NULL, attempt INTEGER NOT NULL)""",
)

WORKFLOW_TABLES = (
    # Every run of a workflow member, with the parents it found not completed (must be none).
    """CREATE TABLE IF NOT EXISTS wf_runs (
        id {serial}, job_id INTEGER NOT NULL, workflow_id INTEGER NOT NULL,
        early TEXT NOT NULL)""",
    # Every run of a callback, with the members it found pending (must be 0).
    """CREATE TABLE IF NOT EXISTS wf_callbacks (
        id {serial}, job_id INTEGER NOT NULL, workflow_id INTEGER NOT NULL,
        event TEXT NOT NULL, pending INTEGER NOT NULL)""",
)


class EffectsStore:
    def __init__(self, url: str) -> None:
        self.url = url
        self.sqlite = self.is_sqlite(url)
        self._local = threading.local()
        self._all: list[Any] = []  # every thread's connection, closed by close()
        self._all_lock = threading.Lock()
        if self.sqlite:
            self.path, _ = parse_sqlite_url(url)
        else:
            from errands.backends.postgres.config import parse_postgres_url

            config = parse_postgres_url(url)
            self.conninfo, self.schema = config.conninfo, config.schema

    @staticmethod
    def is_sqlite(url: str) -> bool:
        return url.startswith("sqlite:")

    @staticmethod
    def qualified(url: str, table: str) -> str:
        if EffectsStore.is_sqlite(url):
            return table
        from errands.backends.postgres.config import parse_postgres_url

        return f'"{parse_postgres_url(url).schema}".{table}'

    # -- connections ---------------------------------------------------------------------
    def _conn(self) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self.sqlite:
                conn = sqlite3.connect(self.path, timeout=60, isolation_level=None)
                conn.execute("PRAGMA busy_timeout = 60000")
                conn.execute("PRAGMA journal_mode = WAL")
            else:
                import psycopg

                conn = psycopg.connect(
                    self.conninfo, autocommit=True, options=f"-c search_path={self.schema}"
                )
            self._local.conn = conn
            with self._all_lock:
                self._all.append(conn)
        return conn

    def _forget(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            with self._all_lock:
                if conn in self._all:
                    self._all.remove(conn)
            with suppress(Exception):
                conn.close()

    def _sql(self, sql: str) -> str:
        return sql.replace("%s", "?") if self.sqlite else sql

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """One statement in autocommit mode (a read takes no write lock)."""
        try:
            return _Tx(self, self._conn()).execute(sql, params)
        except Exception as exc:
            if not self.sqlite and type(exc).__module__.startswith("psycopg"):
                self._forget()
            raise

    @contextmanager
    def transaction(self) -> Iterator[_Tx]:
        conn = self._conn()
        try:
            if self.sqlite:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    yield _Tx(self, conn)
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            else:
                with conn.transaction():
                    yield _Tx(self, conn)
        except Exception as exc:
            if not self.sqlite and type(exc).__module__.startswith("psycopg"):
                self._forget()  # e.g. the server restarted: reconnect next time
            raise

    def create(self, statements: Sequence[str]) -> None:
        serial = "INTEGER PRIMARY KEY AUTOINCREMENT" if self.sqlite else "BIGSERIAL PRIMARY KEY"
        for statement in statements:
            self.execute(statement.format(serial=serial))

    def close(self) -> None:
        """Close every thread's connection (the handler threads' too)."""
        with self._all_lock:
            conns, self._all = self._all, []
        self._local = threading.local()
        for conn in conns:
            with suppress(Exception):
                conn.close()


class _Tx:
    def __init__(self, store: EffectsStore, conn: Any) -> None:
        self.store = store
        self.conn = conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        cur = self.conn.execute(self.store._sql(sql), tuple(params))
        if cur.description is None:
            return []
        return [tuple(r) for r in cur.fetchall()]
