"""``conn=`` with a sqlite3 connection in autocommit mode (``isolation_level=None``): an
enqueue of several statements (a batch, a keyed job, a workflow) is stored whole or not
at all; a transaction the caller opened keeps it (its ROLLBACK takes the jobs back).

Each statement committed on its own there: a failure midway kept part of a batch.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import aiosqlite
import pytest

import errands
from errands.backends.sqlite import backend as sqlite_backend


class Injected(RuntimeError):
    """The failure the test injects midway through an enqueue."""


@pytest.fixture
def app(tmp_path: Path) -> Iterator[errands.App]:
    app = errands.App(f"sqlite:///{tmp_path / 'jobs.db'}")
    app.queue_stats()  # the file and its schema exist before the caller connects
    yield app
    app.close()


def _path(app: errands.App) -> str:
    return app.url.removeprefix("sqlite:///")


def _fail_the_second_insert(monkeypatch: pytest.MonkeyPatch) -> None:
    real = sqlite_backend.insert_params
    calls: list[int] = []

    def failing(request: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise Injected("the second job's insert fails after the first's")
        return real(request)

    monkeypatch.setattr(sqlite_backend, "insert_params", failing)


def _jobs(app: errands.App) -> int:
    with closing(sqlite3.connect(_path(app))) as conn:
        return int(conn.execute("SELECT count(*) FROM errands_jobs").fetchone()[0])


def test_a_batch_on_an_autocommit_connection_is_stored_whole_or_not_at_all(
    app: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    @app.job(name="atomic.job")
    def job(n: int) -> None: ...

    conn = sqlite3.connect(_path(app), isolation_level=None)
    try:
        _fail_the_second_insert(monkeypatch)
        with pytest.raises(Injected):
            app.enqueue_many([job.bind(n=1), job.bind(n=2)], conn=conn)
        assert _jobs(app) == 0 and not conn.in_transaction
        monkeypatch.undo()
        app.enqueue_many([job.bind(n=1), job.bind(n=2)], conn=conn)
        assert _jobs(app) == 2  # committed: seen from another connection
        conn.execute("BEGIN")
        app.enqueue_many([job.bind(n=3), job.bind(n=4, key="k")], conn=conn)
        conn.execute("ROLLBACK")  # the caller's own transaction: its jobs go with it
        assert _jobs(app) == 2
    finally:
        conn.close()


def test_a_workflow_on_an_autocommit_connection_is_stored_whole_or_not_at_all(
    app: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    @app.job(name="atomic.member")
    def member(n: int) -> None: ...

    batch = errands.Batch("batch")
    for n in range(3):
        batch.add(member.bind(n=n))
    conn = sqlite3.connect(_path(app), isolation_level=None)
    try:
        _fail_the_second_insert(monkeypatch)
        with pytest.raises(Injected):
            app.enqueue_workflow(batch, conn=conn)
        with closing(sqlite3.connect(_path(app))) as other:
            assert other.execute("SELECT count(*) FROM errands_workflows").fetchone()[0] == 0
        assert _jobs(app) == 0
    finally:
        conn.close()


def test_an_async_batch_on_an_autocommit_connection_is_stored_whole_or_not_at_all(
    app: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    @app.job(name="atomic.async")
    def job(n: int) -> None: ...

    async def enqueue() -> None:
        async with aiosqlite.connect(_path(app), isolation_level=None) as conn:
            with pytest.raises(Injected):
                await app.aenqueue_many([job.bind(n=1), job.bind(n=2)], conn=conn)

    _fail_the_second_insert(monkeypatch)
    asyncio.run(enqueue())
    assert _jobs(app) == 0


def test_an_async_batch_cancelled_while_it_waits_for_the_write_lock_leaves_no_transaction(
    app: errands.App,
) -> None:
    """The task awaiting a batch on an autocommit aiosqlite connection is cancelled while
    its BEGIN waits for another writer's lock (a request timing out). The BEGIN still
    runs on aiosqlite's thread once the lock is free: it is rolled back, so the caller's
    connection holds no transaction (it held the write lock for good: its later writes
    never committed, and workers got DatabaseBusy)."""

    @app.job(name="atomic.cancelled")
    def job(n: int) -> None: ...

    async def scenario() -> tuple[bool, int]:
        writer = sqlite3.connect(_path(app), isolation_level=None)
        writer.execute("BEGIN IMMEDIATE")  # another writer holds the lock
        async with aiosqlite.connect(_path(app), isolation_level=None, timeout=5) as conn:
            task = asyncio.ensure_future(
                app.aenqueue_many([job.bind(n=1), job.bind(n=2)], conn=conn)
            )
            await asyncio.sleep(0.3)  # its BEGIN waits for the lock
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            writer.execute("ROLLBACK")  # the lock is free: the queued BEGIN runs now
            writer.close()
            await conn.execute("SELECT 1")  # after whatever aiosqlite had queued
            left_open = conn.in_transaction
        return left_open, _jobs(app)

    left_open, stored = asyncio.run(scenario())
    assert not left_open
    assert stored == 0


def test_a_callers_connection_with_its_own_row_factory_enqueues_once(app: errands.App) -> None:
    """A caller's sqlite3 connection whose rows are dicts: the enqueue reads its own
    columns by position all the same (it was stored, then failed reading its id)."""

    @app.job(name="rows.job")
    def job(n: int) -> None: ...

    def as_dict(cursor: sqlite3.Cursor, row: tuple[Any, ...]) -> dict[str, Any]:
        return {d[0]: v for d, v in zip(cursor.description, row, strict=True)}

    conn = sqlite3.connect(_path(app), isolation_level=None)
    conn.row_factory = as_dict
    try:
        one = job.enqueue(n=1, conn=conn)
        keyed = job.enqueue(n=2, key="k", conn=conn)
        many = app.enqueue_many([job.bind(n=3), job.bind(n=4)], conn=conn)
        assert job.enqueue(n=5, key="k", conn=conn).id == keyed.id
    finally:
        conn.close()
    assert _jobs(app) == 4
    assert sorted(app.get_job(h.id).args["n"] for h in [one, keyed, *many]) == [1, 2, 3, 4]

    async def in_async() -> errands.JobHandle:
        async with aiosqlite.connect(_path(app), isolation_level=None) as aconn:
            aconn.row_factory = as_dict  # type: ignore[assignment]
            return await job.aenqueue(n=6, key="k3", conn=aconn)

    assert app.get_job(asyncio.run(in_async()).id).args["n"] == 6


def test_a_callers_connection_whose_text_factory_is_bytes_enqueues(app: errands.App) -> None:
    """A caller's connection reading text as bytes: the check that it is on the store's
    file reads "main" and the path as bytes all the same (it was refused, the message
    saying the connection was to "an in-memory database")."""

    @app.job(name="bytes.job")
    def job(n: int) -> None: ...

    conn = sqlite3.connect(_path(app))
    conn.text_factory = bytes
    try:
        one = job.enqueue(n=1, conn=conn)
        keyed = job.enqueue(n=2, key="k", conn=conn)
        many = app.enqueue_many([job.bind(n=3), job.bind(n=4, key="k")], conn=conn)
        wf = errands.Workflow("bytes.flow")
        wf.add(job.bind(n=5))
        flow = app.enqueue_workflow(wf, conn=conn)
        conn.commit()
    finally:
        conn.close()
    assert many[1].id == keyed.id and many[1].deduplicated
    assert sorted(app.get_job(h.id).args["n"] for h in [one, keyed, many[0]]) == [1, 2, 3]
    assert flow.id is not None and _jobs(app) == 4

    async def in_async() -> errands.JobHandle:
        async with aiosqlite.connect(_path(app)) as aconn:
            aconn.text_factory = bytes
            handle = await job.aenqueue(n=6, key="k6", conn=aconn)
            await aconn.commit()
            return handle

    assert app.get_job(asyncio.run(in_async()).id).args["n"] == 6


@pytest.mark.parametrize("mode", ["explicit BEGIN", "legacy implicit"])
def test_a_failed_enqueue_in_the_callers_transaction_leaves_nothing_of_it_there(
    app: errands.App, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """In the caller's transaction, a batch or a workflow that fails midway takes back
    what it wrote (a savepoint): a caller that catches the error and commits keeps its
    own rows and none of the enqueue's. It kept a workflow row with no members, running
    for ever, and part of a batch."""

    @app.job(name="atomic.tx")
    def job(n: int) -> None: ...

    batch = errands.Batch("in-tx")
    for n in range(3):
        batch.add(job.bind(n=n))
    isolation = None if mode == "explicit BEGIN" else ""
    conn = sqlite3.connect(_path(app), isolation_level=isolation)
    try:
        conn.execute("CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY)")
        conn.commit()
        if mode == "explicit BEGIN":
            conn.execute("BEGIN")
        conn.execute("INSERT INTO orders (id) VALUES (1)")
        _fail_the_second_insert(monkeypatch)
        with pytest.raises(Injected):
            app.enqueue_many([job.bind(n=1), job.bind(n=2)], conn=conn)
        monkeypatch.undo()
        _fail_the_second_insert(monkeypatch)
        with pytest.raises(Injected):
            app.enqueue_workflow(batch, conn=conn)
        monkeypatch.undo()
        kept = job.enqueue(n=9, conn=conn)  # the transaction is still the caller's
        conn.commit()
    finally:
        conn.close()
    with closing(sqlite3.connect(_path(app))) as other:
        assert other.execute("SELECT count(*) FROM orders").fetchone()[0] == 1
        assert other.execute("SELECT count(*) FROM errands_workflows").fetchone()[0] == 0
    assert _jobs(app) == 1 and app.get_job(kept.id).args == {"n": 9}


def test_an_async_failed_enqueue_in_the_callers_transaction_leaves_nothing_of_it_there(
    app: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    @app.job(name="atomic.atx")
    def job(n: int) -> None: ...

    async def enqueue() -> None:
        async with aiosqlite.connect(_path(app), isolation_level=None) as conn:
            await conn.execute("BEGIN")
            with pytest.raises(Injected):
                await app.aenqueue_many([job.bind(n=1), job.bind(n=2)], conn=conn)
            monkeypatch.undo()
            await app.aenqueue_many([job.bind(n=3), job.bind(n=4)], conn=conn)
            await conn.execute("COMMIT")

    _fail_the_second_insert(monkeypatch)
    asyncio.run(enqueue())
    assert _jobs(app) == 2
