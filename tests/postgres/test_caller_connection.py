"""``enqueue(conn=...)`` checks that the caller's connection reaches the app's own server
and database, not just a database of the same name on the same port.

The job row is written on the caller's connection; on another server it would commit
there, where no worker of this app looks: a lost job. A connection whose host, port and
database name spell the app's own is accepted as is; any other (``localhost`` for
``127.0.0.1``, a Unix socket, another host) is asked once which server it reaches
(database, port and the postmaster's start time), inside a savepoint, so the question can
never abort the caller's transaction; the verdict is kept for that connection object.

The refusal needs a second PostgreSQL server with the same port and database name: a
throw-away cluster listening on 127.0.0.2:5432 (``initdb``, run as the postgres user).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pgacc_basic
import psycopg
import pytest

import errands
from tests.pg import unavailable

from .harness import PgCluster

pytestmark = pytest.mark.acceptance

TWIN_HOST = "127.0.0.2"


def _postgres_bindir() -> Path | None:
    found = shutil.which("pg_config")
    if found:
        out = subprocess.run([found, "--bindir"], capture_output=True, text=True, check=False)
        if (Path(out.stdout.strip()) / "initdb").exists():
            return Path(out.stdout.strip())
    for candidate in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (candidate / "initdb").exists():
            return candidate
    return None


@pytest.fixture
def twin(pgc: PgCluster) -> Iterator[str]:
    """A second PostgreSQL server on 127.0.0.2 with the test server's port and a database
    of the test database's name; yields its conninfo."""
    bindir = _postgres_bindir()
    base = urlsplit(pgc.config.conninfo)
    port = str(base.port or 5432)
    dbname = base.path.lstrip("/")
    if bindir is None or os.geteuid() != 0 or not shutil.which("runuser"):
        unavailable("a second PostgreSQL server needs initdb and root (to run it as postgres)")
    folder = Path(tempfile.mkdtemp(prefix="errands-twin-"))
    shutil.chown(folder, "postgres")
    data = folder / "data"

    def as_postgres(*args: str) -> None:
        done = subprocess.run(
            ["runuser", "-u", "postgres", "--", *args], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, f"{args[0]} failed: {done.stdout}{done.stderr}"

    try:
        as_postgres(str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres",
                    "--no-sync", "-E", "UTF8")  # fmt: skip
        options = (
            f"-c listen_addresses={TWIN_HOST} -c port={port} -c unix_socket_directories={folder} "
            "-c max_connections=10 -c shared_buffers=8MB -c fsync=off"
        )
        as_postgres(str(bindir / "pg_ctl"), "-D", str(data), "-o", options,
                    "-l", str(folder / "log"), "-w", "start")  # fmt: skip
        twin_url = f"postgresql://postgres@{TWIN_HOST}:{port}/postgres"
        with psycopg.connect(twin_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{dbname}"')
            conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{pgc.schema}"')
        yield psycopg.conninfo.make_conninfo(pgc.config.conninfo, host=TWIN_HOST)
    finally:
        subprocess.run(
            ["runuser", "-u", "postgres", "--", str(bindir / "pg_ctl"), "-D", str(data),
             "-m", "immediate", "-w", "stop"],
            capture_output=True, timeout=60, check=False,
        )  # fmt: skip
        shutil.rmtree(folder, ignore_errors=True)


def _jobs(pgc: PgCluster) -> list[Any]:
    return [r[0] for r in pgc.query("SELECT (args->>'n')::int FROM {s}.errands_jobs ORDER BY id")]


def test_connection_to_another_server_with_the_same_database_name_and_port_is_refused(
    pgc: PgCluster, twin: str
) -> None:
    """Same database name, same port, another server: ConfigurationError, nothing written
    on either server, and the caller's open transaction is still usable and commits."""
    app = pgc.app()
    app.queue_stats()  # the jobs tables exist
    with psycopg.connect(twin) as conn:
        conn.execute("CREATE TEMP TABLE orders (id int)")
        conn.execute("INSERT INTO orders VALUES (1)")
        with pytest.raises(errands.ConfigurationError, match="same server and the same database"):
            pgacc_basic.touch.enqueue(n=1, conn=conn)
        conn.execute("INSERT INTO orders VALUES (2)")  # the transaction was not aborted
        assert conn.execute("SELECT count(*) FROM orders").fetchone() == (2,)
        conn.commit()
    assert _jobs(pgc) == []


def test_connections_spelling_the_server_differently_are_accepted_and_asked_once(
    pgc: PgCluster, tmp_path: Path
) -> None:
    """The app connects to 127.0.0.1; a caller's connection through ``localhost`` or the
    Unix socket reaches the same server: accepted, the job commits with the caller's
    transaction; the server is asked once per connection (seen in libpq's trace)."""
    app = pgc.app()
    app.queue_stats()
    spellings = {"localhost": "localhost"}
    port = urlsplit(pgc.config.conninfo).port or 5432
    if os.path.exists(f"/var/run/postgresql/.s.PGSQL.{port}"):
        spellings["unix socket"] = "/var/run/postgresql"
    for n, (label, host) in enumerate(spellings.items(), start=1):
        trace = tmp_path / f"trace-{n}"
        with psycopg.connect(pgc.config.conninfo, host=host) as conn, trace.open("w") as out:
            conn.pgconn.trace(out.fileno())
            conn.execute(f"CREATE TEMP TABLE orders_{n} (id int)")
            conn.execute(f"INSERT INTO orders_{n} VALUES (1)")
            pgacc_basic.touch.enqueue(n=n * 10, conn=conn)
            pgacc_basic.touch.enqueue(n=n * 10 + 1, conn=conn)
            assert conn.execute(f"SELECT count(*) FROM orders_{n}").fetchone() == (1,), label
            conn.commit()
            conn.pgconn.untrace()
        sent = [line for line in trace.read_text().splitlines() if "\tF\t" in line]
        asked = sum("pg_postmaster_start_time" in line for line in sent)
        assert asked == 1, f"{label}: the server was asked {asked} times"
    assert _jobs(pgc) == [v for n in range(1, len(spellings) + 1) for v in (n * 10, n * 10 + 1)]
