"""errands on a PostgreSQL database whose default isolation is not READ COMMITTED.

The limits count again once they hold a key's lock, and the fenced writes update rows the
heartbeats update too: both need a snapshot per statement. errands' own transactions ask
for READ COMMITTED, whatever ``default_transaction_isolation`` the database or role sets.
These tests set that default on their own connections only (libpq ``options`` in the URL),
so nothing leaks to other tests sharing the server.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import errands
from errands.backends.base import QueueClaim
from errands.backends.postgres.backend import _LimitedStore
from errands.backends.postgres.config import parse_postgres_url
from tests.pg import with_params

# libpq options in a URL: spaces as %20 and a backslash before the one inside the value
REPEATABLE_READ = "-c%20default_transaction_isolation%3Drepeatable%5C%20read"


@pytest.fixture
def rr_url(pg_url: str) -> str:
    """The test's fresh schema, on connections whose default is REPEATABLE READ."""
    return with_params(pg_url, options=REPEATABLE_READ)


@pytest.fixture
def app(rr_url: str) -> Iterator[errands.App]:
    app = errands.App(rr_url, lease=2)
    yield app
    app.close()


def _default_isolation(url: str) -> str:
    with psycopg.connect(parse_postgres_url(url).conninfo) as conn:
        return str(conn.execute("SHOW default_transaction_isolation").fetchone()[0])  # type: ignore[index]


def test_a_libpq_option_with_a_space_in_the_url_reaches_the_server(rr_url: str) -> None:
    """``options=-c name=value`` in the URL: errands passed it on with its spaces as '+',
    which libpq keeps as is, and the server refused "+default_transaction_isolation"."""
    assert _default_isolation(rr_url) == "repeatable read"


def test_claims_of_queues_sharing_a_key_keep_its_limit_under_a_repeatable_read_default(
    app: errands.App, rr_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given two queues whose jobs share key k (limit 1) and connections defaulting to
    REPEATABLE READ, when a claim of the other queue commits one of k's jobs between this
    claim's reads and its lock of k, then this claim, counting again under the lock, takes
    none: one running. Its transaction's snapshot dated from its first statement, so the
    count under the lock missed the other claim, and both ran (2 running)."""
    for queue in ("q1", "q2"):

        @app.job(name=f"shared.{queue}", queue=queue, concurrency_key="k", concurrency_limit=1)
        def shared(n: int) -> None: ...

        shared.enqueue(1)
    other = errands.App(rr_url)
    real_lock = _LimitedStore.lock
    interleaved: list[int] = []

    def other_claims_first(self: _LimitedStore, names: list[str]) -> None:
        if not interleaved:  # this claim's lock of k: the other queue's claim commits first
            interleaved.append(0)  # (its own lock of k goes straight through)
            interleaved[0] = len(other.backend.job_claim_limited(QueueClaim("q2", 1), "w2", 30))
        real_lock(self, names)

    monkeypatch.setattr(_LimitedStore, "lock", other_claims_first)
    try:
        assert _default_isolation(rr_url) == "repeatable read"
        mine = app.backend.job_claim_limited(QueueClaim("q1", 1), "w1", 30.0)
    finally:
        other.close()
    assert interleaved == [1]
    assert list(mine) == []
    assert len(app.jobs(state="running", limit=10)) == 1


def test_a_ctx_transaction_job_completes_after_a_heartbeat_under_a_repeatable_read_default(
    app: errands.App,
) -> None:
    """Given connections defaulting to REPEATABLE READ, a job that writes through
    ctx.transaction() and runs past a heartbeat of its lease completes. Its transaction's
    snapshot predated the heartbeat's update of the job's row, and the fenced completion
    failed with a serialization failure, every attempt."""
    conninfo = parse_postgres_url(app.url).conninfo
    schema = app.backend.schema  # type: ignore[attr-defined]

    def lease_of(job_id: int) -> Any:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            row = conn.execute(
                f'SELECT lease_expires_at FROM "{schema}".errands_jobs WHERE id = %s', (job_id,)
            ).fetchone()
            return row[0] if row else None

    @app.job(name="tx.writes", queue="tx", retries=0)
    def writes(ctx: errands.Context) -> None:
        ctx.transaction().execute("SELECT 1")  # the snapshot, under REPEATABLE READ
        first = lease_of(ctx.job_id)
        deadline = time.monotonic() + 60
        while lease_of(ctx.job_id) == first and time.monotonic() < deadline:
            time.sleep(0.05)  # until a heartbeat extended the lease (updated the row)

    handle = writes.enqueue()
    worker = app.worker(queues=["tx"], concurrency=1, poll_interval=0.1)
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        handle.result(timeout=90)
    finally:
        worker.stop()
        thread.join(30)
    job = handle.job()
    assert job.state is errands.JobState.COMPLETED, job.errors
    assert job.errors == []
