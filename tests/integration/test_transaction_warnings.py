"""Warnings for the two ways ``ctx.transaction()`` is easy to misuse (issue 16, A13)."""

from __future__ import annotations

import logging
import time

import pytest

import errands

from .helpers import wait_until


def test_a_sqlite_transaction_held_past_a_third_of_the_lease_is_warned_about(
    db_url: str, worker_factory: object, caplog: pytest.LogCaptureFixture
) -> None:
    """On SQLite an open ctx.transaction() holds the database's write lock, so no
    heartbeat of the worker gets through: held past a third of the lease, the worker
    warns, naming the job (past the whole lease, every handler would be self-fenced)."""
    app = errands.App(db_url, lease=1.5)
    warning = "held ctx.transaction() open"

    @app.job(name="warn.long_tx")
    def long_tx(ctx: errands.Context) -> None:
        ctx.transaction()
        deadline = time.monotonic() + 20  # hold it until the worker has said so
        while warning not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.02)

    from tests.conftest import running_worker

    try:
        with caplog.at_level(logging.WARNING, "errands.worker"), running_worker(app):
            handle = long_tx.enqueue()
            wait_until(lambda: warning in caplog.text, timeout=30, what="the warning")
            wait_until(lambda: handle.job().finished_at, timeout=30, what="the attempt's end")
    finally:
        app.close()
    assert f"job {handle.id} has held ctx.transaction() open" in caplog.text


def test_a_step_inside_an_open_transaction_is_warned_about(
    app: errands.App, worker_factory: object, caplog: pytest.LogCaptureFixture
) -> None:
    """A step's stored result commits with ctx.transaction(): a failed attempt forgets it
    and the step's effect runs again. The worker says so when such a step runs."""

    @app.job(name="warn.step_in_tx")
    def charge(ctx: errands.Context) -> int:
        ctx.transaction()
        return int(ctx.step("charge", lambda: 7))

    from tests.conftest import running_worker

    with caplog.at_level(logging.WARNING, "errands.worker"), running_worker(app):
        assert charge.enqueue().result(timeout=30) == 7
    assert "step 'charge' runs inside ctx.transaction()" in caplog.text
