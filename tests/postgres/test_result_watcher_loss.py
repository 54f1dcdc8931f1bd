"""Waiters are woken when the result watcher's LISTEN connection drops. A waiter asleep
while the store pushes reads again only at its 30 s safety recheck; when that connection
was lost, nothing woke it (and ``listening`` stayed set through the pause before the
reconnect), so a job that ended while the watcher was away was seen up to 30 s late.
Now the loss clears ``listening`` at once and wakes every waiter, which polls with
backoff until the watcher listens again."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import errands
from errands.backends.postgres import notifier
from errands.results import SAFETY_RECHECK

from .harness import wait_until


@pytest.fixture
def shop(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[errands.App]:
    """An App whose result watcher, once its connection is lost, tries again only after a
    minute: within the test only polling can see a job end."""
    monkeypatch.setattr(notifier, "RECONNECT_FIRST", 60.0)
    app = errands.App(pg_url)

    @app.job(name="loss.ship")
    def ship(order: int) -> int:
        return order

    app.migrate()
    assert app.results.ready(), "the result watcher never listened"
    yield app
    app.close()


def watcher_sessions(conn: psycopg.Connection[Any]) -> list[int]:
    """The server pids of this process's result watcher (by its application_name)."""
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s",
        (f"errands-results:{os.getpid()}",),
    ).fetchall()
    return [pid for (pid,) in rows]


@pytest.mark.parametrize("form", ["sync", "async"])
def test_a_waiter_asleep_when_the_listen_connection_drops_sees_a_job_end_while_it_is_away(
    shop: errands.App, form: str
) -> None:
    """The watcher's session is terminated while a waiter sleeps (until its safety
    recheck), and the job ends while the watcher is away (its NOTIFY goes nowhere): the
    waiter returns the result within a few seconds, by polling, not at its recheck."""
    handle = shop.registry["loss.ship"].enqueue(order=3)
    results: list[Any] = []

    def wait() -> None:
        if form == "sync":
            results.append(handle.result(timeout=20))
        else:
            results.append(asyncio.run(handle.aresult(timeout=20)))

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    wait_until(lambda: shop.results.waiting() == 1, 10, "the waiter to register")
    time.sleep(0.3)  # its first read is done: it sleeps until woken (or its recheck)
    conninfo = shop.backend.config.conninfo  # type: ignore[attr-defined]
    with psycopg.connect(conninfo, autocommit=True) as admin:
        (pid,) = watcher_sessions(admin)
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        wait_until(lambda: not shop.results.pushing, 5, "the hub to see the watcher gone")
        admin.execute(
            f"UPDATE \"{shop.backend.schema}\".errands_jobs SET state = 'completed', "  # type: ignore[attr-defined]
            "result = '3'::jsonb, finished_at = now() WHERE id = %s",
            (handle.id,),
        )
        ended = time.monotonic()
        waiter.join(timeout=25)
        seen = time.monotonic() - ended
        assert watcher_sessions(admin) == [], "the watcher reconnected: not proven by polling"
    assert results == [3]
    assert seen < 5 < SAFETY_RECHECK, f"the end seen {seen:.1f} s late"
