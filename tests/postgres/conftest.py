"""Fixtures for the PostgreSQL acceptance tests: a :class:`~harness.PgCluster` per test.

The cluster's processes are killed when the test ends, whatever happened; when the test
fails, every process's stderr is attached to the report.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

APPS_DIR = Path(__file__).resolve().parent / "apps"
if str(APPS_DIR) not in sys.path:  # the test process imports the same apps as the workers
    sys.path.insert(0, str(APPS_DIR))

from .harness import PgCluster  # noqa: E402

CLUSTER_KEY = pytest.StashKey[PgCluster]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Any:
    report = yield
    cluster = item.stash.get(CLUSTER_KEY, None)
    if cluster is not None and report.failed and report.when in ("setup", "call"):
        report.sections.append(("errands processes (stderr tails)", cluster.report()))
    return report


@pytest.fixture
def pgc(pg_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[PgCluster]:
    c = PgCluster(tmp_path, pg_url)
    request.node.stash[CLUSTER_KEY] = c
    try:
        yield c
    finally:
        c.stop_all()
