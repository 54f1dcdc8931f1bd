"""A worker whose claims failed (the store away) backs off, and a notification (a job
committed: the store answers again) ends the backoff at once, on the file-backed SQLite
store whose commits the worker watches."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from psycopg import OperationalError

import errands

from .helpers import wait_until


def test_a_claim_backoff_ends_when_a_notification_shows_the_store_answers_again(
    app: errands.App, worker_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's first claims fail (the store away); its retry waits start at the poll
    interval, here 10 minutes. A job enqueued once the store is back is announced to the
    worker, which claims it at once instead of sleeping the backoff out."""
    failing = threading.Event()
    failing.set()
    failed = []
    real_claim = app.backend.job_claim

    def claim(params: Any) -> Any:
        if failing.is_set():
            failed.append(params)
            raise OperationalError("the store is away (injected)")
        return real_claim(params)

    monkeypatch.setattr(app.backend, "job_claim", claim)
    ran = threading.Event()

    @app.job(name="backoff.ping")
    def ping() -> None:
        ran.set()

    with worker_factory(poll_interval=600.0, concurrency=2):
        wait_until(lambda: failed, timeout=60, what="a failed claim")
        failing.clear()
        ping.enqueue()
        assert ran.wait(60), "the job waited out the claim backoff (600 s)"
    assert failed  # the claims before it did fail
