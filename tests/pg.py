"""PostgreSQL for tests: one database, a fresh schema per test.

``ERRANDS_TEST_PG_URL`` names the server and database (default below); the database is
created when missing. Outside CI an unreachable server skips PostgreSQL tests with a
reason saying how to enable them; with ``CI=true`` it fails them, since CI must run them.
"""

from __future__ import annotations

import os
import secrets
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
