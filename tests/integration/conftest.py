"""Fixtures for the in-process integration tests (a real SQLite file, workers in threads)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import errands

from .helpers import WorkerThread, results_app


@pytest.fixture
def start_worker(app: errands.App) -> Iterator[Callable[..., WorkerThread]]:
    """Start a worker in a thread; the test may stop it itself, teardown stops the rest."""
    started: list[WorkerThread] = []

    def start(**options: Any) -> WorkerThread:
        worker = WorkerThread(app, **options).start()
        started.append(worker)
        return worker

    yield start
    for worker in started:
        if worker.thread.is_alive():
            worker.stop()


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, db_url: str) -> Iterator[errands.App]:
    """A :func:`results_app` on each store: an SQLite file, a fresh PostgreSQL schema."""
    if request.param == "sqlite":
        app = results_app(db_url)
        yield app
        app.close()
        return
    from tests.pg import fresh_pg_url

    for url in fresh_pg_url():
        app = results_app(url)
        yield app
        app.close()
