"""The embedded worker (a thread of the web process: Flask, FastAPI, Django's test
helpers): a start that times out leaves nothing running, and a worker that died while the
block ran says so when the block ends."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import errands
from errands.contrib._embedded import EmbeddedWorker


def test_a_start_that_times_out_stops_the_worker_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """start() raised on its timeout and left the worker's thread running: no one had the
    object to stop it, and it claimed jobs (in later tests too) and held connections."""
    app = errands.App(f"sqlite:///{tmp_path / 'e.db'}")
    app.migrate()
    real_check = app.backend.schema_check

    def slow_check() -> None:
        time.sleep(1.0)  # a slow store: the worker starts after start() gave up
        real_check()

    monkeypatch.setattr(app.backend, "schema_check", slow_check)
    embedded = EmbeddedWorker(app, poll_interval=0.05)
    with pytest.raises(errands.ConfigurationError, match="did not start within"):
        embedded.start(timeout=0.2)
    assert not embedded.running  # stopped, its thread joined
    app.close()


def test_a_worker_that_died_in_the_block_fails_the_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's thread ended with an exception while the block ran: the block ended
    as if the worker had run all along (the error was kept, never raised)."""
    app = errands.App(f"sqlite:///{tmp_path / 'e.db'}")
    embedded = EmbeddedWorker(app, poll_interval=0.05)
    worker = embedded.worker

    def dies(install_signals: bool = True) -> int:
        worker.started_at = time.time()  # started, then its loop breaks
        raise RuntimeError("boom")

    monkeypatch.setattr(worker, "run", dies)
    failed = pytest.raises(errands.ConfigurationError, match="failed while running: boom")
    with failed, embedded:
        embedded.thread.join(5)  # type: ignore[union-attr]
    app.close()
