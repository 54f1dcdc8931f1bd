"""Shared by the acceptance apps: an append-only ``effects`` table, one row per execution.

Handlers call :func:`record` first thing, so the test can count how many times each job's
handler really ran (RELIABILITY I3/I4) independently of what errands itself stored. The
table lives in its own SQLite file (``ERRANDS_TEST_EFFECTS``), written with
``BEGIN IMMEDIATE`` and a long busy timeout so a busy file never fails a handler.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time

import errands

EFFECTS_ENV = "ERRANDS_TEST_EFFECTS"

SCHEMA = """
CREATE TABLE IF NOT EXISTS effects (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id  INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    pid     INTEGER NOT NULL,
    worker  TEXT    NOT NULL,
    kind    TEXT    NOT NULL,
    at      REAL    NOT NULL
)
"""

_local = threading.local()


def connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=60, isolation_level=None)
    conn.execute("PRAGMA busy_timeout = 60000")
    return conn


def create(path: str) -> None:
    """Create the effects file (WAL, like the job store) before any worker starts."""
    conn = connect(path)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute(SCHEMA)
    finally:
        conn.close()


def _conn() -> sqlite3.Connection:
    conn: sqlite3.Connection | None = getattr(_local, "conn", None)
    if conn is None:
        conn = _local.conn = connect(os.environ[EFFECTS_ENV])
    return conn


def record(ctx: errands.Context, kind: str = "run") -> int:
    """Append one effect row for this execution; returns the job's earlier executions."""
    conn = _conn()
    conn.execute("BEGIN IMMEDIATE")
    try:
        (before,) = conn.execute(
            "SELECT count(*) FROM effects WHERE job_id = ? AND kind = ?", (ctx.job_id, kind)
        ).fetchone()
        conn.execute(
            "INSERT INTO effects (job_id, attempt, pid, worker, kind, at) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (ctx.job_id, ctx.attempt, os.getpid(), ctx.worker_id, kind, time.time()),
        )
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return int(before)


def runs(kind: str = "run") -> int:
    """How many effect rows of ``kind`` have been recorded, every job's."""
    (count,) = _conn().execute("SELECT count(*) FROM effects WHERE kind = ?", (kind,)).fetchone()
    return int(count)
