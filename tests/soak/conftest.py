"""The chaos soak (issue 10): fixtures, the skip of full-size runs, and the report hook.

Full-size runs are marked ``soak`` and run only when selected (``make soak``, which
passes ``-m soak``, or ``ERRANDS_SOAK=1``); the CI-sized variant runs in ``make test``.
Each run's report is written to its tmp dir and printed in the terminal summary, so it
shows in CI logs without ``-s``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SUMMARY_SECTION

APPS_DIR = Path(__file__).resolve().parent / "apps"
if str(APPS_DIR) not in sys.path:  # the test process imports the same app as the workers
    sys.path.insert(0, str(APPS_DIR))

REPORTS: list[tuple[str, str]] = []  # (title, text) of each run, printed in the summary

if sys.platform == "win32":  # SIGKILL, SIGSTOP and friends are POSIX
    collect_ignore_glob = ["test_*.py"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    selected = "soak" in (config.getoption("markexpr", "") or "") or os.environ.get(
        "ERRANDS_SOAK", ""
    ) in ("1", "true", "yes")
    if selected:
        return
    skip = pytest.mark.skip(reason="full-size chaos soak: run it with `make soak`")
    for item in items:
        if item.get_closest_marker("soak") is not None:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Any:
    """The run's report goes into the test report (under xdist, the process that runs the
    test is not the one that prints the summary)."""
    report = yield
    if report.when == "call":
        while REPORTS:
            title, text = REPORTS.pop(0)
            report.sections.append((SUMMARY_SECTION + title, text))
    return report


@dataclass
class SoakStore:
    url: str
    # restarts the PostgreSQL server (mode) -> seconds away; None: no restarts
    restart: Callable[[str], float] | None = None


@pytest.fixture
def soak_store(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[SoakStore]:
    """The store of one soak run: a fresh SQLite file, or a fresh PostgreSQL schema on the
    tests' own cluster (tests/pg.py), which the soak restarts: that disturbs no other
    test and no other user of the machine's server."""
    if backend == "sqlite":
        yield SoakStore(f"sqlite:///{tmp_path}/soak.db")
        return
    from tests.pg import own_server

    url = str(request.getfixturevalue("own_pg_url"))
    yield SoakStore(url, own_server().restart)
