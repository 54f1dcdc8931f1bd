"""The harness's own SQL access to the store: SQLite file or PostgreSQL schema.

SQL is written once with ``{s}`` before table names (the quoted schema and a dot on
PostgreSQL, nothing on SQLite), ``%s`` placeholders and ``NOW()``; :meth:`Store.query`
fills them per dialect. Each thread has its own connection. On PostgreSQL a query that
meets a restarting server waits for it and runs again, so the chaos driver and the
checker survive the faults they inject.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
from typing import Any

from soak_tables import PG_NOW, SQLITE_NOW, ddl

EPOCH_COLUMNS = ("run_at", "inserted_at", "attempted_at", "finished_at", "lease_expires_at", "at")


class Store:
    def __init__(self, url: str) -> None:
        """``url``: the store reached directly (SQLite file, or PostgreSQL with ``schema=``)."""
        self.url = url
        self.sqlite = url.startswith("sqlite:")
        self._local = threading.local()
        self._all: list[Any] = []  # every thread's connection, closed by close()
        self._all_lock = threading.Lock()
        if self.sqlite:
            from errands.backends.sqlite.backend import parse_sqlite_url

            self.path = parse_sqlite_url(url)[0]
            self.schema = ""
            self.qualifier = ""
        else:
            from errands.backends.postgres.config import parse_postgres_url

            config = parse_postgres_url(url)
            self.conninfo = config.conninfo
            self.schema = config.schema
            self.qualifier = f'"{config.schema}".'

    # -- connections ---------------------------------------------------------------------
    def _conn(self) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self.sqlite:
                conn = sqlite3.connect(self.path, timeout=120, isolation_level=None)
                conn.execute("PRAGMA busy_timeout = 120000")
            else:
                import psycopg

                conn = psycopg.connect(
                    self.conninfo,
                    autocommit=True,
                    connect_timeout=5,
                    application_name="soak_harness",
                )
            self._local.conn = conn
            with self._all_lock:
                self._all.append(conn)
        return conn

    def forget(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            with self._all_lock:
                if conn in self._all:
                    self._all.remove(conn)
            with contextlib.suppress(Exception):
                conn.close()

    def sql(self, text: str) -> str:
        text = text.replace("{s}", self.qualifier)
        if self.sqlite:
            return text.replace("%s", "?").replace("NOW()", SQLITE_NOW)
        return text.replace("NOW()", PG_NOW)

    def epoch(self, column: str) -> str:
        """A timestamp column as epoch seconds (SQLite already stores them so)."""
        return column if self.sqlite else f"extract(epoch FROM {column})::float8"

    def query(
        self, text: str, params: tuple[Any, ...] | list[Any] = (), *, patience: float = 120.0
    ) -> list[tuple[Any, ...]]:
        sql = self.sql(text)
        deadline = time.monotonic() + patience
        while True:
            try:
                cur = self._conn().execute(sql, tuple(params))
                return [tuple(r) for r in cur.fetchall()] if cur.description else []
            except Exception as exc:
                if self.sqlite or not is_connection_error(exc) or time.monotonic() > deadline:
                    raise
                self.forget()
                time.sleep(0.2)

    def scalar(self, text: str, params: tuple[Any, ...] = ()) -> Any:
        rows = self.query(text, params)
        return rows[0][0] if rows else None

    def now(self) -> float:
        return float(self.scalar("SELECT NOW()"))

    def create_tables(self) -> None:
        if not self.sqlite:
            self.query(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"')
        for statement in ddl(self.sqlite, self.qualifier):
            self.query(statement)

    def close(self) -> None:
        self._local = threading.local()
        with self._all_lock:
            conns, self._all = self._all, []
        for conn in conns:
            with contextlib.suppress(Exception):
                conn.close()


def is_connection_error(exc: BaseException) -> bool:
    """psycopg's OperationalError family (server restarting, connection killed)."""
    return type(exc).__module__.startswith("psycopg") and any(
        c.__name__ in ("OperationalError", "InterfaceError") for c in type(exc).__mro__
    )


def as_json(value: Any) -> Any:
    """PostgreSQL returns jsonb decoded; SQLite returns the text."""
    if isinstance(value, str | bytes):
        return json.loads(value)
    return value
