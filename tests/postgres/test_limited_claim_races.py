"""A limited claim on PostgreSQL reads its candidates, then writes the rows it chose: what
happens between (another claimer holding the queue's claim lock, an edit of a chosen row)
must not let it exceed a rate, claim a row early, in the wrong queue or past a cap."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest

import errands
from errands.backends.base import QueueClaim
from errands.backends.postgres.backend import _LimitedStore
from errands.backends.postgres.config import parse_postgres_url


@pytest.fixture
def app(pg_url: str) -> Iterator[errands.App]:
    app = errands.App(pg_url)
    yield app
    app.close()


def _claim(app: errands.App, queue: str) -> list[Any]:
    return list(app.backend.job_claim_limited(QueueClaim(queue, 10), "w-test", 30.0))


def test_a_claim_that_waited_for_the_claim_lock_counts_its_rate_from_when_it_ran(
    app: errands.App,
) -> None:
    """rate='2/3s'. Claim A waits 4 s for the queue's claim lock (another claimer holds
    it), then takes 2. It counted its window and logged its starts at its transaction's
    start (now(), before the wait), so claim B right after it left them out of its own
    window and took 2 more: 4 starts within milliseconds."""

    @app.job(name="race.rated", queue="rated", rate="2/3s")
    def rated(n: int) -> None: ...

    app.enqueue_many([rated.bind(n=n) for n in range(4)])
    _claim(app, "nothing")  # opens the store, and declares nothing
    schema = app.backend.schema  # type: ignore[attr-defined]
    conninfo = parse_postgres_url(app.url).conninfo
    with psycopg.connect(conninfo) as holder:
        holder.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"errands:{schema}:rated",))
        claimed: list[list[Any]] = []
        first = threading.Thread(target=lambda: claimed.append(_claim(app, "rated")))
        first.start()
        time.sleep(4)
        holder.commit()  # the lock goes: claim A runs now
    first.join(10)
    assert len(claimed[0]) == 2
    assert _claim(app, "rated") == []  # the window counts A's two starts


def test_a_row_edited_between_a_fair_claims_read_and_its_write_is_left_out(
    app: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fair claim's reads lock no row; an edit committed before its write (a job put
    off by an hour) was claimed anyway, and ran an hour early."""
    app.queue("tenants", fair=True)

    @app.job(name="race.fair", queue="tenants", fair_key="{tenant}")
    def fair(tenant: str) -> None: ...

    early, later = fair.enqueue(tenant="a"), fair.enqueue(tenant="b")
    app.backend.queue_declare(app.queues["tenants"], "test")  # as a worker's start does
    real_claim = _LimitedStore.claim
    edited: list[int] = []

    def edit_first(self: _LimitedStore, params: dict[str, object], *, last: bool) -> Any:
        if not edited:
            conninfo = parse_postgres_url(app.url).conninfo
            with psycopg.connect(conninfo, autocommit=True) as other:
                other.execute(
                    f'UPDATE "{app.backend.schema}".errands_jobs '  # type: ignore[attr-defined]
                    "SET run_at = now() + interval '1 hour', state = 'scheduled' WHERE id = %s",
                    (later.id,),
                )
            edited.append(later.id)
        return real_claim(self, params, last=last)

    monkeypatch.setattr(_LimitedStore, "claim", edit_first)
    rows = _claim(app, "tenants")
    assert edited == [later.id]
    assert [r.id for r in rows] == [early.id]
    assert later.status() is errands.JobState.SCHEDULED
    assert timedelta(minutes=50) < later.job().run_at - early.job().inserted_at
