"""Shared by the PostgreSQL acceptance apps: an append-only ``effects`` table.

Handlers call :func:`record` first thing: one row per execution, written in its own
autocommit transaction to the same PostgreSQL database as the jobs (in the test's
schema, in a table errands knows nothing about), so the test counts how many times each
job's handler really ran (RELIABILITY I3/I4) independently of what errands stored.

The writes use their own small pool with their own ``application_name``, so a test that
terminates errands' connections (``pg_terminate_backend``) leaves them alone. A write that
fails (the server restarting) raises: that attempt fails like any handler error and is
recorded on the job, and the test does not count its row as an unexplained duplicate.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

import errands
from errands.backends.postgres.config import parse_postgres_url
from errands.backends.postgres.connections import RECONNECT_WINDOW, _pool_class

EFFECTS_APPLICATION_NAME = "errands_pgacc_effects"

SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS {schema}.effects (
    id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id  bigint      NOT NULL,
    attempt integer     NOT NULL,
    pid     integer     NOT NULL,
    worker  text        NOT NULL,
    at      timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""

_lock = threading.Lock()
_pool: ConnectionPool[Any] | None = None
_table = ""


def create(url: str) -> None:
    """Create the effects table in the URL's schema (the test does, before any worker)."""
    config = parse_postgres_url(url)
    with psycopg.connect(config.conninfo, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{config.schema}"')
        conn.execute(SCHEMA_SQL.format(schema=f'"{config.schema}"'))


def _effects_pool() -> tuple[ConnectionPool[Any], str]:
    global _pool, _table
    with _lock:
        if _pool is None:
            config = parse_postgres_url(os.environ["ERRANDS_URL"])
            _table = f'"{config.schema}".effects'
            # errands' own pool class: lost connections are opened again at errands'
            # pace (psycopg_pool's own backoff doubles to a minute: after a crash restart
            # on a loaded machine the effects pool took longer to come back than the
            # workers, every handler waited 30 s for it, and the run timed out)
            _pool = _pool_class()(
                config.conninfo,
                min_size=1,
                max_size=4,
                kwargs={"autocommit": True, "application_name": EFFECTS_APPLICATION_NAME},
                open=True,
                name="effects",
                timeout=30.0,
                reconnect_timeout=RECONNECT_WINDOW,
            )
        return _pool, _table


def record(ctx: errands.Context) -> None:
    """Append one effect row for this execution (raises when the database is away).

    Shielded: a self-fence's interrupt (the database away past a lease) landing while
    psycopg_pool's ``getconn()`` waited lost the connection handed to it later; after a
    restart on a loaded machine the pool had none left, and a worker ran nothing more."""
    pool, table = _effects_pool()
    with errands.shielded(), pool.connection() as conn:
        conn.execute(
            f"INSERT INTO {table} (job_id, attempt, pid, worker) VALUES (%s, %s, %s, %s)",
            (ctx.job_id, ctx.attempt, os.getpid(), ctx.worker_id),
        )
