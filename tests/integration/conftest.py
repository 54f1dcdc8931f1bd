"""Fixtures for the in-process integration tests (a real SQLite file, workers in threads)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import errands

from .helpers import WorkerThread


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
