"""The chaos soak (issue 10): fixtures, the skip of full-size runs, and the report hook.

Full-size runs are marked ``soak`` and run only when selected (``make soak``, which
passes ``-m soak``, or ``ERRANDS_SOAK=1``); the CI-sized variant runs in ``make test``.
Each run's report is written to its tmp dir and printed in the terminal summary, so it
shows in CI logs without ``-s``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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


@dataclass
class SoakStore:
    url: str
    # restarts the PostgreSQL server (mode) -> seconds away; None: the run finds its own
    restart: Callable[[str], float] | None = None


@pytest.fixture(scope="session")
def scratch_pg() -> Iterator[Any]:
    """A PostgreSQL cluster of the soak's own (initdb in a temporary folder, its own
    port), so that its restarts touch no server anyone else uses; None when it cannot be
    made here (no initdb) or ``SOAK_PG=shared`` asks for ``ERRANDS_TEST_PG_URL``'s."""
    if os.environ.get("SOAK_PG", "scratch") == "shared":
        yield None
        return
    from bench.cluster import ScratchCluster

    try:
        cluster = ScratchCluster()
        cluster.up()
    except Exception as exc:  # no server package here: the shared server, as before
        REPORTS.append(("chaos soak: no private PostgreSQL", f"{type(exc).__name__}: {exc}"))
        yield None
        return
    try:
        yield cluster
    finally:
        with contextlib.suppress(Exception):
            cluster.__exit__(None, None, None)


@pytest.fixture
def soak_store(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[SoakStore]:
    """The store of one soak run: a fresh SQLite file, or a fresh PostgreSQL schema on the
    soak's own cluster (else on the shared test server)."""
    if backend == "sqlite":
        yield SoakStore(f"sqlite:///{tmp_path}/soak.db")
        return
    from tests.pg import pg_base_url, pg_ready, require_pg, wait_pg_ready, with_params

    cluster = request.getfixturevalue("scratch_pg")
    if cluster is not None:
        url = with_params(cluster.url, schema=f"soak_{secrets.token_hex(4)}")

        def restart(mode: str) -> float:
            started = time.monotonic()
            try:
                cluster.restart(mode=mode)
            finally:
                wait_pg_ready(cluster.url)
            return time.monotonic() - started

        yield SoakStore(url, restart)
        return
    require_pg()
    deadline = time.monotonic() + 90  # another suite may just be restarting the server
    while not pg_ready(pg_base_url()) and time.monotonic() < deadline:
        time.sleep(0.5)
    yield SoakStore(str(request.getfixturevalue("pg_url")))
