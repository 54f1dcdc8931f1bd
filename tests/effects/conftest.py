"""Fixtures for the effectively-once tests (issue 4), on SQLite and PostgreSQL alike.

``store_url`` is parametrised over both backends: a fresh SQLite file, or a fresh
PostgreSQL schema (``pg_url``), waiting for the server first when another test suite has
just restarted it. ``effects`` is the same database seen through its own connection
(:class:`effects_store.EffectsStore`), for the handlers' effect tables and for checks in
SQL. ``Storm`` runs real ``errands worker`` processes under a supervisor loop that
restarts them when they die (see test_kill_storms.py).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
APPS_DIR = HERE / "apps"
ACCEPTANCE_APPS = HERE.parent / "acceptance" / "apps"
for folder in (APPS_DIR, ACCEPTANCE_APPS):  # the acceptance harness imports its own apps
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from effects_store import EffectsStore  # noqa: E402

import errands  # noqa: E402

from .storm import Storm, wait_for_postgres  # noqa: E402

BACKENDS = ("sqlite", "postgres")


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if backend == "sqlite":
        return f"sqlite:///{tmp_path}/errands.db"
    wait_for_postgres()
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture
def effects(store_url: str) -> Iterator[EffectsStore]:
    """The test's database through a connection of its own (errands' schema created first,
    so effect tables can live beside it)."""
    migrator = errands.App(store_url)
    migrator.migrate()
    migrator.close()
    store = EffectsStore(store_url)
    yield store
    store.close()


@pytest.fixture
def make_app(store_url: str) -> Iterator[Callable[..., errands.App]]:
    """``make_app(**options)``: a new App on this test's store, closed at the end."""
    made: list[errands.App] = []

    def make(**options: Any) -> errands.App:
        application = errands.App(store_url, **options)
        made.append(application)
        return application

    yield make
    for application in made:
        application.close()


@pytest.fixture
def storm_factory(tmp_path: Path) -> Iterator[Callable[..., Storm]]:
    made: list[Storm] = []

    def make(store_url: str, effects_url: str, faults: str = "") -> Storm:
        folder = tmp_path / f"storm{len(made)}"
        folder.mkdir()
        storm = Storm(folder, store_url, effects_url, faults)
        made.append(storm)
        return storm

    yield make
    for storm in made:
        storm.stop()
