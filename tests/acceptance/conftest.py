"""Fixtures for the acceptance tests: a :class:`~harness.Cluster` per test.

The cluster's processes are killed when the test ends, whatever happened; when the test
fails, every process's stderr is attached to the report.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if sys.platform == "win32":  # SIGKILL, SIGSTOP and friends are POSIX
    collect_ignore_glob = ["test_*.py"]

APPS_DIR = Path(__file__).resolve().parent / "apps"
if str(APPS_DIR) not in sys.path:  # the test process imports the same apps as the workers
    sys.path.insert(0, str(APPS_DIR))

from .harness import Cluster  # noqa: E402

CLUSTER_KEY = pytest.StashKey[Cluster]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Any:
    report = yield
    cluster = item.stash.get(CLUSTER_KEY, None)
    if cluster is not None and report.failed and report.when in ("setup", "call"):
        report.sections.append(("errands processes (stderr tails)", cluster.report()))
    return report


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    request.node.stash[CLUSTER_KEY] = c
    try:
        yield c
    finally:
        c.stop_all()
