"""The ``backend`` fixture: every conformance test runs once per backend in BACKENDS.

Adding a backend is one entry in :data:`BACKENDS`: a :class:`Harness` that opens a fresh,
migrated store for one test and implements the few test-only operations the suite needs
(time warps, a caller's own connection). Tests talk to the store only through the
``Backend`` protocol; the harness is the one place that knows a dialect.

PostgreSQL is listed only when ``errands.backends.postgres`` is importable. It uses
``ERRANDS_TEST_PG_URL`` (default ``postgresql://postgres@127.0.0.1:5432/errands_test``);
a server store is shared, so :func:`reset_store` empties it before each test. When the
backend cannot be opened (no server, or ``open_backend`` not supporting the URL yet) the
param is skipped with the reason, except under ``CI=true``, where it fails: CI must run
the PostgreSQL tests.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from errands.backends import Backend, open_backend
from tests.pg import PG_URL_DEFAULT, require_pg, unavailable


def reset_store(backend: Backend) -> None:
    """Bring a shared server database to a fresh, migrated, empty store for the next test.

    Called for every backend but SQLite (which gets a new file per test): migrate, then
    empty every errands table except the migration record, restarting the id sequences.
    """
    import psycopg
    from psycopg import sql

    backend.migrate()
    schema: str = backend.schema  # type: ignore[attr-defined]
    with psycopg.connect(backend.config.conninfo, autocommit=True) as conn:  # type: ignore[attr-defined]
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = %s "
                "AND tablename <> 'errands_migrations'",
                (schema,),
            )
        ]
        if tables:
            conn.execute(
                sql.SQL("TRUNCATE {} RESTART IDENTITY CASCADE").format(
                    sql.SQL(", ").join(sql.Identifier(schema, t) for t in tables)
                )
            )


class Harness:
    """How the suite opens one backend and performs its test-only operations."""

    name: str
    driver_errors: tuple[type[BaseException], ...] = ()  # what a violated constraint raises

    def open(self, tmp_path: Path) -> Backend:
        raise NotImplementedError

    # -- test-only time warps: make the database believe time has passed -------------
    def expire_lease(self, backend: Backend, job_id: int, seconds_ago: float = 1.0) -> None:
        """Set a running job's lease to have run out ``seconds_ago`` seconds ago."""
        raise NotImplementedError

    def backdate_run_at(self, backend: Backend, job_id: int, seconds_ago: float) -> None:
        """Move a job's ``run_at`` into the past, as if its delay had passed."""
        raise NotImplementedError

    def backdate_finished(self, backend: Backend, job_id: int, seconds_ago: float) -> None:
        """Move a finished job's ``finished_at`` into the past (for retention pruning)."""
        raise NotImplementedError

    def backdate_settled(self, backend: Backend, workflow_id: int, seconds_ago: float) -> None:
        """Move a settled workflow's ``settled_at`` into the past (for retention pruning)."""
        raise NotImplementedError

    def expire_leader(self, backend: Backend, name: str) -> None:
        """Let the current leadership of ``name`` run out without waiting for its ttl."""
        raise NotImplementedError

    def backdate_heartbeat(self, backend: Backend, worker_id: str, seconds_ago: float) -> None:
        """Make a registered worker's last heartbeat ``seconds_ago`` seconds old."""
        raise NotImplementedError

    # -- the caller's own connection (enqueue(conn=...)) -------------------------------
    @contextlib.contextmanager
    def caller_connection(self, backend: Backend, tmp_path: Path, *, same_store: bool) -> Any:
        """A connection of the type the backend accepts, on its store or on another one."""
        raise NotImplementedError
        yield

    def begin(self, conn: Any) -> None:
        raise NotImplementedError

    def commit(self, conn: Any) -> None:
        raise NotImplementedError

    def rollback(self, conn: Any) -> None:
        raise NotImplementedError

    def execute(self, conn: Any, sql: str) -> list[tuple[Any, ...]]:
        """Run one statement of the caller's own (business) SQL on ``conn``."""
        raise NotImplementedError

    # -- the caller's own async connection (aenqueue(conn=...)) --------------------------
    async def async_connection(self, backend: Backend, tmp_path: Path, *, same_store: bool) -> Any:
        """An async driver connection (aiosqlite, psycopg AsyncConnection) with no
        transaction open yet; the next write opens one. The caller closes it."""
        raise NotImplementedError

    def sqlalchemy_async_url(self, backend: Backend) -> str:
        """The store as SQLAlchemy's async engines name it."""
        raise NotImplementedError


class SQLiteHarness(Harness):
    """A new database file per test; time warps are UPDATEs on a side connection."""

    name = "sqlite"
    driver_errors = (sqlite3.Error,)

    def open(self, tmp_path: Path) -> Backend:
        return open_backend(f"sqlite:///{tmp_path}/conformance.db")

    @staticmethod
    def _side_write(backend: Backend, sql: str, params: dict[str, Any]) -> None:
        # TEST-ONLY time warp: a raw connection to the store's file rewrites a timestamp
        # relative to the database clock, so the suite never sleeps for a lease or a ttl.
        with contextlib.closing(sqlite3.connect(backend.path, timeout=10)) as conn:  # type: ignore[attr-defined]
            with conn:
                changed = conn.execute(sql, params).rowcount
            assert changed == 1, f"time warp changed {changed} rows: {sql}"

    _NOW = "(julianday('now') - 2440587.5) * 86400.0"

    def expire_lease(self, backend: Backend, job_id: int, seconds_ago: float = 1.0) -> None:
        self._side_write(
            backend,
            f"UPDATE errands_jobs SET lease_expires_at = {self._NOW} - :s "
            "WHERE id = :id AND state = 'running'",
            {"s": seconds_ago, "id": job_id},
        )

    def backdate_run_at(self, backend: Backend, job_id: int, seconds_ago: float) -> None:
        self._side_write(
            backend,
            f"UPDATE errands_jobs SET run_at = {self._NOW} - :s WHERE id = :id",
            {"s": seconds_ago, "id": job_id},
        )

    def backdate_finished(self, backend: Backend, job_id: int, seconds_ago: float) -> None:
        self._side_write(
            backend,
            f"UPDATE errands_jobs SET finished_at = {self._NOW} - :s "
            "WHERE id = :id AND finished_at IS NOT NULL",
            {"s": seconds_ago, "id": job_id},
        )

    def backdate_settled(self, backend: Backend, workflow_id: int, seconds_ago: float) -> None:
        self._side_write(
            backend,
            f"UPDATE errands_workflows SET settled_at = {self._NOW} - :s "
            "WHERE id = :id AND settled_at IS NOT NULL",
            {"s": seconds_ago, "id": workflow_id},
        )

    def expire_leader(self, backend: Backend, name: str) -> None:
        self._side_write(
            backend,
            f"UPDATE errands_leaders SET expires_at = {self._NOW} - 1 WHERE name = :name",
            {"name": name},
        )

    def backdate_heartbeat(self, backend: Backend, worker_id: str, seconds_ago: float) -> None:
        self._side_write(
            backend,
            f"UPDATE errands_workers SET heartbeat_at = {self._NOW} - :s WHERE id = :id",
            {"s": seconds_ago, "id": worker_id},
        )

    @contextlib.contextmanager
    def caller_connection(
        self, backend: Backend, tmp_path: Path, *, same_store: bool
    ) -> Iterator[sqlite3.Connection]:
        path = backend.path if same_store else str(tmp_path / "elsewhere.db")  # type: ignore[attr-defined]
        conn = sqlite3.connect(path, isolation_level=None, timeout=10)
        try:
            yield conn
        finally:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            conn.close()

    def begin(self, conn: sqlite3.Connection) -> None:
        conn.execute("BEGIN IMMEDIATE")

    def commit(self, conn: sqlite3.Connection) -> None:
        conn.execute("COMMIT")

    def rollback(self, conn: sqlite3.Connection) -> None:
        conn.execute("ROLLBACK")

    def execute(self, conn: sqlite3.Connection, sql: str) -> list[tuple[Any, ...]]:
        return conn.execute(sql).fetchall()

    async def async_connection(self, backend: Backend, tmp_path: Path, *, same_store: bool) -> Any:
        import aiosqlite

        path = backend.path if same_store else str(tmp_path / "elsewhere.db")  # type: ignore[attr-defined]
        return await aiosqlite.connect(path, timeout=10)  # implicit BEGIN at the first write

    def sqlalchemy_async_url(self, backend: Backend) -> str:
        return f"sqlite+aiosqlite:///{backend.path}"  # type: ignore[attr-defined]


class PostgresHarness(Harness):
    """One PostgreSQL database (ERRANDS_TEST_PG_URL), emptied by :func:`reset_store` per test.

    The suite works in its own schema, ``errands_conformance_<pid>`` (unless the URL names
    one), so it never touches another run's tables; the schema is dropped at session end.
    """

    name = "postgres"

    def __init__(self) -> None:
        self.schema = f"errands_conformance_{os.getpid()}"
        self.opened = False

    @property
    def driver_errors(self) -> tuple[type[BaseException], ...]:  # type: ignore[override]
        import psycopg

        return (psycopg.Error,)

    def url(self) -> str:
        url = os.environ.get("ERRANDS_TEST_PG_URL", PG_URL_DEFAULT)
        if "schema=" in url:
            return url
        return f"{url}{'&' if '?' in url else '?'}schema={self.schema}"

    def open(self, tmp_path: Path) -> Backend:
        url = self.url()
        require_pg()  # creates the test database when missing; skips or fails with a reason
        try:
            backend = _open_when_ready(url)
        except Exception as exc:
            reason = (
                f"PostgreSQL backend cannot be opened at {url} ({type(exc).__name__}: {exc}). "
                "Start PostgreSQL on 127.0.0.1:5432 or set ERRANDS_TEST_PG_URL to run these"
            )
            unavailable(reason)
        self.opened = True
        try:
            reset_store(backend)
        except BaseException:
            backend.close()
            raise
        return backend

    def drop_schema(self) -> None:
        """Remove the suite's schema once the session is over."""
        if not self.opened or "schema=" in os.environ.get("ERRANDS_TEST_PG_URL", ""):
            return
        import psycopg
        from psycopg import sql

        from errands.backends.postgres.config import parse_postgres_url

        with psycopg.connect(parse_postgres_url(self.url()).conninfo, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(self.schema))
            )

    # TEST-ONLY time warps: a side connection rewrites a timestamp relative to now().
    @staticmethod
    def _side_write(backend: Backend, template: str, params: tuple[Any, ...]) -> None:
        import psycopg
        from psycopg import sql

        query = sql.SQL(template).format(schema=sql.Identifier(backend.schema))  # type: ignore[attr-defined]
        with psycopg.connect(backend.config.conninfo, autocommit=True) as conn:  # type: ignore[attr-defined]
            changed = conn.execute(query, params).rowcount
        assert changed == 1, f"time warp changed {changed} rows: {template}"

    def expire_lease(self, backend: Backend, job_id: int, seconds_ago: float = 1.0) -> None:
        self._side_write(
            backend,
            "UPDATE {schema}.errands_jobs SET lease_expires_at = now() - make_interval("
            "secs => %s) WHERE id = %s AND state = 'running'",
            (seconds_ago, job_id),
        )

    def backdate_run_at(self, backend: Backend, job_id: int, seconds_ago: float) -> None:
        self._side_write(
            backend,
            "UPDATE {schema}.errands_jobs SET run_at = now() - make_interval(secs => %s) "
            "WHERE id = %s",
            (seconds_ago, job_id),
        )

    def backdate_finished(self, backend: Backend, job_id: int, seconds_ago: float) -> None:
        self._side_write(
            backend,
            "UPDATE {schema}.errands_jobs SET finished_at = now() - make_interval(secs => %s) "
            "WHERE id = %s AND finished_at IS NOT NULL",
            (seconds_ago, job_id),
        )

    def backdate_settled(self, backend: Backend, workflow_id: int, seconds_ago: float) -> None:
        self._side_write(
            backend,
            "UPDATE {schema}.errands_workflows SET settled_at = now() - make_interval("
            "secs => %s) WHERE id = %s AND settled_at IS NOT NULL",
            (seconds_ago, workflow_id),
        )

    def expire_leader(self, backend: Backend, name: str) -> None:
        self._side_write(
            backend,
            "UPDATE {schema}.errands_leaders SET expires_at = now() - interval '1 second' "
            "WHERE name = %s",
            (name,),
        )

    def backdate_heartbeat(self, backend: Backend, worker_id: str, seconds_ago: float) -> None:
        self._side_write(
            backend,
            "UPDATE {schema}.errands_workers SET heartbeat_at = now() - make_interval("
            "secs => %s) WHERE id = %s",
            (seconds_ago, worker_id),
        )

    @contextlib.contextmanager
    def caller_connection(self, backend: Backend, tmp_path: Path, *, same_store: bool) -> Any:
        import psycopg
        from psycopg.conninfo import make_conninfo

        conninfo: str = backend.config.conninfo  # type: ignore[attr-defined]
        if not same_store:
            conninfo = make_conninfo(conninfo, dbname="postgres")
        with psycopg.connect(conninfo, autocommit=True) as conn:
            yield conn

    # The caller's connection starts in autocommit (its DDL commits at once); begin()
    # switches autocommit off so the next statement opens the caller's transaction.
    def begin(self, conn: Any) -> None:
        conn.autocommit = False

    def commit(self, conn: Any) -> None:
        conn.commit()
        conn.autocommit = True

    def rollback(self, conn: Any) -> None:
        conn.rollback()
        conn.autocommit = True

    def execute(self, conn: Any, sql: str) -> list[tuple[Any, ...]]:
        cur = conn.execute(sql)
        return cur.fetchall() if cur.description else []

    async def async_connection(self, backend: Backend, tmp_path: Path, *, same_store: bool) -> Any:
        import psycopg
        from psycopg.conninfo import make_conninfo

        conninfo: str = backend.config.conninfo  # type: ignore[attr-defined]
        if not same_store:
            conninfo = make_conninfo(conninfo, dbname="postgres")
        return await psycopg.AsyncConnection.connect(conninfo)  # autocommit off

    def sqlalchemy_async_url(self, backend: Backend) -> str:
        conninfo: str = backend.config.conninfo  # type: ignore[attr-defined]
        return conninfo.replace("postgresql://", "postgresql+psycopg://", 1)


def _postgres_backend_exists() -> bool:
    """True once the module ``errands.backends.postgres`` is part of the package."""
    try:
        return importlib.util.find_spec("errands.backends.postgres") is not None
    except ImportError:
        return False


# One entry per backend. PostgreSQL joins the list once its module exists.
BACKENDS: list[Harness] = [SQLiteHarness()]
if _postgres_backend_exists():
    BACKENDS.append(PostgresHarness())


@pytest.fixture(scope="session", autouse=True)
def _drop_server_schemas() -> Iterator[None]:
    yield
    for harness in BACKENDS:
        if isinstance(harness, PostgresHarness):
            harness.drop_schema()


@pytest.fixture(params=BACKENDS, ids=[h.name for h in BACKENDS])
def harness(request: pytest.FixtureRequest) -> Harness:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def backend(harness: Harness, tmp_path: Path) -> Iterator[Backend]:
    store = harness.open(tmp_path)
    try:
        yield store
    finally:
        store.close()


RESTARTING = ("starting up", "not yet accepting", "shutting down", "Connection refused")


def _open_when_ready(url: str, wait: float = 60.0) -> Backend:
    """Open the backend, waiting while the server restarts (other suites restart it on
    purpose and wait for it, but a test can land on the tail of such a restart)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return open_backend(url)
        except Exception as exc:
            if time.monotonic() > deadline or not any(t in str(exc) for t in RESTARTING):
                raise
            time.sleep(0.5)
