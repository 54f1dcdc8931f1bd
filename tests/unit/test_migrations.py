"""SQLite migrations: a fresh schema equals the migration files, applied once."""

from __future__ import annotations

import contextlib
import logging
import re
import sqlite3
import threading
from pathlib import Path

import pytest

from errands import SchemaOutdated
from errands.backends import open_backend
from errands.backends.sqlfile import load_migrations
from errands.backends.sqlite.backend import MIGRATIONS, SCHEMA_VERSION, Q, SQLiteBackend
from tests.conformance.support import request

MIGRATIONS_DIR = (
    Path(__file__).parents[2] / "src" / "errands" / "backends" / "sqlite" / "migrations"
)


def _schema(path: Path) -> set[tuple[str, str, str, str | None]]:
    """Every table, index, view and trigger of a database file, minus the migration log."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        rows = conn.execute("SELECT type, name, tbl_name, sql FROM sqlite_master").fetchall()
    return {r for r in rows if r[2] != "errands_migrations"}


def _unmigrated(tmp_path: Path) -> SQLiteBackend:
    return open_backend(f"sqlite:///{tmp_path}/fresh.db", auto_migrate=False)  # type: ignore[return-value]


def test_fresh_database_after_migrate_has_exactly_the_schema_of_the_migration_files(
    tmp_path: Path,
) -> None:
    """migrate() builds what the .sql files say: nothing more, nothing less."""
    files = sorted(MIGRATIONS_DIR.glob("[0-9][0-9][0-9][0-9]_*.sql"))
    assert [f.name for f in files] == [f"{v:04d}_{n}.sql" for v, n, _ in MIGRATIONS]
    reference = tmp_path / "reference.db"
    with contextlib.closing(sqlite3.connect(reference)) as conn:
        for file in files:
            conn.executescript(file.read_text(encoding="utf-8"))
    backend = _unmigrated(tmp_path)
    try:
        backend.migrate()
    finally:
        backend.close()
    migrated = _schema(tmp_path / "fresh.db")
    assert migrated == _schema(reference)
    assert {name for kind, name, _, _ in migrated if kind == "table"} >= {
        "errands_jobs",
        "errands_audit",
        "errands_leaders",
    }


def test_migrate_records_each_version_and_applies_nothing_the_second_time(
    tmp_path: Path,
) -> None:
    """The first migrate applies every file and logs it; the second applies none."""
    backend = _unmigrated(tmp_path)
    try:
        assert backend.migrate() == [f"{v:04d}_{n}" for v, n, _ in MIGRATIONS]
        before = _schema(tmp_path / "fresh.db")
        assert backend.migrate() == []
        assert _schema(tmp_path / "fresh.db") == before
    finally:
        backend.close()
    with contextlib.closing(sqlite3.connect(tmp_path / "fresh.db")) as conn:
        versions = [r[0] for r in conn.execute("SELECT version FROM errands_migrations")]
    assert versions == list(range(1, SCHEMA_VERSION + 1))


def test_concurrent_migrations_apply_each_file_exactly_once(tmp_path: Path) -> None:
    """Several processes running migrate at once leave one applied copy of each file."""
    backends = [_unmigrated(tmp_path) for _ in range(4)]
    applied: list[list[str]] = []
    barrier = threading.Barrier(len(backends))

    def run(backend: SQLiteBackend) -> None:
        barrier.wait()
        applied.append(backend.migrate())

    threads = [threading.Thread(target=run, args=(b,)) for b in backends]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    finally:
        for b in backends:
            b.close()
    assert sorted(applied, key=len) == [[], [], [], [f"{v:04d}_{n}" for v, n, _ in MIGRATIONS]]


def test_schema_check_refuses_an_unmigrated_database_naming_the_command(tmp_path: Path) -> None:
    """A worker on a database without the schema is told to run errands migrate."""
    backend = _unmigrated(tmp_path)
    try:
        with pytest.raises(SchemaOutdated, match="errands migrate"):
            backend.schema_check()
        backend.migrate()
        assert backend.schema_check() is None
    finally:
        backend.close()


def test_a_worker_of_the_previous_release_runs_on_a_newer_schema_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A newer errands upgraded the file while this release still runs (a rolling deploy):
    the store opens (auto-migrate) and passes the worker's schema check, with one warning
    naming both versions and saying to upgrade errands on this host, and serves jobs;
    migrate() refuses it with the same advice. Before: the open raised, and the check
    said to run errands migrate, which this release refuses."""
    backend = _unmigrated(tmp_path)
    try:
        backend.migrate()
        with contextlib.closing(sqlite3.connect(tmp_path / "fresh.db")) as conn, conn:
            conn.execute(
                "INSERT INTO errands_migrations (version, name, applied_at) "
                "VALUES (?, 'future', 0)",
                (SCHEMA_VERSION + 1,),
            )
        with pytest.raises(SchemaOutdated, match="upgrade errands on this host"):
            backend.migrate()
    finally:
        backend.close()
    caplog.set_level(logging.WARNING, logger="errands.sqlite")
    reopened = SQLiteBackend(f"sqlite:///{tmp_path / 'fresh.db'}")  # auto-migrates
    try:
        assert reopened.schema_check() is None
        assert reopened.schema_check() is None  # said once
        told = [r.getMessage() for r in caplog.records if "newer than this" in r.getMessage()]
        assert len(told) == 1, told
        newer = f"version {SCHEMA_VERSION + 1}, newer than this errands ({SCHEMA_VERSION})"
        assert newer in told[0], told
        assert "upgrade errands on this host" in told[0] and "errands migrate" not in told[0]
        [inserted] = reopened.job_insert_many([request()])
        assert reopened.job_get(inserted.id) is not None
    finally:
        reopened.close()


def test_schema_check_refuses_an_older_schema_naming_migrate(tmp_path: Path) -> None:
    """One release behind (the last migration not applied): refused, saying to migrate."""
    backend = _unmigrated(tmp_path)
    try:
        path = tmp_path / "fresh.db"
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
            conn.execute(
                "CREATE TABLE errands_migrations (version INTEGER PRIMARY KEY, "
                "name TEXT NOT NULL, applied_at REAL NOT NULL)"
            )
            for version, name, sql in MIGRATIONS[:-1]:
                conn.executescript(sql)
                conn.execute("INSERT INTO errands_migrations VALUES (?, ?, 0)", (version, name))
        with pytest.raises(SchemaOutdated, match=f"version {SCHEMA_VERSION - 1}.*errands migrate"):
            backend.schema_check()
    finally:
        backend.close()


def test_migration_files_are_numbered_from_one_without_gaps() -> None:
    """load_migrations sees 0001, 0002, ... in order."""
    versions = [v for v, _, _ in load_migrations("errands.backends.sqlite")]
    assert versions == list(range(1, len(versions) + 1)) and versions[-1] == SCHEMA_VERSION


def test_every_named_query_compiles_against_the_migrated_schema(tmp_path: Path) -> None:
    """Each block of queries.sql names only tables and columns the migrations create."""
    backend = _unmigrated(tmp_path)
    try:
        backend.migrate()
    finally:
        backend.close()
    with contextlib.closing(sqlite3.connect(tmp_path / "fresh.db")) as conn:
        for name, sql in Q.items():
            params = dict.fromkeys(re.findall(r"(?<!:):(\w+)", sql))
            try:
                conn.execute(f"EXPLAIN {sql}", params)
            except sqlite3.Error as exc:  # pragma: no cover - the assertion message
                pytest.fail(f"query {name!r} does not compile: {exc}")


def test_migration_9_rebuilds_the_jobs_table_keeping_rows_ids_and_the_id_sequence(
    tmp_path: Path,
) -> None:
    """A store at version 8 with jobs (the newest one pruned) migrates to 9: every row and
    column is kept, a new job never reuses the pruned id, and 'waiting' is a valid state."""
    path = tmp_path / "v8.db"
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute(
            "CREATE TABLE errands_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL, "
            "applied_at REAL NOT NULL)"
        )
        for version, name, sql in MIGRATIONS:
            if version > 8:
                break
            conn.executescript(sql)
            conn.execute("INSERT INTO errands_migrations VALUES (?, ?, 0)", (version, name))
        for n in range(3):
            conn.execute(
                "INSERT INTO errands_jobs (name, queue, args, state, max_attempts, run_at, "
                "inserted_at, concurrency_key) VALUES ('j', 'q', ?, 'available', 1, 0, 0, 'k')",
                (f'{{"n": {n}}}',),
            )
        conn.execute("DELETE FROM errands_jobs WHERE id = 3")  # pruned: its id stays used
    backend = open_backend(f"sqlite:///{path}")  # migrates to the current version
    try:
        rows = [backend.job_get(i) for i in (1, 2)]
        assert [r.args for r in rows if r] == ['{"n": 0}', '{"n": 1}']
        from errands.jobs import EnqueueRequest

        (new,) = backend.job_insert_many([EnqueueRequest("j", "q", "{}", 0, 1, 0.0, None, None,
                                                         None, None)])  # fmt: skip
        assert new.id == 4
    finally:
        backend.close()
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        assert conn.execute("SELECT concurrency_key FROM errands_jobs WHERE id = 2").fetchone() == (
            "k",
        )
        conn.execute("UPDATE errands_jobs SET state = 'waiting' WHERE id = 1")
        with pytest.raises(sqlite3.IntegrityError):
            conn.execute("UPDATE errands_jobs SET state = 'bogus' WHERE id = 1")


def test_migration_17_keeps_the_starts_logged_before_it_and_the_release_before_it_writing(
    tmp_path: Path,
) -> None:
    """A store at version 16 (its rate log without tokens) with a start of an hour's rate
    in it migrates to 17: that start is kept and still counted (NULL token, never given
    back), and the previous release's insert, which names no token, still works beside
    this one (a rolling deploy)."""
    path = tmp_path / "v16.db"
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute(
            "CREATE TABLE errands_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL, "
            "applied_at REAL NOT NULL)"
        )
        for version, name, sql in MIGRATIONS:
            if version > 16:
                break
            conn.executescript(sql)
            conn.execute("INSERT INTO errands_migrations VALUES (?, ?, 0)", (version, name))
        conn.execute(
            "INSERT INTO errands_rate_log (bucket, at, period) "
            "VALUES ('queue:q', (julianday('now') - 2440587.5) * 86400.0, 3600)"
        )
    backend = open_backend(f"sqlite:///{path}")  # migrates to the current version
    try:
        assert backend.schema_check() is None
    finally:
        backend.close()
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        previous_release = (
            "INSERT INTO errands_rate_log (bucket, at, period) "
            "VALUES ('queue:q', (julianday('now') - 2440587.5) * 86400.0, 3600)"
        )
        conn.execute(previous_release)
        assert (
            conn.execute(Q["rate_count"], {"bucket": "queue:q", "period": 3600}).fetchone()[0] == 2
        )
        assert conn.execute(
            "SELECT count(*) FROM errands_rate_log WHERE token IS NULL"
        ).fetchone() == (2,)
