"""Fixtures for the issue-5 tests: one store URL per backend, workers, CLI processes.

``store_url`` is parametrised over SQLite and PostgreSQL, so every test that takes it (or
``store``, an App on it) runs on both. Other suites restart the PostgreSQL server now and
then: before a PostgreSQL test the server is waited for, and a PostgreSQL test that fails
while the server restarted is run again (at most twice), its failure report saying so.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _pytest.runner import runtestprotocol

import errands
from tests.pg import pg_base_url, require_pg, with_params

from .helpers import (  # also puts the worker apps' folders on sys.path
    LimitsCluster,
    drop_schema_when_possible,
    postgres_started_at,
    wait_for_postgres,
)

PG_START_KEY = pytest.StashKey[object]()
PG_RESTARTED_KEY = pytest.StashKey[bool]()
CLUSTER_KEY = pytest.StashKey[LimitsCluster]()
RERUNS_AFTER_RESTART = 2
HERE = Path(__file__).resolve().parent


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty store on each backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/errands.db"
        return
    yield from fresh_postgres_url(request)


def fresh_postgres_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """Like the shared ``pg_url`` (a fresh schema, auto-migrated, dropped afterwards), but
    waiting for the server before the test and before dropping the schema."""
    wait_for_postgres()
    require_pg()
    request.node.stash[PG_START_KEY] = postgres_started_at()
    schema = f"t_{secrets.token_hex(6)}"
    try:
        yield with_params(pg_base_url(), schema=schema, auto_migrate="true")
    finally:
        drop_schema_when_possible(schema)


@pytest.fixture
def store(store_url: str) -> Iterator[errands.App]:
    """An App on ``store_url``; tests register their jobs on it."""
    application = errands.App(store_url, lease=2)
    yield application
    application.close()


@pytest.fixture
def cluster(store_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """Real ``errands worker`` processes on ``store_url`` (killed when the test ends)."""
    c = LimitsCluster(tmp_path, store_url)
    request.node.stash[CLUSTER_KEY] = c
    try:
        yield c
    finally:
        c.stop_all()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Any:
    report = yield
    if report.failed and report.when in ("setup", "call"):
        cluster = item.stash.get(CLUSTER_KEY, None)
        if cluster is not None:
            report.sections.append(("errands processes (stderr tails)", cluster.report()))
        started = item.stash.get(PG_START_KEY, None)
        if started is not None and postgres_started_at() != started:
            item.stash[PG_RESTARTED_KEY] = True
            report.sections.append(
                ("PostgreSQL", "the server restarted during this test (another suite?)")
            )
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    """Run a PostgreSQL test again when it failed while the server restarted under it."""
    callspec = getattr(item, "callspec", None)
    if (
        HERE not in item.path.parents  # the hook sees every test of the session
        or callspec is None
        or callspec.params.get("store_url") != "postgres"
    ):
        return None
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for attempt in range(RERUNS_AFTER_RESTART + 1):
        item.stash[PG_RESTARTED_KEY] = False
        reports = runtestprotocol(item, nextitem=nextitem, log=False)
        failed = any(r.failed for r in reports if r.when in ("setup", "call"))
        if not (failed and item.stash[PG_RESTARTED_KEY]) or attempt == RERUNS_AFTER_RESTART:
            break
        item.user_properties.append(("rerun_after_postgres_restart", attempt + 1))
    for report in reports:
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True
