"""Helpers for the in-process integration tests: deadlines, raw SQL, workers in threads.

Everything here waits on a *condition* with a deadline rather than sleeping a fixed time,
so the tests are fast when the machine is fast and still pass when it is slow.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any, TypeVar

import errands
from errands.backends.base import ClaimParams, QueueClaim
from errands.jobs import JobRow
from errands.maintenance.service import Maintenance
from errands.worker.worker import Worker

T = TypeVar("T")

DB_NOW = "((julianday('now') - 2440587.5) * 86400.0)"


def wait_until(
    predicate: Callable[[], T], *, timeout: float = 10.0, interval: float = 0.01, what: str = ""
) -> T:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout} s waiting for {what or predicate!r} (last: {value!r})"
            )
        time.sleep(interval)


def run_script(script: str, *args: str, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
    """``script`` (dedented) in a Python process of its own, from the repository (tests.*
    importable, this process's PYTHONPATH kept): for a test that forks (the test process
    forks nothing) or may crash or hang. Its output, as text."""
    return subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=Path(__file__).resolve().parents[2],
    )


def db_path(app: errands.App) -> str:
    """The SQLite file of ``app`` (touching the backend creates and migrates it)."""
    return app.backend.path  # type: ignore[attr-defined, no-any-return]


def connect(app: errands.App) -> sqlite3.Connection:
    """The test's own connection to the app's database file (close it: use ``closing``)."""
    return sqlite3.connect(db_path(app), timeout=10)


def execute_sql(app: errands.App, sql: str, params: tuple[Any, ...] | dict[str, Any] = ()) -> int:
    """Run one write statement on the test's own connection, commit, return the rowcount."""
    with closing(connect(app)) as conn, conn:
        rowcount = conn.execute(sql, params).rowcount
    return rowcount


def query(
    app: errands.App, sql: str, params: tuple[Any, ...] | dict[str, Any] = ()
) -> list[tuple[Any, ...]]:
    with closing(connect(app)) as conn:
        return conn.execute(sql, params).fetchall()


def count_jobs(app: errands.App) -> int:
    return int(query(app, "SELECT count(*) FROM errands_jobs")[0][0])


def time_warp(app: errands.App, job_id: int) -> None:
    """TEST-ONLY time warp: make a waiting (retryable/scheduled) job due right now.

    Instead of sleeping through a real backoff, move the job's ``run_at`` to the database's
    current time. Nothing in errands does this; it only stands in for the clock passing.
    """
    changed = execute_sql(
        app,
        f"UPDATE errands_jobs SET run_at = {DB_NOW} "
        "WHERE id = ? AND state IN ('retryable', 'scheduled')",
        (job_id,),
    )
    assert changed == 1, f"job {job_id} was not waiting, nothing to warp"


def raw_row(app: errands.App, job_id: int) -> JobRow:
    row = app.backend.job_get(job_id)
    assert row is not None, f"no job {job_id}"
    return row


def claim_as_dead_worker(
    app: errands.App, job_id: int, *, worker_id: str = "dead-worker", lease: float = 1.0
) -> JobRow:
    """Claim a job straight through the backend, as a worker that then dies, never finishing.

    ``lease`` is used for jobs without their own ``lease=``.
    """
    row = raw_row(app, job_id)
    suspect = row.rescues > 0  # a rescued job is only claimed as a suspect, one at a time
    rows = app.backend.job_claim(
        ClaimParams([QueueClaim(row.queue, 1)], 1, worker_id, lease, suspects=suspect)
    )
    assert [r.id for r in rows] == [job_id], f"expected to claim job {job_id}, got {rows}"
    return rows[0]


def expire_lease(app: errands.App, job_id: int, token: str | None = None) -> int:
    """Move a running job's lease expiry into the past (as if its worker stopped renewing)."""
    sql = (
        f"UPDATE errands_jobs SET lease_expires_at = {DB_NOW} - 60 "
        "WHERE id = ? AND state = 'running'"
    )
    params: tuple[Any, ...] = (job_id,)
    if token is not None:
        sql += " AND lease_token = ?"
        params = (job_id, token)
    return execute_sql(app, sql, params)


def force_rescue(app: errands.App, job_id: int, *, timeout: float = 10.0) -> JobRow:
    """Expire the current lease of a running job and rescue it with a separate rescuer.

    A live heartbeat may extend the lease between the UPDATE and the rescue (the rescue is
    fenced against exactly that), so this repeats until one rescue has landed. Returns the
    row as it was when the lease was taken away.
    """
    before = raw_row(app, job_id)
    assert before.state == "running", f"job {job_id} is {before.state}, not running"
    rescuer = Maintenance(app, "test-rescuer")

    def rescued() -> bool:
        expire_lease(app, job_id, before.lease_token)
        rescuer.rescue()
        return raw_row(app, job_id).rescues > before.rescues

    wait_until(rescued, timeout=timeout, interval=0.02, what=f"rescue of job {job_id}")
    return before


class WorkerThread:
    """An in-process worker in a thread, stoppable (and joinable) from the test."""

    def __init__(self, app: errands.App, **options: Any) -> None:
        options.setdefault("poll_interval", 0.05)
        options.setdefault("maintenance_tick", 0.1)
        self.worker: Worker = app.worker(**options)
        self.exit_code: int | None = None
        self.thread = threading.Thread(target=self._run, name="test-worker", daemon=True)

    def _run(self) -> None:
        self.exit_code = self.worker.run(install_signals=False)

    def start(self) -> WorkerThread:
        self.thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> float:
        """Stop gracefully and wait for ``run`` to return; returns the seconds it took."""
        started = time.monotonic()
        self.worker.stop()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"worker did not stop within {timeout} s"
        return time.monotonic() - started


def results_app(url: str) -> errands.App:
    """An App with the jobs the result tests wait for: add, nap, fail (no retries)."""
    app = errands.App(url)

    @app.job(name="results.add")
    def add(a: int, b: int) -> int:
        return a + b

    @app.job(name="results.nap")
    def nap(seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    @app.job(name="results.fail", retries=0)
    def fail() -> None:
        raise RuntimeError("no")

    app.migrate()
    return app
