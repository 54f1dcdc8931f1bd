"""``errands migrate`` on PostgreSQL: concurrent runs, ``--sql`` for your own tooling, and
a worker that refuses an un-migrated schema (DESIGN §8, §11)."""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pgacc_basic
import pgacc_support
import psycopg
import pytest

import errands
from errands.backends.postgres.backend import MIGRATIONS, SCHEMA_VERSION, fill_markers
from tests.pg import drop_schema, pg_base_url, unavailable, with_params

from .harness import PgCluster, wait_until

pytestmark = pytest.mark.acceptance


@pytest.fixture
def schema_url(pgc: PgCluster) -> Iterator[Callable[[str], str]]:
    """URLs on extra fresh schemas (no auto_migrate), dropped after the test."""
    made: list[str] = []

    def make(suffix: str) -> str:
        schema = f"{pgc.schema}_{suffix}"
        made.append(schema)
        return with_params(pg_base_url(), schema=schema)

    try:
        yield make
    finally:
        for schema in made:
            drop_schema(schema)


def _shape(pgc: PgCluster, schema: str) -> dict[str, Any]:
    """Tables, columns, indexes and storage options of one schema, schema name blanked."""
    columns = pgc.query(
        "SELECT table_name, column_name, data_type, is_nullable, column_default "
        "FROM information_schema.columns WHERE table_schema = %s ORDER BY 1, 2",
        (schema,),
    )
    indexes = pgc.query(
        "SELECT indexname, replace(indexdef, %s, 'S') FROM pg_indexes "
        "WHERE schemaname = %s ORDER BY 1",
        (schema, schema),
    )
    options = pgc.query(
        "SELECT c.relname, c.reloptions FROM pg_class c JOIN pg_namespace n "
        "ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relkind = 'r' ORDER BY 1",
        (schema,),
    )
    versions = pgc.query(f'SELECT version, name FROM "{schema}".errands_migrations ORDER BY 1')
    return {"columns": columns, "indexes": indexes, "options": options, "versions": versions}


def test_four_concurrent_migrate_processes_all_succeed_and_apply_each_migration_once(
    pgc: PgCluster, schema_url: Callable[[str], str]
) -> None:
    """Four `errands migrate` started at once on a fresh schema: all exit 0; exactly one
    applies the migrations (under the advisory lock), the others find the schema up to
    date; every version is recorded once."""
    url = schema_url("m")
    procs = [pgc.spawn(["migrate", "--url", url], label=f"migrate{i}") for i in range(4)]
    codes = [p.wait_exit(60) for p in procs]
    assert codes == [0, 0, 0, 0], pgc.report()
    expected = [f"applied {v:04d}_{n}" for v, n, _ in MIGRATIONS]
    outputs = sorted(p.stdout().splitlines() for p in procs)
    assert outputs == sorted([expected] + [["schema is up to date"]] * 3), outputs
    schema = f"{pgc.schema}_m"
    assert _shape(pgc, schema)["versions"] == [(v, n) for v, n, _ in MIGRATIONS]


def test_migrate_sql_applied_with_psql_gives_the_same_schema_and_a_worker_accepts_it(
    pgc: PgCluster, schema_url: Callable[[str], str]
) -> None:
    """`errands migrate --sql` prints SQL that psql applies to a fresh schema; the result
    equals what `errands migrate` builds, and a worker starts on it and runs a job."""
    if shutil.which("psql") is None:
        unavailable("psql is not installed: apt-get install postgresql-client to run this")
    by_tool, by_sql = schema_url("tool"), schema_url("sql")
    assert pgc.cli("migrate", "--url", by_tool).code == 0

    printed = pgc.cli("migrate", "--sql", "--url", by_sql)
    assert printed.code == 0, str(printed)
    assert "CREATE TABLE" in printed.stdout
    applied = subprocess.run(
        ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", pg_base_url()],
        input=printed.stdout,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert applied.returncode == 0, applied.stderr

    assert _shape(pgc, f"{pgc.schema}_sql") == _shape(pgc, f"{pgc.schema}_tool")

    worker_url = with_params(by_sql, application_name=pgc.tag)
    pgacc_support.create(worker_url)
    worker = pgc.start_worker(label="on-sql-schema", ERRANDS_URL=worker_url)
    app = pgc.app()
    app.close()
    app.url = by_sql  # no auto_migrate: the schema must already be complete
    handle = pgacc_basic.touch.enqueue(n=7)
    wait_until(lambda: handle.status() == "completed", 20, "the job to complete")
    assert handle.result() == 7
    assert worker.alive


def test_worker_on_an_unmigrated_schema_exits_with_one_line_saying_to_run_migrate(
    pgc: PgCluster, schema_url: Callable[[str], str]
) -> None:
    """A worker pointed at a schema errands never migrated (no auto_migrate) exits
    non-zero with a single line naming the fix, and creates nothing."""
    url = schema_url("bare")
    proc = pgc.spawn(["worker", "pgacc_basic:app"], label="unmigrated", ERRANDS_URL=url)
    code = proc.wait_exit(30)
    lines = [line for line in proc.stderr().splitlines() if line.strip()]
    assert code != 0
    assert len(lines) == 1, proc.stderr()
    assert "errands migrate" in lines[0], lines[0]
    assert not pgc.query("SELECT 1 FROM pg_namespace WHERE nspname = %s", (f"{pgc.schema}_bare",))


def test_a_worker_of_the_previous_release_runs_on_a_newer_schema_with_a_warning(
    pgc: PgCluster,
) -> None:
    """A newer release migrated the schema (a version above this errands' is recorded)
    while this release's workers still run, as in a rolling deploy. A worker of this
    release (re)started now runs its jobs, with one warning naming both versions and
    saying to upgrade errands on this host; `errands migrate` of this release refuses
    the schema with the same advice. Before: the worker exited 1 saying to run `errands
    migrate`, which this release then refused ("newer than this errands")."""
    pgc.app().migrate()
    newer = SCHEMA_VERSION + 1
    pgc.query("INSERT INTO {s}.errands_migrations (version, name) VALUES (%s, 'next')", (newer,))
    worker = pgc.start_worker(label="previous-release")  # auto_migrate=true in its URL too
    handle = pgacc_basic.touch.enqueue(n=3)
    wait_until(lambda: handle.status() == "completed", 30, "the job to complete")
    assert handle.result() == 3
    told = [line for line in worker.stderr().splitlines() if "newer than this errands" in line]
    assert len(told) == 1, worker.stderr()
    assert f"version {newer}, newer than this errands ({SCHEMA_VERSION})" in told[0], told
    assert "upgrade errands on this host" in told[0] and "errands migrate" not in told[0], told
    refused = pgc.cli("migrate", "--url", with_params(pg_base_url(), schema=pgc.schema))
    assert refused.code != 0, str(refused)
    assert "upgrade errands on this host" in refused.stderr, str(refused)
    assert worker.alive


def _schema_at(url: str, schema: str, version: int) -> None:
    """``schema`` built as errands migrate left it at ``version``, with one job (id 1)."""
    with psycopg.connect(pg_base_url(), autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
        conn.execute(
            f'CREATE TABLE "{schema}".errands_migrations (version integer PRIMARY KEY, '
            "name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        for v, name, sql in MIGRATIONS[:version]:
            with conn.transaction():
                conn.execute(fill_markers(sql, schema).encode())
                conn.execute(
                    f'INSERT INTO "{schema}".errands_migrations (version, name) VALUES (%s, %s)',
                    (v, name),
                )
        conn.execute(
            f'INSERT INTO "{schema}".errands_jobs (name, queue, args, state, max_attempts, '
            "run_at) VALUES ('j', 'q', '{}', 'completed', 1, now())"
        )


def test_migrate_waiting_past_its_lock_timeout_fails_clearly_changes_nothing_and_lets_writers_on(
    pgc: PgCluster, schema_url: Callable[[str], str]
) -> None:
    """The schema at version 15; a web request's transaction that enqueued a job stays
    open. `migrate` needs a lock on the jobs table that this transaction's lock excludes
    (0016 builds indexes): it waits at most its lock_timeout (the runner's, for every
    migration: 0009-0016 set none themselves), then fails with DatabaseBusy naming the
    migration and saying to run it again at a quieter moment; the schema stays at 15. A
    heartbeat's UPDATE that queued behind migrate's lock request goes on once migrate
    gave up, while the request's transaction is still open. Before: migrate waited for
    that transaction to end, and every claim, heartbeat and enqueue queued behind it."""
    url = schema_url("v15")
    schema = f"{pgc.schema}_v15"
    _schema_at(url, schema, 15)
    jobs = f'"{schema}".errands_jobs'
    request = psycopg.connect(pg_base_url())  # the slow request's transaction
    request.execute(
        f"INSERT INTO {jobs} (name, queue, args, state, max_attempts, run_at) "
        "VALUES ('j', 'q', '{}', 'available', 1, now())"
    )
    app = errands.App(url)
    outcome: list[BaseException | list[str]] = []

    def migrate() -> None:
        try:
            outcome.append(app.migrate())
        except BaseException as exc:
            outcome.append(exc)

    written = threading.Event()

    def heartbeat() -> None:
        with psycopg.connect(pg_base_url(), autocommit=True) as conn:
            conn.execute(f"UPDATE {jobs} SET lease_expires_at = now() WHERE id = 1")
        written.set()

    migrating = threading.Thread(target=migrate)
    writing = threading.Thread(target=heartbeat)
    try:
        migrating.start()
        wait_until(
            lambda: (
                outcome
                or pgc.query(
                    "SELECT 1 FROM pg_locks WHERE NOT granted AND relation = %s::regclass",
                    (jobs,),
                )
            ),
            30,
            "migrate to wait for the jobs table's lock",
        )
        writing.start()  # queues behind migrate's lock request
        # (before: never, while the request stays open; the cap only ends the test)
        written_while_open = written.wait(120)
    finally:
        request.rollback()  # the request ends (and frees whoever still waits)
        request.close()
        migrating.join(60)
        writing.join(60)
    assert written_while_open, "the heartbeat's UPDATE waited for the open transaction"
    [failed] = outcome
    assert isinstance(failed, errands.DatabaseBusy), failed
    assert isinstance(failed, psycopg.errors.LockNotAvailable)
    message = str(failed)
    assert "errands migration 0016_lean_pending waited" in message, message
    assert "nothing was changed" in message and "at a quieter moment" in message, message
    versions = pgc.query(f'SELECT max(version) FROM "{schema}".errands_migrations')
    assert versions == [(15,)]
    assert not pgc.query(
        "SELECT 1 FROM pg_indexes WHERE schemaname = %s AND indexname = %s",
        (schema, "errands_jobs_listed_queue"),
    )
    # at a quieter moment (the request ended), it runs through
    assert app.migrate() == [f"{v:04d}_{n}" for v, n, _ in MIGRATIONS[15:]]
    app.close()
