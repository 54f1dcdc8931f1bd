"""Helpers for the issue-5 tests: run intervals, peaks, workers in threads, raw SQL on
either backend, and real worker processes (the acceptance harness, pointed at any store).

Tests wait on conditions with deadlines (``wait_until``), never on fixed sleeps, except
where the sleep *is* the measurement (a window in which nothing may start).
"""

from __future__ import annotations

import bisect
import logging
import sqlite3
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

ACCEPTANCE_APPS = Path(__file__).resolve().parents[1] / "acceptance" / "apps"
LIMITS_APPS = Path(__file__).resolve().parent / "apps"
for _folder in (ACCEPTANCE_APPS, LIMITS_APPS):  # the harness imports acc_support
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

from click.testing import CliRunner, Result  # noqa: E402

import errands  # noqa: E402
from errands.cli.main import cli  # noqa: E402
from errands.worker.worker import Worker  # noqa: E402
from tests.acceptance.harness import Cluster, wait_until  # noqa: E402
from tests.pg import pg_base_url  # noqa: E402

__all__ = [
    "Intervals",
    "LimitsCluster",
    "db_now",
    "drop_schema_when_possible",
    "expire_lease",
    "is_postgres",
    "peak",
    "postgres_started_at",
    "run_cli",
    "wait_for_postgres",
    "wait_until",
    "workers",
]


# -- PostgreSQL availability -----------------------------------------------------------
def _pg_connect(timeout: float = 2.0) -> Any:
    import psycopg

    return psycopg.connect(pg_base_url(), connect_timeout=timeout, autocommit=True)


def wait_for_postgres(timeout: float = 60.0) -> None:
    """Wait until the test server accepts connections again (another suite may be
    restarting it). Returns quietly after ``timeout``: ``pg_url`` then skips or fails
    with its own reason."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            _pg_connect().close()
            return
        except ImportError:
            return
        except Exception:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.25)


def drop_schema_when_possible(schema: str, timeout: float = 60.0) -> None:
    """Drop a test schema, waiting out a server restart; leave it behind (with a warning
    in the log) rather than fail the test that used it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with closing(_pg_connect()) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            return
        except Exception as exc:
            if time.monotonic() >= deadline:
                logging.getLogger(__name__).warning("could not drop schema %s: %s", schema, exc)
                return
            time.sleep(0.25)


def postgres_started_at() -> object:
    """The server's start time (changes when it restarts), or None when unreachable."""
    try:
        with closing(_pg_connect()) as conn:
            return conn.execute("SELECT pg_postmaster_start_time()").fetchone()[0]
    except Exception:
        return None


# -- the store, whichever backend ---------------------------------------------------------
def is_postgres(app: errands.App) -> bool:
    return app.url.startswith("postgres")


def db_now(app: errands.App) -> float:
    return app.backend.db_now()


def expire_lease(app: errands.App, job_id: int) -> int:
    """TEST-ONLY: make a running job's lease expire now, as if its heartbeats had stopped.
    Returns the rows changed (1 when the job was running)."""
    if is_postgres(app):
        from errands.backends.postgres.config import parse_postgres_url

        config = parse_postgres_url(app.url)
        import psycopg

        with closing(psycopg.connect(config.conninfo, autocommit=True)) as conn:
            return conn.execute(
                f'UPDATE "{config.schema}".errands_jobs '
                "SET lease_expires_at = now() - interval '1 second' "
                "WHERE id = %s AND state = 'running'",
                (job_id,),
            ).rowcount
    path = app.backend.path  # type: ignore[attr-defined]
    with closing(sqlite3.connect(path, timeout=30)) as conn, conn:
        return conn.execute(
            "UPDATE errands_jobs SET lease_expires_at = "
            "(julianday('now') - 2440587.5) * 86400.0 - 1 WHERE id = ? AND state = 'running'",
            (job_id,),
        ).rowcount


def run_cli(*args: str) -> Result:
    """``errands ARGS`` in this process (click's runner); output in ``.output``."""
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


# -- run intervals and their peaks ------------------------------------------------------
class Intervals:
    """Start and end times (monotonic) of handler runs, grouped by a label."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.runs: list[tuple[str, float, float]] = []
        self.starts: list[tuple[str, float]] = []

    @contextmanager
    def run(self, label: str = "") -> Iterator[None]:
        started = time.monotonic()
        with self._lock:
            self.starts.append((label, started))
        try:
            yield
        finally:
            ended = time.monotonic()
            with self._lock:
                self.runs.append((label, started, ended))

    def start_times(self, label: str | None = None) -> list[float]:
        with self._lock:
            return sorted(t for lab, t in self.starts if label is None or lab == label)

    def peak(self, label: str | None = None) -> int:
        with self._lock:
            return peak((s, e) for lab, s, e in self.runs if label is None or lab == label)

    def peak_by_label(self) -> dict[str, int]:
        grouped: dict[str, list[tuple[float, float]]] = defaultdict(list)
        with self._lock:
            for label, s, e in self.runs:
                grouped[label].append((s, e))
        return {label: peak(runs) for label, runs in grouped.items()}


def peak(intervals: Iterable[tuple[float, float]]) -> int:
    """The largest number of intervals open at one instant (an end at the very instant of
    a start counts as still open: ties are resolved against the code under test)."""
    events = []
    for start, end in intervals:
        events.append((start, 1))
        events.append((end, 0))
    events.sort(key=lambda e: (e[0], -e[1]))
    current = best = 0
    for _, is_start in events:
        current += 1 if is_start else -1
        best = max(best, current)
    return best


def most_in_window(times: list[float], period: float) -> int:
    """The most ``times`` inside any window ``(t - period, t]`` (1 µs allowed for the
    rounding of the database clock)."""
    ordered = sorted(times)
    best = 0
    for i, t in enumerate(ordered):
        first = bisect.bisect_right(ordered, t - period + 1e-6)
        best = max(best, i + 1 - first)
    return best


# -- workers in threads -----------------------------------------------------------------
@contextmanager
def workers(apps: list[errands.App], **options: Any) -> Iterator[list[Worker]]:
    """One in-process worker per App (each its own connections: a small cluster), each in
    a thread; stopped gracefully on exit."""
    options.setdefault("poll_interval", 0.05)
    options.setdefault("maintenance_tick", 0.1)
    started: list[tuple[Worker, threading.Thread]] = []
    try:
        for application in apps:
            worker = application.worker(**options)
            thread = threading.Thread(
                target=worker.run, kwargs={"install_signals": False}, daemon=True
            )
            thread.start()
            started.append((worker, thread))
        yield [w for w, _ in started]
    finally:
        for worker, _ in started:
            worker.stop()
        for _, thread in started:
            thread.join(timeout=30)
            assert not thread.is_alive(), "a worker did not stop within 30 s"


# -- real worker processes on either backend ----------------------------------------------
class LimitsCluster(Cluster):
    """The acceptance harness's :class:`Cluster` on any store URL (SQLite or PostgreSQL),
    running the apps of tests/limits/apps. Handlers record into the harness's effects
    file (SQLite, apart from the store)."""

    def __init__(self, folder: Path, url: str) -> None:
        super().__init__(folder)
        self.url = url

    def env(self, **extra: str) -> dict[str, str]:
        env = super().env(**extra)
        env["PYTHONPATH"] = f"{LIMITS_APPS}:{env['PYTHONPATH']}"
        return env

    def query_effects(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        with closing(sqlite3.connect(self.effects_path, timeout=30)) as conn:
            return conn.execute(sql, params).fetchall()

    def runs(self) -> list[tuple[int, int, float, float]]:
        """(job_id, pid, start, end) of every handler run that recorded both ends."""
        rows = self.query_effects("SELECT job_id, pid, kind, at FROM effects ORDER BY id")
        starts: dict[int, tuple[int, float]] = {}
        runs = []
        for job_id, pid, kind, at in rows:
            if kind == "start":
                starts[job_id] = (pid, at)
            elif kind == "end" and job_id in starts:
                pid0, started = starts.pop(job_id)
                runs.append((job_id, pid0, started, at))
        return runs
