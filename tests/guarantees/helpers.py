"""Test-only operations on either backend: expire a lease, claim as a worker that dies,
rescue, run raw SQL. Tests wait on conditions (``wait_until``), never on fixed sleeps."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from typing import Any

import errands
from errands.backends.base import ClaimParams, QueueClaim
from errands.jobs import JobRow
from errands.maintenance.service import Maintenance
from tests.integration.helpers import wait_until


def is_postgres(app: errands.App) -> bool:
    return app.url.startswith("postgres")


def adapt(app: errands.App, sql: str) -> str:
    """``sql`` for the store's own driver: on PostgreSQL, ``errands_`` table names are
    qualified with the schema and ``?`` placeholders become ``%s``."""
    if not is_postgres(app):
        return sql
    schema = app.backend.schema  # type: ignore[attr-defined]
    return sql.replace("errands_", f'"{schema}".errands_').replace("?", "%s")


def _run(app: errands.App, sql: str, params: tuple[Any, ...], fetch: bool) -> Any:
    """One statement on the store through the test's own connection (see :func:`adapt`)."""
    if is_postgres(app):
        import psycopg

        backend: Any = app.backend
        with psycopg.connect(backend.config.conninfo, autocommit=True) as conn:
            cursor = conn.execute(adapt(app, sql), params)
            return cursor.fetchall() if fetch else cursor.rowcount
    with closing(sqlite3.connect(app.backend.path, timeout=30)) as conn, conn:  # type: ignore[attr-defined]
        cursor = conn.execute(sql, params)
        return cursor.fetchall() if fetch else cursor.rowcount


def execute(app: errands.App, sql: str, params: tuple[Any, ...] = ()) -> int:
    return int(_run(app, sql, params, fetch=False))


def query(app: errands.App, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    return list(_run(app, sql, params, fetch=True))


def expire_lease(app: errands.App, job_id: int) -> int:
    """TEST-ONLY time warp: the running job's lease ran out a minute ago."""
    if is_postgres(app):
        return execute(
            app,
            "UPDATE errands_jobs SET lease_expires_at = now() - interval '60 seconds' "
            "WHERE id = ? AND state = 'running'",
            (job_id,),
        )
    return execute(
        app,
        "UPDATE errands_jobs SET lease_expires_at = (julianday('now') - 2440587.5) * 86400.0 "
        "- 60 WHERE id = ? AND state = 'running'",
        (job_id,),
    )


def claim_as_dead_worker(app: errands.App, queue: str = "default", n: int = 10) -> list[JobRow]:
    """Claim up to ``n`` jobs as a worker that then dies (never heartbeats, never ends)."""
    return app.backend.job_claim(ClaimParams([QueueClaim(queue, n)], n, "dead-worker", 30.0))


def force_rescue(app: errands.App, job_id: int, timeout: float = 20.0) -> None:
    """Take a running job's lease away and rescue it (repeating while a live heartbeat
    renews the lease between the two steps), as the leader does after a lost worker."""
    rescuer = Maintenance(app, "test-rescuer")
    before = app.get_job(job_id).rescues

    def rescued() -> bool:
        expire_lease(app, job_id)
        rescuer.rescue()
        return app.get_job(job_id).rescues > before

    wait_until(rescued, timeout=timeout, what=f"the rescue of job {job_id}")
