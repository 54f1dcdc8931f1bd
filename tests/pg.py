"""PostgreSQL for tests: one database, a schema of its own per test (new, or emptied and
as fresh: SchemaPool).

``ERRANDS_TEST_PG_URL`` names the server and database (default below); the database is
created when missing. Outside CI an unreachable server skips PostgreSQL tests with a
reason saying how to enable them; with ``CI=true`` it fails them, since CI must run them.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn
from urllib.parse import urlsplit, urlunsplit

import pytest

PG_URL_DEFAULT = "postgresql://postgres@127.0.0.1:5432/errands_test"


def pg_base_url() -> str:
    return os.environ.get("ERRANDS_TEST_PG_URL", PG_URL_DEFAULT)


_checked: dict[str, str | None] = {}


def pg_unavailable_reason() -> str | None:
    """None when the test database is reachable (creating it if needed), else why not."""
    url = pg_base_url()
    if url in _checked:
        return _checked[url]
    reason: str | None = None
    try:
        import psycopg
    except ImportError:
        reason = "psycopg is not installed: pip install -e '.[postgres]' (make test does)"
    else:
        try:
            _connect_when_ready(psycopg, url)
        except psycopg.OperationalError as exc:
            if "does not exist" in str(exc):
                parts = urlsplit(url)
                admin = urlunsplit(parts._replace(path="/postgres"))
                try:
                    with psycopg.connect(admin, autocommit=True, connect_timeout=3) as conn:
                        conn.execute(f'CREATE DATABASE "{parts.path.lstrip("/")}"')
                except (psycopg.errors.DuplicateDatabase, psycopg.errors.UniqueViolation):
                    pass  # another test process created it at the same moment (either error)
                except psycopg.Error as create_exc:
                    reason = f"cannot create the test database: {create_exc}"
            else:
                reason = f"PostgreSQL not reachable at {url}: {str(exc).strip().splitlines()[0]}"
    _checked[url] = reason
    return reason


def require_pg() -> None:
    reason = pg_unavailable_reason()
    if reason is not None:
        unavailable(
            f"{reason}. Start PostgreSQL on 127.0.0.1:5432 or set ERRANDS_TEST_PG_URL to run these"
        )


def unavailable(reason: str) -> NoReturn:
    """What a test needs from the machine is missing: under CI=true that fails the test
    (CI must run everything); elsewhere it skips, with ``reason`` saying how to enable it."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true but this test cannot run: {reason}")
    pytest.skip(reason)


def with_params(url: str, **params: str) -> str:
    sep = "&" if "?" in url else "?"
    return url + sep + "&".join(f"{k}={v}" for k, v in params.items())


def drop_schema(schema: str) -> None:
    import psycopg

    with psycopg.connect(pg_base_url(), autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def fresh_pg_url(*, reuse: bool = True) -> Iterator[str]:
    """Yield a URL on a schema of this test's own, migrated on first use (auto_migrate):
    a new one, or one an earlier test of this process left as errands migrates it and
    that was emptied since (see SchemaPool; ``reuse=False``: always a schema that does
    not exist yet). The URL names the schema as its connections' application_name, so
    that the sessions still using it can be seen."""
    require_pg()
    schema = SCHEMAS.take() if reuse else f"t_{secrets.token_hex(6)}"
    try:
        yield with_params(
            pg_base_url(), schema=schema, auto_migrate="true", application_name=schema
        )
    finally:
        SCHEMAS.give_back(schema)


class SchemaPool:
    """Schemas this test process reuses instead of making and dropping one per test.

    The suite runs on two busy cores, and a fresh schema cost ~85 ms of PostgreSQL's CPU
    (20 migrations, then DROP SCHEMA) for each of ~1,150 tests: ~100 s of CPU, a tenth of
    the suite's time. A schema a test is done with is emptied instead (TRUNCATE of the
    tables it wrote, identities restarted: ~15 ms) and handed to the next test of this
    process, but only when nothing tells it apart from a fresh one: no session still
    connected under its name (a worker the test left running), its tables, columns,
    indexes, constraints, triggers and functions as migrating makes them (a test that
    altered or half-migrated it), every migration recorded, no statistics (ANALYZE, which
    TRUNCATE keeps: the plan tests). Anything else, or an error, drops it, as before.
    """

    SESSIONS_GONE_WITHIN = 2.0  # seconds the test's own sessions may take to end
    KEEP = 4  # schemas kept at most

    def __init__(self) -> None:
        self.free: list[str] = []
        self.reference: str | None = None  # a freshly migrated schema's fingerprint
        atexit.register(self.close)

    def take(self) -> str:
        return self.free.pop() if self.free else f"t_{secrets.token_hex(6)}"

    def give_back(self, schema: str) -> None:
        try:
            reused = len(self.free) < self.KEEP and self._empty(schema)
        except Exception:  # a broken connection, a lock wait that ran out: not reused
            reused = False
        if reused:
            self.free.append(schema)
        else:
            drop_schema(schema)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            for schema in self.free:
                drop_schema(schema)
        self.free.clear()

    def _empty(self, schema: str) -> bool:
        import psycopg

        with psycopg.connect(pg_base_url(), autocommit=True) as conn:
            deadline = time.monotonic() + self.SESSIONS_GONE_WITHIN
            while _sessions(conn, schema):
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)
            if self.reference is None:
                self.reference = _migrated_fingerprint(conn)
            relations, procs = _objects(conn, schema)
            if _fingerprint(conn, schema, (relations, procs)) != self.reference:
                return False
            written = [
                name
                for (name,) in conn.execute(
                    "SELECT relname FROM pg_class WHERE oid = ANY(%s::oid[]) AND relkind = 'r'"
                    " AND relname <> 'errands_migrations' AND pg_relation_size(oid) > 0",
                    (relations,),
                )
            ]
            if written:
                with conn.transaction():
                    conn.execute("SET LOCAL lock_timeout = '2s'")
                    names = ", ".join(f'"{schema}"."{name}"' for name in written)
                    conn.execute(f"TRUNCATE {names} RESTART IDENTITY")
            # Every sequence from 1 again, also one whose table holds nothing (a failed
            # insert took a value; a TRUNCATE without RESTART IDENTITY emptied it).
            conn.execute(
                "SELECT setval(oid, 1, false) FROM pg_class"
                " WHERE oid = ANY(%s::oid[]) AND relkind = 'S'",
                (relations,),
            )
            # A session of another name (a plain connection, a results listener) that
            # holds a lock on one of its tables: a transaction still open on it.
            locked = conn.execute(
                "SELECT count(*) FROM pg_locks"
                " WHERE relation = ANY(%s::oid[]) AND pid <> pg_backend_pid()",
                (relations,),
            ).fetchone()
            return _sessions(conn, schema) == 0 and not (locked and locked[0])


def _sessions(conn: Any, schema: str) -> int:
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE application_name = %s AND pid <> pg_backend_pid()",
        (schema,),
    ).fetchone()
    return int(row[0])


# What makes a schema errands' (its name left out): its relations, columns, indexes,
# constraints, triggers and functions, the migrations it records, and whether statistics
# were taken. Each catalog is read through its index by the objects' ids (found through
# pg_depend), never scanned: autovacuum is off on the CI machines, and the catalogs grow
# by every schema made and dropped (pg_attribute had 1.4 million dead rows after a few
# runs that made one per test): one scan of them took ~200 ms.
OBJECTS_SQL = """
SELECT d.classid = 'pg_proc'::regclass, d.objid FROM pg_depend d
WHERE d.refclassid = 'pg_namespace'::regclass AND d.refobjsubid = 0
  AND d.refobjid = (SELECT oid FROM pg_namespace WHERE nspname = %(schema)s)
  AND d.classid IN ('pg_class'::regclass, 'pg_proc'::regclass)
"""
FINGERPRINT_SQL = """
WITH items AS (
    SELECT c.relname || ':' || c.relkind::text || ':' || c.relpersistence::text || ':'
           || COALESCE(array_to_string(c.reloptions, ','), '')
           -- a table's estimates (an ANALYZE of an empty table writes no statistics)
           || CASE WHEN c.relkind = 'r' THEN ':' || c.reltuples || ':' || c.relallvisible
                   ELSE '' END AS item
    FROM pg_class c WHERE c.oid = ANY(%(all)s::oid[])
    UNION ALL
    SELECT a.attrelid::regclass::text || '.' || a.attname || ':'
           || format_type(a.atttypid, a.atttypmod) || ':' || a.attnotnull
    FROM pg_attribute a
    WHERE a.attrelid = ANY(%(all)s::oid[]) AND a.attnum > 0 AND NOT a.attisdropped
    UNION ALL
    SELECT d.adrelid::regclass::text || '.' || d.adnum || ':' || pg_get_expr(d.adbin, d.adrelid)
    FROM pg_attrdef d WHERE d.adrelid = ANY(%(rels)s::oid[])
    UNION ALL
    SELECT pg_get_indexdef(i.indexrelid) FROM pg_index i
    WHERE i.indrelid = ANY(%(rels)s::oid[])
    UNION ALL
    SELECT conname || ':' || pg_get_constraintdef(oid) FROM pg_constraint
    WHERE conrelid = ANY(%(rels)s::oid[])
    UNION ALL
    SELECT tgname || ':' || tgenabled::text || ':' || pg_get_triggerdef(oid) FROM pg_trigger
    WHERE tgrelid = ANY(%(rels)s::oid[])
    UNION ALL
    SELECT proname || ':' || provolatile::text || ':' || prosecdef || ':'
           || COALESCE(array_to_string(proconfig, ','), '') || ':'
           || md5(replace(prosrc, %(schema)s, '~')) FROM pg_proc
    WHERE oid = ANY(%(procs)s::oid[])
    UNION ALL
    SELECT 'statistics taken' FROM pg_statistic WHERE starelid = ANY(%(rels)s::oid[])
)
SELECT md5(string_agg(replace(item, %(schema)s, '~'), '|' ORDER BY item)) FROM items
"""


def _objects(conn: Any, schema: str) -> tuple[list[int], list[int]]:
    """The ids of the schema's tables and sequences, and of its functions."""
    objects = conn.execute(OBJECTS_SQL, {"schema": schema}).fetchall()
    return [oid for is_proc, oid in objects if not is_proc], [
        oid for is_proc, oid in objects if is_proc
    ]


def _fingerprint(
    conn: Any, schema: str, objects: tuple[list[int], list[int]] | None = None
) -> str | None:
    """The schema's fingerprint, and the migrations it records (None: not errands');
    ``objects``: its _objects, when the caller has read them."""
    with conn.transaction():
        conn.execute("SET LOCAL enable_seqscan = off")  # (the catalogs' statistics are old)
        rels, procs = objects if objects is not None else _objects(conn, schema)
        indexes = conn.execute(
            "SELECT indexrelid FROM pg_index WHERE indrelid = ANY(%s::oid[])", (rels,)
        ).fetchall()
        every = rels + [oid for (oid,) in indexes]
        row = conn.execute(
            FINGERPRINT_SQL, {"schema": schema, "rels": rels, "procs": procs, "all": every}
        ).fetchone()
        exists = conn.execute(
            "SELECT to_regclass(format('%%I.errands_migrations', %s::text)) IS NOT NULL",
            (schema,),
        ).fetchone()
        if row is None or row[0] is None or exists is None or not exists[0]:
            return None
        versions = conn.execute(
            "SELECT string_agg(version::text, ',' ORDER BY version)"
            f' FROM "{schema}".errands_migrations'
        ).fetchone()
    return f"{row[0]}/{versions[0] if versions else ''}"


def _migrated_fingerprint(conn: Any) -> str | None:
    """The fingerprint of a schema errands has just migrated (made, read, dropped)."""
    import errands

    schema = f"t_{secrets.token_hex(6)}"
    try:
        app = errands.App(with_params(pg_base_url(), schema=schema))
        try:
            app.migrate()
        finally:
            app.close()
        return _fingerprint(conn, schema)
    finally:
        drop_schema(schema)


SCHEMAS = SchemaPool()


RESTARTING = ("starting up", "not yet accepting", "shutting down", "Connection refused")


def fresh_schema_conn() -> Iterator[tuple[Any, dict[str, str]]]:
    """A migrated schema on a fresh URL: an autocommit connection whose search_path is
    that schema, and the backend's queries (markers filled) for it. For the plan tests:
    they fill the tables by SQL and read EXPLAIN ANALYZE."""
    import psycopg

    import errands

    for url in fresh_pg_url():
        app = errands.App(url)
        try:
            app.migrate()
            backend: Any = app.backend
            with psycopg.connect(backend.config.conninfo, autocommit=True) as conn:
                conn.execute(f'SET search_path TO "{backend.schema}"')
                yield conn, backend.q
        finally:
            app.close()


def plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every node of an EXPLAIN (FORMAT JSON) plan, depth first."""
    yield plan
    for child in plan.get("Plans", []):
        yield from plan_nodes(child)


def _connect_when_ready(psycopg: Any, url: str, wait: float = 60.0) -> None:
    """Connect once, waiting while the server restarts (some suites restart it on purpose)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            psycopg.connect(url, connect_timeout=3).close()
            return
        except psycopg.OperationalError as exc:
            if time.monotonic() > deadline or not any(t in str(exc) for t in RESTARTING):
                raise
            time.sleep(0.5)


# -- a server of the tests' own (suites that restart it on purpose) ------------------------
class OwnServer:
    """A PostgreSQL cluster this test process owns: initdb in a temporary folder, its own
    loopback port, deleted when the process exits (bench.cluster.ScratchCluster). Suites
    that restart, stop or crash the server do it to this one, never to the shared server
    that other tests (other xdist workers) and other people use at the same time."""

    def __init__(self) -> None:
        from bench.cluster import ScratchCluster

        self._cluster = ScratchCluster()
        self._cluster.up()
        self.url = self._cluster.url
        self.closed = False
        self._watch_owner()

    def _watch_owner(self) -> None:
        """A watchdog process that stops the cluster and deletes its folder once this test
        process is gone, however it ended: pytest-timeout's thread method ends a process
        with os._exit, which runs no atexit (the normal path, close(), is unchanged)."""
        c = self._cluster
        stop = [str(c.bin / "pg_ctl"), "-D", str(c.data), "-m", "immediate", "-w", "stop"]
        script = (
            "import os, shutil, subprocess, sys, time\n"
            f"owner, folder, stop = {os.getpid()}, {str(c.dir)!r}, {stop!r}\n"
            "while True:\n"
            "    try:\n"
            "        os.kill(owner, 0)\n"
            "    except ProcessLookupError:\n"
            "        break\n"
            "    if not os.path.isdir(folder):\n"
            "        sys.exit(0)\n"  # closed normally: nothing to do
            "    time.sleep(1)\n"
            "if os.path.isdir(folder):\n"
            "    subprocess.run(stop, capture_output=True, timeout=60,\n"
            f"                   user={c.user!r})\n"
            "    shutil.rmtree(folder, ignore_errors=True)\n"
        )
        self._watchdog = subprocess.Popen(
            [sys.executable, "-c", script],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # outlives its owner, and no signal to the group hits it
        )

    def stop(self, mode: str = "fast") -> None:
        self._cluster.stop(mode)

    def start(self) -> None:
        """Start the server unless it is up; returns once it accepts connections."""
        if not pg_ready(self.url):
            self._cluster.start()
            wait_pg_ready(self.url)

    def restart(self, mode: str) -> float:
        """Stop (``fast``, or ``immediate``: a crash and recovery) and start again; returns
        once the server accepts connections, with the seconds it was away."""
        started = time.monotonic()
        try:
            self.stop(mode)
        finally:
            self.start()
        return time.monotonic() - started

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._cluster.__exit__(None, None, None)
            # Kept and reaped here: a Popen collected while its process runs warns
            # (ResourceWarning, an error under the suite's filterwarnings). With the
            # folder gone it leaves within a second.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._watchdog.wait(timeout=5)


_own: list[OwnServer] = []


def own_server() -> OwnServer:
    """The test process's own PostgreSQL cluster, started on first use (a few seconds)."""
    if not _own:
        try:
            import psycopg  # noqa: F401
        except ImportError:
            unavailable("psycopg is not installed: pip install -e '.[postgres]' (make test does)")
        try:
            server = OwnServer()
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            unavailable(
                f"cannot start a PostgreSQL cluster of the tests' own ({exc}); these tests "
                "restart PostgreSQL, which needs the server package's initdb and pg_ctl"
            )
        atexit.register(server.close)
        _own.append(server)
    return _own[0]


def own_server_of(url: str) -> OwnServer | None:
    """The tests' own cluster when ``url`` points at it, else None (a server the tests
    must not restart)."""
    if _own and urlsplit(url).port == urlsplit(_own[0].url).port:
        return _own[0]
    return None


def fresh_own_pg_url() -> Iterator[str]:
    """Like fresh_pg_url, on the test process's own cluster (which the test may restart)."""
    import psycopg

    server = own_server()
    schema = f"t_{secrets.token_hex(6)}"
    try:
        yield with_params(server.url, schema=schema, auto_migrate="true")
    finally:
        wait_pg_ready(server.url)
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def pg_ready(url: str | None = None) -> bool:
    """Whether the server at ``url`` (default: the test URL) accepts a connection now."""
    import psycopg

    try:
        psycopg.connect(url or pg_base_url(), connect_timeout=2).close()
    except psycopg.OperationalError:
        return False
    return True


def wait_pg_ready(url: str | None = None, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not pg_ready(url):
        if time.monotonic() > deadline:
            raise AssertionError(f"PostgreSQL did not accept connections within {timeout:g} s")
        time.sleep(0.1)


def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """``call()`` on a thread of its own, started: what it returned (``result``) or raised
    (``error``), once the thread is joined."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = call()
        except BaseException as exc:  # handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    return thread, outcome
