"""A full SQLite store (DESIGN §11): enqueue raises errands.StorageFull, a clear
ErrandsError, instead of sqlite3's "database or disk is full"; a refused batch writes
nothing; the file stays intact; enqueue works again once there is room.

``PRAGMA max_page_count`` caps the file the way a full disk would. SQLite keeps that
setting per connection (a side connection's value is not seen by others), so it is set
on the connection errands itself writes with from this thread.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

import errands
from errands.worker import completer
from tests.conftest import running_worker

from .support import job_count, wait_until

ROOM_PAGES = 4  # above the current size: a few small jobs fit, a burst does not


@pytest.fixture
def full_app(tmp_path: Path) -> Iterator[tuple[errands.App, Path]]:
    path = tmp_path / "small.db"
    app = errands.App(f"sqlite:///{path}")

    @app.job(name="store.note", retries=0)
    def note(text: str) -> None:
        pass

    yield app, path
    app.close()


def _cap(app: errands.App, extra_pages: int | None) -> None:
    conn = app.backend._conn()  # type: ignore[attr-defined]  # errands' connection, this thread
    if extra_pages is None:
        conn.execute("PRAGMA max_page_count = 1073741823")
    else:
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count = {pages + extra_pages}")


def test_enqueue_on_a_full_store_raises_storage_full_and_corrupts_nothing(
    full_app: tuple[errands.App, Path],
) -> None:
    app, path = full_app
    note = app.registry["store.note"]
    earlier = {note.enqueue(text=f"before {i}").id: f"before {i}" for i in range(5)}
    _cap(app, ROOM_PAGES)

    with pytest.raises(errands.StorageFull) as caught:
        for i in range(5000):
            note.enqueue(text=f"filler {i} " + "x" * 2000)
    assert isinstance(caught.value, errands.ErrandsError)
    assert not isinstance(caught.value, sqlite3.Error)
    message = str(caught.value)
    assert "is full" in message and str(path) in message, message
    assert "\n" not in message

    with closing(sqlite3.connect(path)) as side:
        assert side.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    for job_id, text in earlier.items():
        job = app.get_job(job_id)
        assert job.args == {"text": text} and job.state.value == "available"

    _cap(app, None)
    after = note.enqueue(text="there is room again")
    assert app.get_job(after.id).args == {"text": "there is room again"}


def test_a_batch_that_does_not_fit_is_refused_whole(full_app: tuple[errands.App, Path]) -> None:
    app, path = full_app
    note = app.registry["store.note"]
    note.enqueue(text="first")
    _cap(app, ROOM_PAGES)
    before = job_count(app)

    with pytest.raises(errands.StorageFull):
        app.enqueue_many([note.bind(text="y" * 3000) for _ in range(200)])

    assert job_count(app) == before, "part of a refused batch was written"
    with closing(sqlite3.connect(path)) as side:
        assert side.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    _cap(app, None)
    assert len(app.enqueue_many([note.bind(text="z") for _ in range(3)])) == 3


def test_enqueue_in_the_callers_full_transaction_raises_storage_full(
    full_app: tuple[errands.App, Path],
) -> None:
    app, path = full_app
    note = app.registry["store.note"]
    note.enqueue(text="creates the schema")
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count = {pages + 1}")
        conn.execute("BEGIN IMMEDIATE")
        with pytest.raises(errands.StorageFull):
            for _ in range(500):
                note.enqueue(text="w" * 3000, conn=conn)
        conn.execute("ROLLBACK")
    assert job_count(app) == 1


def test_a_workflow_in_the_callers_full_transaction_raises_storage_full(
    full_app: tuple[errands.App, Path],
) -> None:
    """A workflow's insert on a caller's connection let sqlite3's 'database or disk is
    full' through, where a job's insert gives StorageFull."""
    app, path = full_app
    note = app.registry["store.note"]
    note.enqueue(text="creates the schema")
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count = {pages + 1}")
        conn.execute("BEGIN IMMEDIATE")
        batch = errands.Batch("too-big")
        for _ in range(300):
            batch.add(note.bind(text="w" * 3000))
        with pytest.raises(errands.StorageFull):
            app.enqueue_workflow(batch, conn=conn)
        conn.execute("ROLLBACK")
    assert job_count(app) == 1


def test_a_job_whose_outcome_meets_a_full_store_completes_once_there_is_room(
    full_app: tuple[errands.App, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store fills up while a job runs: its outcome (a large result) does not fit.
    The completer took StorageFull for content the store refuses, and after three tries in
    0.15 s stored the small fallback instead: the job that had succeeded went dead
    (UnstorableOutcome), to the dead-letter queue. Now the write waits for room (the
    lease keeps the job), and the job completes, on its first attempt, once the store has
    room again. Every connection errands opens is capped (``max_page_count``), as a full
    disk caps them all."""
    app, _ = full_app

    @app.job(name="store.big", retries=0)
    def big() -> str:
        return "r" * 300_000  # ~75 pages: more than the room left

    handle = big.enqueue()
    backend: Any = app.backend
    capped: list[sqlite3.Connection] = []
    lock = threading.Lock()
    connect = backend._connect

    def capped_connect(**options: Any) -> sqlite3.Connection:
        conn = connect(**options)
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count = {pages + ROOM_PAGES}")
        with lock:
            capped.append(conn)
        return conn

    monkeypatch.setattr(backend, "_connect", capped_connect)
    _cap(app, ROOM_PAGES)  # this thread's, opened already
    tries: list[float] = []
    pause = completer._pause
    monkeypatch.setattr(completer, "_pause", lambda s: (tries.append(s), pause(s)))
    dead: list[Any] = []
    app.events.subscribe(lambda e: dead.append(e) if e.name == "errands.job.dead" else None)

    with running_worker(app, concurrency=1):
        # well past the three refusals after which the outcome was recorded dead
        wait_until(
            lambda: (
                len(tries) >= 4 * completer.REFUSALS_BEFORE_SPLIT or handle.status().value == "dead"
            ),
            30,
            "the completer to retry its write on the full store",
        )
        assert handle.status().value == "running", handle.job().errors
        with lock:  # room again: a full disk freed
            for conn in capped:
                conn.execute("PRAGMA max_page_count = 1073741823")
        _cap(app, None)
        wait_until(lambda: handle.status().value != "running", 30, "the job to be recorded")

    job = handle.job()
    assert job.state.value == "completed" and job.attempt == 1, (job.state, job.errors)
    assert job.result == "r" * 300_000
    assert job.errors == [] and dead == []


def test_a_transactional_job_whose_commit_meets_a_full_store_is_given_back_uncharged(
    full_app: tuple[errands.App, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store fills up while a job completes in its ctx.transaction(): its completion
    (a large result) does not fit, and nothing of the transaction is written. The attempt
    was charged for it (retryable, and dead on its last attempt: here its only one),
    where the completer waits out a full store for any other outcome. The job is given
    back uncharged, the reason on it, and completes on attempt 1 once there is room.
    Every connection errands opens is capped (``max_page_count``), the handler's
    transaction's included, as a full disk caps them all."""
    app, _ = full_app
    ran: list[int] = []

    @app.job(name="store.big_tx", retries=0)
    def big_tx(ctx: errands.Context) -> str:
        ctx.transaction()
        ran.append(ctx.attempt)
        return "t" * 300_000  # ~75 pages: more than the room left

    handle = big_tx.enqueue()
    backend: Any = app.backend
    capped: list[sqlite3.Connection] = []
    lock = threading.Lock()
    full = threading.Event()
    full.set()
    connect = backend._connect

    def capped_connect(**options: Any) -> sqlite3.Connection:
        conn = connect(**options)
        if full.is_set():
            pages = conn.execute("PRAGMA page_count").fetchone()[0]
            conn.execute(f"PRAGMA max_page_count = {pages + ROOM_PAGES}")
            with lock:
                capped.append(conn)
        return conn

    monkeypatch.setattr(backend, "_connect", capped_connect)
    _cap(app, ROOM_PAGES)  # this thread's, opened already
    dead: list[Any] = []
    app.events.subscribe(lambda e: dead.append(e) if e.name == "errands.job.dead" else None)

    def given_back() -> int:
        return sum(e.kind == "released" for e in handle.job().errors)

    with running_worker(app, concurrency=1):
        wait_until(
            lambda: given_back() >= 2 or handle.status().value == "dead",
            30,
            "the job's commit to meet the full store",
        )
        assert handle.status().value != "dead", handle.job().errors
        with lock:  # room again: a full disk freed
            full.clear()
            for conn in capped:
                with contextlib.suppress(sqlite3.ProgrammingError):  # a transaction's, closed
                    conn.execute("PRAGMA max_page_count = 1073741823")
        _cap(app, None)
        wait_until(lambda: handle.status().is_terminal, 30, "the job to complete")

    job = handle.job()
    assert (job.state.value, job.attempt) == ("completed", 1), (job.state, job.errors)
    assert job.result == "t" * 300_000
    assert {e.kind for e in job.errors} == {"released"}
    assert all("is full" in e.message for e in job.errors), job.errors
    assert set(ran) == {1} and dead == []
