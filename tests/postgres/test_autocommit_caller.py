"""``conn=`` with a psycopg connection in autocommit mode: an enqueue of several statements
(a batch, a keyed job, a workflow) is stored whole or not at all.

On such a connection every statement commits on its own, so a batch whose keyed INSERT
failed kept the jobs its COPY had written, and a workflow's nested members were committed,
and claimable, before the rows that make them members of their parent existed. Each now
runs in a transaction of its own there; on a connection in a transaction it joins the
caller's, which commits or rolls it back (tests/conformance/test_insert.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import errands
from errands.backends.postgres.backend import PostgresBackend
from errands.backends.postgres.config import parse_postgres_url


class Injected(RuntimeError):
    """The failure the test injects midway through an enqueue."""


@pytest.fixture
def app(pg_url: str) -> Iterator[errands.App]:
    app = errands.App(pg_url)
    app.queue_stats()  # migrated before the caller's connection looks
    yield app
    app.close()


@pytest.fixture
def autocommit(app: errands.App) -> Iterator[psycopg.Connection[Any]]:
    conninfo = parse_postgres_url(app.url).conninfo
    with psycopg.connect(conninfo, autocommit=True) as conn:
        yield conn


def _count(app: errands.App, table: str) -> int:
    backend: Any = app.backend
    with psycopg.connect(parse_postgres_url(app.url).conninfo) as conn:
        row = conn.execute(f'SELECT count(*) FROM "{backend.schema}".{table}').fetchone()
    return int(row[0]) if row else 0


def test_a_batch_on_an_autocommit_connection_is_stored_whole_or_not_at_all(
    app: errands.App, autocommit: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    @app.job(name="atomic.job")
    def job(n: int) -> None: ...

    def failing(self: PostgresBackend, rows: Any) -> Any:
        raise Injected("the keyed INSERT fails after the COPY wrote the others")

    monkeypatch.setattr(PostgresBackend, "_insert_many_params", failing)
    with pytest.raises(Injected):
        app.enqueue_many([job.bind(n=1), job.bind(n=2), job.bind(n=3, key="k")], conn=autocommit)
    assert _count(app, "errands_jobs") == 0
    assert autocommit.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    monkeypatch.undo()
    handles = app.enqueue_many([job.bind(n=1), job.bind(n=3, key="k")], conn=autocommit)
    assert [h.job().args for h in handles] == [{"n": 1}, {"n": 3}]  # committed: seen by others


def test_a_workflow_on_an_autocommit_connection_is_stored_whole_or_not_at_all(
    app: errands.App, autocommit: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    @app.job(name="atomic.member")
    def member(n: int) -> None: ...

    inner = errands.Batch("inner")
    outer = errands.Batch("outer")
    for n in range(2):
        inner.add(member.bind(n=n))
        outer.add(member.bind(n=10 + n))
    outer.add(inner)
    workflows: Any = app.backend.workflows  # type: ignore[attr-defined]
    joined = workflows.insert_joined
    calls: list[int] = []

    def failing(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:  # the outer batch's members, after the inner batch's
            raise Injected("the outer batch's members fail after the inner batch's")
        return (yield from joined(*args))

    monkeypatch.setattr(workflows, "insert_joined", failing)
    with pytest.raises(Injected):
        app.enqueue_workflow(outer, conn=autocommit)
    assert (_count(app, "errands_jobs"), _count(app, "errands_workflows")) == (0, 0)
    monkeypatch.undo()
    handle = app.enqueue_workflow(outer, conn=autocommit)
    assert handle.status().state == "running" and _count(app, "errands_jobs") == 4


def test_an_enqueue_in_a_transaction_begun_by_hand_stays_the_callers(
    app: errands.App, autocommit: psycopg.Connection[Any]
) -> None:
    """BEGIN sent by hand on an autocommit connection: the batch is part of that
    transaction, and its ROLLBACK takes the jobs back."""

    @app.job(name="atomic.manual")
    def job(n: int) -> None: ...

    autocommit.execute("BEGIN")
    app.enqueue_many([job.bind(n=1), job.bind(n=2, key="k")], conn=autocommit)
    autocommit.execute("ROLLBACK")
    assert _count(app, "errands_jobs") == 0


def test_an_async_batch_on_an_autocommit_connection_is_stored_whole_or_not_at_all(
    app: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    @app.job(name="atomic.async")
    def job(n: int) -> None: ...

    def failing(self: PostgresBackend, queues: Any) -> Any:
        raise Injected("the wake-up fails after the batch's INSERT")

    async def enqueue() -> None:
        conninfo = parse_postgres_url(app.url).conninfo
        async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as conn:
            with pytest.raises(Injected):
                await app.aenqueue_many([job.bind(n=1), job.bind(n=2, key="k")], conn=conn)

    monkeypatch.setattr(PostgresBackend, "_notify_due", failing)
    asyncio.run(enqueue())
    assert _count(app, "errands_jobs") == 0


def test_a_callers_connection_with_dict_rows_enqueues_once_and_gets_the_right_handles(
    app: errands.App, autocommit: psycopg.Connection[Any]
) -> None:
    """A caller's connection set to dict rows: the enqueue reads its own columns by
    position all the same. It was stored, then failed reading its id (KeyError: 0), so
    the caller, told it failed, enqueued it again."""
    from psycopg.rows import dict_row

    @app.job(name="rows.job")
    def job(n: int) -> None: ...

    autocommit.row_factory = dict_row  # type: ignore[assignment]
    one = job.enqueue(n=1, conn=autocommit)
    keyed = job.enqueue(n=2, key="k", conn=autocommit)
    many = app.enqueue_many([job.bind(n=3), job.bind(n=4, key="k2")], conn=autocommit)
    again = job.enqueue(n=5, key="k", conn=autocommit)  # the key is taken: deduplicated
    assert again.deduplicated and again.id == keyed.id
    assert _count(app, "errands_jobs") == 4
    assert sorted(app.get_job(h.id).args["n"] for h in [one, keyed, *many]) == [1, 2, 3, 4]

    async def in_async() -> errands.JobHandle:
        conninfo = parse_postgres_url(app.url).conninfo
        async with await psycopg.AsyncConnection.connect(
            conninfo, autocommit=True, row_factory=dict_row
        ) as aconn:
            return await job.aenqueue(n=6, key="k3", conn=aconn)

    assert app.get_job(asyncio.run(in_async()).id).args["n"] == 6


def test_a_failed_enqueue_in_the_callers_transaction_leaves_nothing_of_it_and_the_tx_usable(
    app: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the caller's transaction, a batch or a workflow that fails midway takes back
    what it wrote (a savepoint), and the caller's transaction stays usable: a caller
    that catches the error and commits keeps none of it. It kept part of a batch, and a
    workflow row with no members, running for ever."""

    @app.job(name="atomic.tx")
    def job(n: int) -> None: ...

    batch = errands.Batch("in-tx")
    for n in range(3):
        batch.add(job.bind(n=n, key=f"b{n}"))

    def failing(self: PostgresBackend, rows: Any) -> Any:
        raise Injected("the keyed INSERT fails after the COPY wrote the others")

    conninfo = parse_postgres_url(app.url).conninfo
    with psycopg.connect(conninfo) as conn:  # not autocommit: the caller's transaction
        monkeypatch.setattr(PostgresBackend, "_insert_many_params", failing)
        with pytest.raises(Injected):
            app.enqueue_many([job.bind(n=1), job.bind(n=2), job.bind(n=3, key="k")], conn=conn)
        monkeypatch.undo()
        job.enqueue(n=4, key="b1")  # outside: the workflow's second member's key is taken
        with pytest.raises(errands.ConfigurationError):
            app.enqueue_workflow(batch, conn=conn)
        kept = job.enqueue(n=9, conn=conn)  # the transaction is still usable
        conn.commit()
    assert _count(app, "errands_workflows") == 0
    assert _count(app, "errands_jobs") == 2 and app.get_job(kept.id).args == {"n": 9}

    async def in_async() -> None:
        async with await psycopg.AsyncConnection.connect(conninfo) as aconn:
            monkeypatch.setattr(PostgresBackend, "_insert_many_params", failing)
            with pytest.raises(Injected):
                await app.aenqueue_many([job.bind(n=5), job.bind(n=6, key="k6")], conn=aconn)
            monkeypatch.undo()
            await app.aenqueue_many([job.bind(n=7), job.bind(n=8, key="k8")], conn=aconn)
            await aconn.commit()

    asyncio.run(in_async())
    assert _count(app, "errands_jobs") == 4


def test_a_callers_connection_of_a_psycopg_connection_subclass_enqueues(app: errands.App) -> None:
    """A subclass of psycopg.Connection (a framework's own) was taken for a sqlite3
    connection by the tuple-row cursor: every statement raised TypeError."""

    class Framework(psycopg.Connection):  # type: ignore[type-arg]
        pass

    @app.job(name="rows.sub")
    def job(n: int) -> None: ...

    conninfo = parse_postgres_url(app.url).conninfo
    with Framework.connect(conninfo, autocommit=True) as conn:
        handle = job.enqueue(n=1, conn=conn)
        many = app.enqueue_many([job.bind(n=2), job.bind(n=3, key="s")], conn=conn)
    assert sorted(app.get_job(h.id).args["n"] for h in [handle, *many]) == [1, 2, 3]


def test_the_first_async_enqueue_never_blocks_the_event_loop_while_the_store_opens() -> None:
    """A server that accepts connections and never answers: the first aenqueue opened
    the store (its pool) on the event loop, which stood still until the connect gave up,
    at every call. It opens in a thread now: the loop keeps running."""
    import socket
    import time as clock

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    port = silent.getsockname()[1]
    app = errands.App(f"postgresql://u@127.0.0.1:{port}/db?connect_timeout=3")

    @app.job(name="loop.first")
    def first(n: int) -> None: ...

    async def scenario() -> float:
        gaps: list[float] = []
        done = asyncio.Event()

        async def ticker() -> None:
            last = clock.monotonic()
            while not done.is_set():
                await asyncio.sleep(0.05)
                now = clock.monotonic()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        with contextlib.suppress(Exception):
            await asyncio.wait_for(first.aenqueue(n=1), timeout=4)
        done.set()
        await tick
        return max(gaps)

    try:
        assert asyncio.run(scenario()) < 1.5  # the loop never stood still for the connect (3 s)
    finally:
        silent.close()


def test_an_enqueue_in_an_aborted_transaction_is_refused_naming_the_fix(
    app: errands.App,
) -> None:
    """A caller's transaction a failed statement aborted: the enqueue (sync or async) is
    refused with ConfigurationError saying to roll it back first (psycopg's
    InFailedSqlTransaction came from deep inside), and nothing is stored."""

    @app.job(name="aborted.job")
    def job() -> None: ...

    conninfo = parse_postgres_url(app.url).conninfo
    with psycopg.connect(conninfo) as conn:
        with contextlib.suppress(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1 / 0")
        with pytest.raises(errands.ConfigurationError, match=r"aborted .* Roll it back"):
            job.enqueue(conn=conn)

    async def aenqueue_in_aborted() -> None:
        async with await psycopg.AsyncConnection.connect(conninfo) as aconn:
            with contextlib.suppress(psycopg.errors.DivisionByZero):
                await aconn.execute("SELECT 1 / 0")
            with pytest.raises(errands.ConfigurationError, match=r"aborted .* Roll it back"):
                await job.aenqueue(conn=aconn)

    asyncio.run(aenqueue_in_aborted())
    assert _count(app, "errands_jobs") == 0
