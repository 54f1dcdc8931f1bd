"""The chaos soak (issue 10): fixtures, the skip of full-size runs, and the report hook.

Full-size runs are marked ``soak`` and run only when selected (``make soak``, which
passes ``-m soak``, or ``ERRANDS_SOAK=1``); the CI-sized variant runs in ``make test``.
Each run's report is written to its tmp dir and printed in the terminal summary, so it
shows in CI logs without ``-s``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

APPS_DIR = Path(__file__).resolve().parent / "apps"
if str(APPS_DIR) not in sys.path:  # the test process imports the same app as the workers
    sys.path.insert(0, str(APPS_DIR))

REPORTS: list[tuple[str, str]] = []

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


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for title, text in REPORTS:
        terminalreporter.section(title, sep="=")
        for line in text.splitlines():
            terminalreporter.write_line(line)


@pytest.fixture
def soak_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """The store of one soak run: a fresh SQLite file or a fresh PostgreSQL schema."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path}/soak.db"
    from tests.pg import pg_base_url, pg_ready, require_pg

    require_pg()
    deadline = time.monotonic() + 90  # another suite may just be restarting the server
    while not pg_ready(pg_base_url()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return str(request.getfixturevalue("pg_url"))
