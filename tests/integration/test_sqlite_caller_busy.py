"""``conn=`` with a sqlite3 (or aiosqlite) connection that finds the file locked raises
:class:`errands.DatabaseBusy` naming the cause and the fix, not sqlite3's bare
``OperationalError: database is locked``.

Two causes: another connection held the write lock longer than the caller's connection
waits (its ``timeout=``), or the caller's deferred transaction read before it wrote while
another connection wrote (SQLITE_BUSY_SNAPSHOT: no wait helps; BEGIN IMMEDIATE avoids
it). Nothing of the enqueue is stored either way.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import aiosqlite
import pytest

import errands
from errands.errors import DatabaseBusy

BOTH_CAUSES = (
    r"found the SQLite database locked.*nothing of it was stored.*held the file's write lock "
    r"longer than your connection waits.*timeout=.*read before it wrote.*BEGIN IMMEDIATE"
)
SNAPSHOT = (
    r"found the SQLite database locked.*nothing of it was stored.*read before it wrote.*"
    r"another connection has written since.*Roll your transaction back and run it again.*"
    r'isolation_level="IMMEDIATE"'
)


@pytest.fixture
def app(tmp_path: Path) -> Iterator[errands.App]:
    app = errands.App(f"sqlite:///{tmp_path / 'jobs.db'}")
    app.queue_stats()  # the file and its schema exist before the callers connect
    yield app
    app.close()


def _path(app: errands.App) -> str:
    return app.url.removeprefix("sqlite:///")


def _names(app: errands.App) -> list[str]:
    with closing(sqlite3.connect(_path(app))) as conn:
        return [r[0] for r in conn.execute("SELECT name FROM errands_jobs ORDER BY id")]


@pytest.fixture
def holder(app: errands.App) -> Iterator[sqlite3.Connection]:
    """Another connection holding the file's write lock for the whole test."""
    conn = sqlite3.connect(_path(app), isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    yield conn
    conn.execute("ROLLBACK")
    conn.close()


@pytest.mark.parametrize("shape", ["one job", "a keyed batch", "a workflow"])
def test_an_enqueue_whose_connection_waits_out_its_timeout_raises_database_busy_naming_both_causes(
    app: errands.App, holder: sqlite3.Connection, shape: str
) -> None:
    @app.job(name="busy.job")
    def job(n: int) -> None: ...

    with closing(sqlite3.connect(_path(app), timeout=0.2)) as caller:
        with pytest.raises(DatabaseBusy, match=BOTH_CAUSES) as raised:
            if shape == "one job":
                job.enqueue(n=1, conn=caller)
            elif shape == "a keyed batch":
                app.enqueue_many([job.bind(n=1), job.bind(n=2, key="k")], conn=caller)
            else:
                wf = errands.Workflow("busy.flow")
                wf.add(job.bind(n=1))
                app.enqueue_workflow(wf, conn=caller)
        assert isinstance(raised.value.__cause__, sqlite3.OperationalError)
        # and one itself: code catching "database is locked" as sqlite3's error still does
        assert isinstance(raised.value, sqlite3.OperationalError)
        assert raised.value.sqlite_errorname == "SQLITE_BUSY"  # type: ignore[attr-defined]
        assert "Roll your transaction back and run it again" in str(raised.value)
        caller.rollback()
    assert _names(app) == []  # (a reader while the holder writes: WAL)


def test_an_autocommit_callers_batch_that_waits_out_its_timeout_says_to_call_it_again(
    app: errands.App, holder: sqlite3.Connection
) -> None:
    @app.job(name="busy.auto")
    def job(n: int) -> None: ...

    with closing(sqlite3.connect(_path(app), timeout=0.2, isolation_level=None)) as caller:
        with pytest.raises(DatabaseBusy, match=BOTH_CAUSES) as raised:
            app.enqueue_many([job.bind(n=1), job.bind(n=2)], conn=caller)
        assert "Call it again" in str(raised.value)
        assert not caller.in_transaction


def test_an_enqueue_in_a_deferred_transaction_that_read_before_another_write_says_to_begin_immediate(  # noqa: E501
    app: errands.App,
) -> None:
    """A deferred transaction read, another connection wrote: SQLite refuses the write
    at once (no wait helps). Begun IMMEDIATE, as the error says, it goes through."""

    @app.job(name="busy.snapshot")
    def job(n: int) -> None: ...

    with closing(sqlite3.connect(_path(app))) as caller:
        caller.execute("BEGIN")
        caller.execute("SELECT count(*) FROM errands_jobs").fetchone()
        job.enqueue(n=0)  # another connection writes
        for call in (
            lambda: job.enqueue(n=1, conn=caller),
            lambda: app.enqueue_many([job.bind(n=1), job.bind(n=2, key="k")], conn=caller),
        ):
            with pytest.raises(DatabaseBusy, match=SNAPSHOT) as raised:
                call()
            assert raised.value.__cause__.sqlite_errorname == "SQLITE_BUSY_SNAPSHOT"  # type: ignore[union-attr]
        caller.rollback()
    with closing(sqlite3.connect(_path(app), isolation_level="IMMEDIATE")) as caller:
        caller.execute("SELECT count(*) FROM errands_jobs").fetchone()
        job.enqueue(n=3, conn=caller)
        caller.commit()
    assert _names(app) == ["busy.snapshot", "busy.snapshot"]


def test_an_async_enqueue_in_a_deferred_transaction_that_read_before_another_write_says_to_begin_immediate(  # noqa: E501
    app: errands.App,
) -> None:
    @app.job(name="busy.async")
    def job(n: int) -> None: ...

    async def scenario() -> None:
        async with aiosqlite.connect(_path(app)) as caller:
            await caller.execute("BEGIN")
            await (await caller.execute("SELECT count(*) FROM errands_jobs")).fetchone()
            await job.aenqueue(n=0)  # the store's own connection writes
            with pytest.raises(DatabaseBusy, match=SNAPSHOT):
                await app.aenqueue_many([job.bind(n=1), job.bind(n=2)], conn=caller)
            await caller.rollback()

    asyncio.run(scenario())
    assert _names(app) == ["busy.async"]
