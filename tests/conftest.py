"""Fixtures shared by every test layer.

``db_url`` is a fresh SQLite file per test. ``app`` is an App on it. ``running_worker``
runs an in-process worker in a thread for integration tests and stops it gracefully.
Acceptance tests start real ``errands worker`` processes instead (tests/acceptance).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import errands
from errands.worker.worker import Worker

# pydantic looks for plugins (entry points of every installed distribution) when it builds
# a process's first model: ~25 ms of CPU in each of the ~1,000 processes a run starts
# (workers, their forkservers, CLI calls) in a venv this size. No test uses a plugin; the
# processes the tests start inherit the setting.
os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")


@pytest.fixture(autouse=True)
def _switch_interval_kept() -> Iterator[None]:
    """A test that runs a worker command in this process (CliRunner, Flask's CLI) sets
    the worker's GIL switch interval (errands.worker.switching): put back after it, so
    the next tests run at the one they started with."""
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


@pytest.fixture
def db_url(tmp_path: Any) -> str:
    return f"sqlite:///{tmp_path}/errands.db"


@pytest.fixture
def app(db_url: str) -> Iterator[errands.App]:
    application = errands.App(db_url)
    yield application
    application.close()


@contextmanager
def running_worker(app: errands.App, **options: Any) -> Iterator[Worker]:
    """Run a worker in a background thread; stop it gracefully on exit."""
    options.setdefault("poll_interval", 0.05)
    options.setdefault("maintenance_tick", 0.1)
    worker = app.worker(**options)
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(timeout=30)
        assert not thread.is_alive(), "worker did not stop within 30 s"


def cancel_while_inserting(
    monkeypatch: pytest.MonkeyPatch,
    backend: Any,
    insert: str,
    enqueue: Callable[[], Awaitable[Any]],
) -> None:
    """Run ``enqueue()`` as a task and cancel it while the store's ``insert`` method (made
    to take 0.5 s) runs in its thread: the insert is sent, the awaiting task cancelled."""
    original = getattr(backend, insert)
    started = threading.Event()

    def slow_insert(what: Any, conn: Any = None) -> Any:
        started.set()
        time.sleep(0.5)
        return original(what, conn=conn)

    monkeypatch.setattr(backend, insert, slow_insert)

    async def scenario() -> None:
        task = asyncio.ensure_future(enqueue())
        await asyncio.to_thread(started.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())


# A host suspend, for the tests of errands.clock's users (Linux: CLOCK_BOOTTIME).
needs_boottime = pytest.mark.skipif(
    not hasattr(time, "CLOCK_BOOTTIME"),
    reason="no CLOCK_BOOTTIME here: errands.clock is time.monotonic, which a suspend stops",
)


def suspend_host(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """From now on, as if this host had just been suspended for ``seconds``: the clock
    that counts a suspend (CLOCK_BOOTTIME) is that much further on, while
    ``time.monotonic()`` (CLOCK_MONOTONIC, which a suspend stops) and every sleep and
    wait are as they were."""
    boottime, real = time.CLOCK_BOOTTIME, time.clock_gettime

    def clock_gettime(clock_id: int) -> float:
        return real(clock_id) + (seconds if clock_id == boottime else 0.0)

    monkeypatch.setattr(time, "clock_gettime", clock_gettime)


class LoopTicks:
    """A task that ticks every 10 ms: the longest gap between ticks is how long the event
    loop was blocked."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            self.longest, last = max(self.longest, now - last), now

    def __enter__(self) -> LoopTicks:
        self._task = asyncio.ensure_future(self._tick())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


@pytest.fixture
def worker_factory(app: errands.App) -> Any:
    return lambda **options: running_worker(app, **options)


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A PostgreSQL URL on a fresh schema (skipped outside CI when no server is reachable)."""
    from tests.pg import fresh_pg_url

    yield from fresh_pg_url()


@pytest.fixture
def new_pg_url() -> Iterator[str]:
    """As pg_url, on a schema that does not exist until errands makes it (never one an
    earlier test used and emptied): for what a store errands never migrated shows."""
    from tests.pg import fresh_pg_url

    yield from fresh_pg_url(reuse=False)


@pytest.fixture(params=["sqlite", "postgres"])
def each_store_url(request: pytest.FixtureRequest, db_url: str) -> str:
    """A fresh store on each backend: the test's SQLite file, a fresh PostgreSQL schema."""
    return db_url if request.param == "sqlite" else str(request.getfixturevalue("pg_url"))


@pytest.fixture
def own_pg_url() -> Iterator[str]:
    """A fresh schema on the tests' own PostgreSQL cluster, which the test may restart."""
    from tests.pg import fresh_own_pg_url

    yield from fresh_own_pg_url()


# -- reports a test sends to the summary (the chaos soak's), also from xdist workers --------
SUMMARY_SECTION = "chaos soak report: "  # tests/soak/conftest.py puts them in the report
PRINTED: list[tuple[str, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for name, text in report.sections:
        if name.startswith(SUMMARY_SECTION):
            PRINTED.append((name.removeprefix(SUMMARY_SECTION), text))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The PostgreSQL schemas this process kept for reuse are dropped (tests/pg.py; an
    xdist worker process ends without running atexit's functions)."""
    pg = sys.modules.get("tests.pg")
    if pg is not None:
        pg.SCHEMAS.close()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for title, text in PRINTED:
        terminalreporter.section(title, sep="=")
        for line in text.splitlines():
            terminalreporter.write_line(line)


# -- the CPU each test spends (ERRANDS_TEST_CPU_LOG=path) ---------------------------------------
# The suite runs on two cores, busy to the end: its time is its CPU. With this variable
# set, each test appends a line to the file: its node id, then the seconds of CPU of the
# test process (its threads: in-process workers) and of the processes it started and
# waited for (workers, CLI calls, their children), and its wall time. The tests that cost
# the most CPU, not the ones that wait longest, are the ones to make cheaper.
CPU_LOG = os.environ.get("ERRANDS_TEST_CPU_LOG")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    if not CPU_LOG:
        yield
        return
    import resource

    def cpu(who: int) -> float:
        usage = resource.getrusage(who)
        return usage.ru_utime + usage.ru_stime

    own, children, began = (
        cpu(resource.RUSAGE_SELF),
        cpu(resource.RUSAGE_CHILDREN),
        time.monotonic(),
    )
    yield
    line = (
        f"{item.nodeid}\t{cpu(resource.RUSAGE_SELF) - own:.2f}\t"
        f"{cpu(resource.RUSAGE_CHILDREN) - children:.2f}\t{time.monotonic() - began:.2f}\n"
    )
    with open(CPU_LOG, "a") as out:
        out.write(line)


# -- the order the xdist workers take tests in ------------------------------------------------
# `make test` runs `pytest -n 6 --dist loadgroup`: the scheduler hands each process the
# next test (or the next xdist_group, whole) in collection order as it frees up. The tests
# on the tests' own PostgreSQL cluster (xdist_group "own_postgres": the CI-sized soak, the
# fault and reconnect suites, several minutes in one process) go first; then the test
# modules, the longest first (the time of their tests in a clean-clone CI run:
# tests/durations.json, tests of a second or more, setup and teardown included; a test
# not in it counts as quick), each module's tests together and in their order (its
# module-scoped fixtures are made once a process). In collection order the long modules
# of the folders collected last (tests/postgres, tests/soak) ended the run on a few
# processes while the others sat idle: the last three minutes of a run were 35-85 %
# idle. Refresh the file from a run's `--durations=0` when it drifts: an out-of-date
# entry only moves a module in the order.
FIRST_GROUP = "own_postgres"
DURATIONS: dict[str, float] = json.loads((Path(__file__).parent / "durations.json").read_text())


def _in_first_group(item: pytest.Item) -> bool:
    return any(mark.args[:1] == (FIRST_GROUP,) for mark in item.iter_markers("xdist_group"))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    weight: dict[str, float] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        weight[module] = weight.get(module, 0.0) + DURATIONS.get(item.nodeid.split("@")[0], 0.0)

    def order(item: pytest.Item) -> tuple[int, float]:
        if _in_first_group(item):
            return (0, 0.0)
        return (1, -weight[item.nodeid.split("::", 1)[0]])

    items.sort(key=order)  # stable: a module's tests keep their order
    _refuse_ungrouped(config, items)


UNGROUPED = pytest.StashKey[str]()


def _refuse_ungrouped(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``--dist loadgroup`` an xdist worker marks each grouped test's node id
    (``...@own_postgres``) and the scheduler hands a group to one process. pytest 9.2
    ignores that mark (pytest-xdist#1386): the groups were split silently: the benches
    that make and drop the same databases ran side by side, each process that got a test
    restarting PostgreSQL made a cluster of its own, and test_bad_cli's fixture (~40
    interpreters) ran three times. Such a test now fails at its setup, saying why."""
    if not (os.environ.get("PYTEST_XDIST_WORKER") and config.getvalue("loadgroup")):
        return
    for item in items:
        if item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid:
            item.stash[UNGROUPED] = (
                f"--dist loadgroup does not group this test on pytest {pytest.__version__} "
                "(pytest-xdist#1386): it would run beside the others of its xdist_group. "
                "Install the versions pyproject.toml's dev extra pins "
                "(pip install -e '.[dev,postgres]'), or run with -n 0"
            )


def pytest_runtest_setup(item: pytest.Item) -> None:
    reason = item.stash.get(UNGROUPED, None)
    if reason is not None:
        pytest.fail(reason, pytrace=False)
