"""A worker whose claims failed (the store away) backs off, and a notification (a job
committed: the store answers again) ends the backoff at once, on the file-backed SQLite
store whose commits the worker watches."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from typing import Any

import pytest
from psycopg import OperationalError

import errands
from errands.worker import worker as worker_module
from errands.worker.claiming import Claimer

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


def test_claims_failing_while_other_writers_commit_back_off_and_warn_once_per_retry_max(
    app: errands.App,
    worker_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """This worker's claims fail (a local I/O error: its file-size limit) while another
    writer commits every 20 ms. Each commit's notification ended the backoff: claims went
    every 0.25 s, each with its own "retrying in 2.0 s" warning (38 in 10 s). A claim that
    fails after a notification shows the notifications prove nothing here: the backoff
    then runs its course, and the warning comes once per CLAIM_RETRY_MAX."""
    failed: list[float] = []  # each claim round's start (it claims suspects, then jobs)

    def claim(params: Any) -> Any:
        raise sqlite3.OperationalError("disk I/O error (injected)")

    monkeypatch.setattr(app.backend, "job_claim", claim)
    claim_round = Claimer.claim

    def counted(self: Claimer, *args: Any, **kwargs: Any) -> Any:
        failed.append(time.monotonic())
        return claim_round(self, *args, **kwargs)

    monkeypatch.setattr(Claimer, "claim", counted)

    @app.job(name="backoff.elsewhere", queue="served-by-no-one")
    def elsewhere() -> None:
        pass

    stop = threading.Event()

    def commit_often() -> None:
        while not stop.wait(0.02):
            elsewhere.enqueue()

    committer = threading.Thread(target=commit_often, daemon=True)
    caplog.set_level(logging.WARNING, logger="errands.worker")
    with worker_factory(poll_interval=0.05, concurrency=2):
        wait_until(lambda: failed, timeout=60, what="a failed claim")
        committer.start()
        try:
            time.sleep(5)  # the test counts what happens in this window, whatever its pace
        finally:
            stop.set()
            committer.join(10)
        start, end = failed[0], time.monotonic()
        claims = len([t for t in failed if t <= end])
    warnings = [r for r in caplog.records if r.getMessage().startswith("claim failed")]
    # the backoffs double from the poll interval to CLAIM_RETRY_MAX: the claims they allow
    # in the window, plus one a notification may bring forward, plus the first
    allowed, waited, pause = 2, 0.0, 0.05
    while waited <= end - start:
        waited += pause
        pause = min(pause * 2, worker_module.CLAIM_RETRY_MAX)
        allowed += 1
    assert claims <= allowed, (claims, allowed, [round(t - start, 3) for t in failed])
    assert len(warnings) <= (end - start) / worker_module.CLAIM_RETRY_MAX + 2, [
        r.getMessage() for r in warnings
    ]
