"""Fixtures for the guarantees that must hold on every path (issue 16): one store per
backend, and workers in threads that the test can stop.

``store`` is an App on a fresh SQLite file or a fresh PostgreSQL schema, so every test
that takes it runs on both backends; ``worker`` starts an in-process worker on it (its
own threads, the real claim loop, completer, lease keeper and maintenance).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import errands
from tests.conftest import running_worker
from tests.pg import fresh_pg_url


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/errands.db"
        return
    yield from fresh_pg_url()


@pytest.fixture
def store(store_url: str) -> Iterator[errands.App]:
    application = errands.App(store_url, lease=3)
    yield application
    application.close()


@pytest.fixture
def worker(store: errands.App) -> Callable[..., Any]:
    """``with worker(**options) as w:`` runs an in-process worker on ``store``."""
    return lambda **options: running_worker(store, **options)
