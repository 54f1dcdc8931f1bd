"""PostgreSQL for tests: one database, a fresh schema per test.

``ERRANDS_TEST_PG_URL`` names the server and database (default below); the database is
created when missing. Outside CI an unreachable server skips PostgreSQL tests with a
reason saying how to enable them; with ``CI=true`` it fails them, since CI must run them.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
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


def fresh_pg_url() -> Iterator[str]:
    """Yield a URL on a new, migrated-on-first-use schema; drop the schema afterwards."""
    require_pg()
    schema = f"t_{secrets.token_hex(6)}"
    try:
        yield with_params(pg_base_url(), schema=schema, auto_migrate="true")
    finally:
        drop_schema(schema)


RESTARTING = ("starting up", "not yet accepting", "shutting down", "Connection refused")


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


# -- the server itself (suites that restart it on purpose) ---------------------------------
def local_cluster(url: str | None = None) -> tuple[str, str] | None:
    """(version, name) of the local ``pg_ctlcluster`` cluster serving ``url`` (default: the
    test URL), or None when it cannot be restarted from here (another host, no
    pg_ctlcluster, not root)."""
    parts = urlsplit(url or pg_base_url())
    if parts.hostname not in ("127.0.0.1", "localhost", "::1"):
        return None
    if not shutil.which("pg_lsclusters") or not shutil.which("pg_ctlcluster"):
        return None
    if os.geteuid() != 0:
        return None
    port = str(parts.port or 5432)
    listing = subprocess.run(["pg_lsclusters", "-h"], capture_output=True, text=True, check=False)
    for line in listing.stdout.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] == port and fields[3].startswith("online"):
            return fields[0], fields[1]
    return None


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


def pg_ctlcluster(cluster: tuple[str, str], action: str, *options: str) -> None:
    done = subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", *cluster, action, *options],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, f"pg_ctlcluster {action} failed: {done.stdout}{done.stderr}"


def restart_postgres(cluster: tuple[str, str], mode: str, url: str | None = None) -> float:
    """``pg_ctlcluster VERSION NAME restart -m MODE``; returns once the server accepts
    connections again, with the seconds it was away as seen from here."""
    started = time.monotonic()
    try:
        pg_ctlcluster(cluster, "restart", "-m", mode)
    finally:
        wait_pg_ready(url)
    return time.monotonic() - started
