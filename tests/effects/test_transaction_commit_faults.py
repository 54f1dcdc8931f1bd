"""``ctx.transaction()``: a completion whose COMMIT fails for the store's reasons.

- The store cannot write (full, read-only): nothing of the transaction is written. The
  job is given back uncharged once the store takes the release, as an outcome meeting
  such a store waits for it; the job runs again and completes, its effect written once.
- The COMMIT went through and its reply was lost: the job is read back, and the
  completion found there is the attempt's outcome (tests/observability/test_events.py
  for the worker's own threads, with the workflow it settles).

Both on the worker's threads and in a process-pool child (run in a thread of this
process here, so that the fault points armed in it fire in the child's code), on SQLite
and PostgreSQL.
"""

from __future__ import annotations

import itertools
import sqlite3
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import closing, contextmanager, suppress
from pathlib import Path
from typing import Any

import psycopg
import psycopg.errors
import pytest
from effects_store import TX_TABLES, EffectsStore

import errands
from errands import faults
from errands.jobs import JobRow
from errands.testing import Tester
from errands.worker import process_child, recorder
from errands.worker.process_pool import ChildFailure
from errands.worker.worker import Worker
from tests.conftest import running_worker
from tests.integration.helpers import wait_until

Make = Callable[..., Any]
PAUSE = 0.2  # the first give-back's pause here (recorder.UNWRITABLE_PAUSE: 1 s)


def write_effect(ctx: errands.Context, store_url: str, n: int) -> None:
    """INSERT one tx_effects row through the completion transaction."""
    table = EffectsStore.qualified(store_url, "tx_effects")
    sql = f"INSERT INTO {table} (job_id, n, attempt) VALUES (%s, %s, %s)"
    if EffectsStore.is_sqlite(store_url):
        sql = sql.replace("%s", "?")
    ctx.transaction().execute(sql, (ctx.job_id, n, ctx.attempt))


def _rows(effects: EffectsStore, job_id: int) -> list[tuple[Any, ...]]:
    return effects.execute("SELECT n, attempt FROM tx_effects WHERE job_id = %s", (job_id,))


def _cannot_write(store_url: str) -> Exception:
    """What the driver raises when the store has no room for the completion's write:
    SQLite's SQLITE_FULL, PostgreSQL's disk_full (SQLSTATE 53100)."""
    if EffectsStore.is_sqlite(store_url):
        full = sqlite3.OperationalError("database or disk is full")
        full.sqlite_errorcode = sqlite3.SQLITE_FULL  # type: ignore[attr-defined]
        return full
    return psycopg.errors.DiskFull('could not extend file "base/16384/16385": No space left')


def _reply_lost(store_url: str) -> Exception:
    """What the driver raises when the connection drops once the COMMIT went through (a
    local SQLite commit cannot lose its reply: simulated with its own error class)."""
    if EffectsStore.is_sqlite(store_url):
        return sqlite3.OperationalError("disk I/O error (after the commit)")
    return psycopg.OperationalError("server closed the connection unexpectedly")


def _on_the_completer() -> bool:
    """Whether this is the worker's completer thread (its read-backs)."""
    return threading.current_thread().name == "errands-completer"


def _batch_of_one(app: errands.App, prefix: str, member: Any) -> Any:
    """A batch of one member (``member``, bound) with an on_success callback of its own
    (``<prefix>.callback``), enqueued: its handle."""

    @app.job(name=f"{prefix}.callback")
    def callback() -> None:
        pass

    batch = errands.Batch(f"{prefix}.batch", on_success=callback.bind())
    batch.add(member, name="only")
    return app.enqueue_workflow(batch)


@contextmanager
def failing(point: str, error: Exception, times: int) -> Iterator[list[str]]:
    """The fault point ``point`` raises ``error`` its first ``times`` times."""
    fired: list[str] = []

    def fail(name: str) -> None:
        if len(fired) < times:
            fired.append(name)
            raise error

    faults.arm(point, fail)
    try:
        yield fired
    finally:
        faults.disarm(point)


class ChildrenInThreads:
    """A worker's process pool whose "children" run :func:`process_child._run_one` in a
    thread of this process: the child's code as it is, its answer settled on the job's
    future as the pool settles a child's (ChildResult, or ChildFailure)."""

    def __init__(self, app: errands.App) -> None:
        self.app = app
        self.answers: list[tuple[bool, Any]] = []

    def submit(
        self, row: JobRow, on_progress: Any = None, future: Future[Any] | None = None
    ) -> Any:
        assert future is not None

        def run() -> None:
            ok, payload = process_child._run_one(self.app, row, "child-in-a-thread")
            self.answers.append((ok, payload))
            if ok:
                future.set_result(payload)
            else:
                future.set_exception(ChildFailure(*payload))

        threading.Thread(target=run, daemon=True).start()
        return future

    def kill(self, future: Future[Any], exc: BaseException) -> bool:
        return False


@contextmanager
def worker_on(
    app: errands.App, pool: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[ChildrenInThreads | None]:
    """An in-process worker; ``pool="child"``: its sync jobs go to ChildrenInThreads."""
    children = ChildrenInThreads(app) if pool == "child" else None
    if children is not None:
        monkeypatch.setattr(Worker, "child_runner_for", lambda self, attempt: children)
    with running_worker(app, concurrency=1, maintenance=False):
        yield children


@pytest.mark.parametrize("pool", ["thread", "child"])
def test_a_completion_transaction_that_meets_a_full_store_is_given_back_uncharged(
    make_app: Make,
    effects: EffectsStore,
    store_url: str,
    pool: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The store is full as the handler's ctx.transaction() is completed: nothing of the
    transaction is written (the handler's rows roll back with it). That is the store's
    failure, not the job's: the attempt was charged (retryable, and dead on its last
    attempt: here its only one), where the completer waits out a full store for any
    other outcome. The job is given back uncharged, the reason recorded, and runs again
    once the store takes writes: completed on attempt 1, its effect written once."""
    monkeypatch.setattr(
        recorder, "UNWRITABLE_PAUSE", PAUSE, raising=False
    )  # (1 s, doubling: seconds)
    effects.create(TX_TABLES)
    app = make_app()
    seen: list[str] = []
    app.events.subscribe(lambda e: seen.append(e.name))

    @app.job(name="full.tx", retries=0)
    def full_tx(ctx: errands.Context, n: int) -> int:
        write_effect(ctx, store_url, n)
        return n

    handle = full_tx.enqueue(n=6)
    with (
        failing("before_complete_commit", _cannot_write(store_url), 3) as refused,
        worker_on(app, pool, monkeypatch) as children,
    ):
        assert handle.result(timeout=30) == 6
    assert len(refused) == 3
    if children is not None:  # the child said why, and the worker gave the job back
        kinds = [payload[3] for ok, payload in children.answers if not ok]
        assert kinds == [process_child.UNWRITABLE] * 3, children.answers
    job = handle.job()
    assert (job.state, job.attempt) == (errands.JobState.COMPLETED, 1), job.errors
    assert [e.kind for e in job.errors] == ["released"] * 3, job.errors
    assert all("cannot be written" in e.message for e in job.errors), job.errors
    assert _rows(effects, handle.id) == [(6, 1)]
    assert "errands.job.dead" not in seen and "errands.job.retrying" not in seen, seen
    assert seen.count("errands.job.released") == 3, seen


class Releases:
    """The pauses the worker's releases asked of the store (``job_release_many``'s
    ``delays``), in order; None where it asked none."""

    def __init__(self, app: errands.App, monkeypatch: pytest.MonkeyPatch) -> None:
        self.delays: list[float | None] = []
        release = app.backend.job_release_many

        def recording(leases: Any, *args: Any, **kwargs: Any) -> Any:
            asked = kwargs.get("delays")
            self.delays.extend(asked if asked is not None else [None] * len(leases))
            return release(leases, *args, **kwargs)

        monkeypatch.setattr(app.backend, "job_release_many", recording)


def _assert_growing_pauses(job: errands.Job, delays: list[float | None], times: int) -> None:
    """Each of ``times`` give-backs in a row asked a pause (PAUSE, doubling, jittered
    between half of it and all of it), and the job was not claimed again before it was
    over: the store's clock says each next release came at least that long after (a
    busy machine only makes the gaps longer)."""
    assert len(delays) == times, delays
    for i, delay in enumerate(delays):
        assert delay is not None, delays
        assert PAUSE * 2**i / 2 <= delay <= PAUSE * 2**i, delays
    at = [e.at.timestamp() for e in job.errors if e.kind == "released"]
    assert len(at) == times, job.errors
    gaps = [b - a for a, b in itertools.pairwise(at)]
    for gap, delay in zip(gaps, delays, strict=False):
        assert delay is not None and gap >= delay - 0.01, (at, delays)


@pytest.mark.parametrize("pool", ["thread", "child"])
def test_a_job_whose_commit_meets_a_full_store_again_and_again_waits_a_growing_pause(
    make_app: Make,
    effects: EffectsStore,
    store_url: str,
    pool: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The store cannot write as a job's ctx.transaction() commits, three times in a row:
    each time the job is given back uncharged, and due again only after a pause that
    doubles (with jitter). It was due again at once: during a disk-full incident it ran
    again and again in a tight loop, hammering the store and repeating its handler's
    side effects. Once a commit goes through it completes, on attempt 1, its effect
    written once."""
    monkeypatch.setattr(recorder, "UNWRITABLE_PAUSE", PAUSE, raising=False)
    effects.create(TX_TABLES)
    app = make_app()
    releases = Releases(app, monkeypatch)

    @app.job(name="full.paused", retries=0)
    def full_paused(ctx: errands.Context, n: int) -> int:
        write_effect(ctx, store_url, n)
        return n

    handle = full_paused.enqueue(n=4)
    with (
        failing("before_complete_commit", _cannot_write(store_url), 3) as refused,
        worker_on(app, pool, monkeypatch),
    ):
        assert handle.result(timeout=30) == 4
    assert len(refused) == 3
    job = handle.job()
    assert (job.state, job.attempt) == (errands.JobState.COMPLETED, 1), job.errors
    assert [e.kind for e in job.errors] == ["released"] * 3, job.errors
    _assert_growing_pauses(job, releases.delays, 3)
    assert _rows(effects, handle.id) == [(4, 1)]


def _statement_meets_a_full_store(
    ctx: errands.Context, store_url: str, *, raw: bool = False, room: int = 0
) -> None:
    """A statement of the handler's in its ctx.transaction() that the store cannot take:
    on SQLite a write past the file's ``max_page_count`` (SQLITE_FULL: SQLite rolls the
    whole transaction back; ``room``: pages left for smaller writes), on PostgreSQL the
    server's disk_full (SQLSTATE 53100). ``raw``: sent through ``ctx.transaction().raw``,
    which errands does not wrap."""
    tx = ctx.transaction()
    conn = tx.raw if raw else tx
    if EffectsStore.is_sqlite(store_url):
        pages = tx.execute("PRAGMA page_count").fetchone()[0]
        tx.execute(f"PRAGMA max_page_count = {pages + room}")  # this connection's
        conn.execute(
            "INSERT INTO tx_effects (job_id, n, attempt) VALUES (?, zeroblob(2000000), ?)",
            (ctx.job_id, ctx.attempt),
        )
    else:  # (a DO block's END, after a ";" in its body, is not the transaction's end)
        conn.execute(
            "DO $$ BEGIN RAISE EXCEPTION 'could not extend file: No space left on device' "
            "USING ERRCODE = 'disk_full'; END $$"
        )
    raise AssertionError("the store took the write")


@pytest.mark.parametrize("pool", ["thread", "child"])
def test_a_handlers_statement_that_meets_a_full_store_is_given_back_uncharged_with_pauses(
    make_app: Make,
    effects: EffectsStore,
    store_url: str,
    pool: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The handler's own write in its ctx.transaction() meets a full store, and the
    store's error escapes the handler: nothing of the transaction is written, and that is
    the store's failure, not the job's. It was the handler's exception: charged, and dead
    after its retries (here at once: on SQLite as TransactionEnded, since SQLite rolls
    the whole transaction back on SQLITE_FULL, savepoint and all), so a disk-full
    incident sent jobs to the dead-letter queue. The job is given back uncharged with a
    growing pause, as when its COMMIT meets a full store, and completes once there is
    room: on attempt 1, its effect written once."""
    monkeypatch.setattr(recorder, "UNWRITABLE_PAUSE", PAUSE, raising=False)
    effects.create(TX_TABLES)
    app = make_app()
    releases = Releases(app, monkeypatch)
    seen: list[str] = []
    app.events.subscribe(lambda e: seen.append(e.name))
    full: list[int] = []

    @app.job(name="full.statement", retries=0)
    def full_statement(ctx: errands.Context, n: int) -> int:
        if len(full) < 2:  # the disk is full for its first two runs
            full.append(ctx.attempt)
            _statement_meets_a_full_store(ctx, store_url)
        write_effect(ctx, store_url, n)
        return n

    handle = full_statement.enqueue(n=5)
    with worker_on(app, pool, monkeypatch) as children:
        assert handle.result(timeout=30) == 5
    if children is not None:  # the child said why, and the worker gave the job back
        kinds = [payload[3] for ok, payload in children.answers if not ok]
        assert kinds == [process_child.UNWRITABLE] * 2, children.answers
    job = handle.job()
    assert (job.state, job.attempt) == (errands.JobState.COMPLETED, 1), job.errors
    assert full == [1, 1]  # uncharged: each run on attempt 1
    assert [e.kind for e in job.errors] == ["released"] * 2, job.errors
    assert all("cannot be written now" in e.message for e in job.errors), job.errors
    _assert_growing_pauses(job, releases.delays, 2)
    assert _rows(effects, handle.id) == [(5, 1)]
    assert "errands.job.dead" not in seen and "errands.job.retrying" not in seen, seen


def test_a_handler_that_raises_its_own_error_on_a_full_store_is_charged(
    make_app: Make, effects: EffectsStore, store_url: str
) -> None:
    """A handler that catches the store's error and raises one of its own (chained to
    it) has decided what the failure is: charged as usual (here dead: no retries left),
    not given back. Only the store's error itself, let through, is the store's."""
    effects.create(TX_TABLES)
    app = make_app()

    @app.job(name="full.own_error", retries=0)
    def own_error(ctx: errands.Context) -> None:
        try:
            _statement_meets_a_full_store(ctx, store_url)
        except (sqlite3.Error, psycopg.Error) as exc:
            raise ValueError("could not record the order") from exc

    handle = own_error.enqueue()
    with running_worker(app, concurrency=1, maintenance=False):
        wait_until(lambda: handle.status().is_terminal, what="the job to end")
    job = handle.job()
    assert job.state is errands.JobState.DEAD, job.errors
    [failure] = job.errors
    assert (failure.kind, failure.type) == ("transient", "ValueError"), failure


def _own_database_cannot_write(kind: str, folder: Path) -> None:
    """A database of the handler's own (not errands' store) that raises sqlite3's error
    for a file that cannot be written: a path that cannot be opened (SQLITE_CANTOPEN),
    a file opened read-only (SQLITE_READONLY), a file at its size limit (SQLITE_FULL)."""
    if kind == "cantopen":
        with closing(sqlite3.connect("/nonexistent-dir/cache.db")) as own:
            own.execute("CREATE TABLE t (x)")
    path = folder / f"own-{threading.get_ident()}.db"
    with closing(sqlite3.connect(path)) as own:
        own.execute("CREATE TABLE IF NOT EXISTS t (x)")
        own.commit()
        if kind == "full":
            pages = own.execute("PRAGMA page_count").fetchone()[0]
            own.execute(f"PRAGMA max_page_count = {pages}")
            own.execute("INSERT INTO t VALUES (zeroblob(2000000))")
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as own:
        own.execute("INSERT INTO t VALUES (1)")
    raise AssertionError(f"the handler's own database took the write ({kind})")


@pytest.mark.parametrize("pool", ["thread", "child"])
@pytest.mark.parametrize("kind", ["cantopen", "readonly"])
def test_a_handlers_own_sqlite_error_after_its_transaction_is_charged_and_dead_after_retries(
    make_app: Make,
    effects: EffectsStore,
    store_url: str,
    tmp_path: Path,
    kind: str,
    pool: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A handler opened ctx.transaction() and then failed on a database of its own, with
    sqlite3's error for a file that cannot be written (a cache file at a path that does
    not exist, a read-only file): the handler's failure, not the store's. It
    was taken for the store's (any sqlite3 error of those codes, whichever connection
    raised it): given back uncharged with a pause, for ever (attempt 0, never dead), its
    side effects outside the transaction repeated on every run. Charged now: retried,
    then dead after its retries, nothing of its transaction written."""
    monkeypatch.setattr(recorder, "UNWRITABLE_PAUSE", 0.01, raising=False)
    effects.create(TX_TABLES)
    app = make_app()
    runs: list[int] = []

    @app.job(name="own.sqlite", retries=1, backoff=0.01)
    def own_sqlite(ctx: errands.Context, n: int) -> None:
        runs.append(ctx.attempt)
        write_effect(ctx, store_url, n)
        _own_database_cannot_write(kind, tmp_path)

    handle = own_sqlite.enqueue(n=1)
    with worker_on(app, pool, monkeypatch):
        wait_until(lambda: handle.status().is_terminal, timeout=20, what="the job to end")
    job = handle.job()
    assert (job.state, job.attempt) == (errands.JobState.DEAD, 2), job.errors
    assert [(e.kind, e.type) for e in job.errors] == [("transient", "OperationalError")] * 2
    assert runs == [1, 2]
    assert _rows(effects, handle.id) == []


@pytest.mark.parametrize("pool", ["thread", "child"])
def test_a_full_disk_met_on_a_database_of_the_handlers_own_is_given_back_uncharged(
    make_app: Make,
    effects: EffectsStore,
    store_url: str,
    tmp_path: Path,
    pool: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A full disk is no fault of the job's wherever it is met (a database of the
    handler's own, most often on the same disk as the store; errands' own connection
    through a path that leaves no mark on it): given back uncharged with the pause, as
    the store's, and the job completes once there is room."""
    monkeypatch.setattr(recorder, "UNWRITABLE_PAUSE", 0.01, raising=False)
    effects.create(TX_TABLES)
    app = make_app()
    runs: list[int] = []

    @app.job(name="own.full", retries=0)
    def own_full(ctx: errands.Context, n: int) -> None:
        runs.append(ctx.attempt)
        write_effect(ctx, store_url, n)
        if len(runs) == 1:
            _own_database_cannot_write("full", tmp_path)

    handle = own_full.enqueue(n=5)
    with worker_on(app, pool, monkeypatch):
        wait_until(lambda: handle.status().is_terminal, timeout=20, what="the job to end")
    job = handle.job()
    assert (job.state, job.attempt) == (errands.JobState.COMPLETED, 1), job.errors
    assert [e.kind for e in job.errors] == ["released"]
    assert _rows(effects, handle.id) == [(5, 1)]


@pytest.mark.parametrize("backend", ["sqlite"])
def test_a_handlers_generator_that_fails_inside_executemany_is_charged(
    make_app: Make,
    effects: EffectsStore,
    store_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rows of ``tx.executemany`` come from a generator of the handler's that fails
    on a read-only file of its own: the handler's error, charged (here dead, no retries
    left). Run inside the driver's call, it read as an error of errands' connection: the
    job was given back uncharged again and again."""
    monkeypatch.setattr(recorder, "UNWRITABLE_PAUSE", 0.01, raising=False)
    effects.create(TX_TABLES)
    app = make_app()

    def rows(job_id: int, n: int) -> Iterator[tuple[int, int, int]]:
        yield (job_id, n, 1)
        _own_database_cannot_write("readonly", tmp_path)

    @app.job(name="own.rows", retries=0)
    def own_rows(ctx: errands.Context, n: int) -> None:
        table = EffectsStore.qualified(store_url, "tx_effects")
        sql = f"INSERT INTO {table} (job_id, n, attempt) VALUES (?, ?, ?)"
        ctx.transaction().executemany(sql, rows(ctx.job_id, n))

    handle = own_rows.enqueue(n=6)
    with running_worker(app, concurrency=1, maintenance=False):
        wait_until(lambda: handle.status().is_terminal, timeout=20, what="the job to end")
    job = handle.job()
    assert job.state is errands.JobState.DEAD, job.errors
    assert [(e.kind, e.type) for e in job.errors] == [("transient", "OperationalError")]


def test_a_job_whose_own_commit_meets_a_full_store_past_the_backstop_is_not_charged(
    make_app: Make,
    effects: EffectsStore,
    store_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The backstop charges a job given back too many times in a row for an error that
    may not be the store's; errands' own COMMIT meeting a full store is the store's for
    certain, and its handler returned: never charged, however many times (here past a
    backstop of 2), and it completes once the store can write."""
    monkeypatch.setattr(recorder, "UNWRITABLE_PAUSE", 0.01, raising=False)
    monkeypatch.setattr(recorder, "UNWRITABLE_GIVE_BACKS_MAX", 2, raising=False)
    effects.create(TX_TABLES)
    app = make_app()

    @app.job(name="commit.full", retries=0)
    def commit_full(ctx: errands.Context, n: int) -> None:
        write_effect(ctx, store_url, n)

    handle = commit_full.enqueue(n=7)
    with (
        failing("before_complete_commit", _cannot_write(store_url), 4) as refused,
        running_worker(app, concurrency=1, maintenance=False),
    ):
        wait_until(lambda: handle.status().is_terminal, timeout=30, what="the job to end")
    assert len(refused) == 4
    job = handle.job()
    assert (job.state, job.attempt) == (errands.JobState.COMPLETED, 1), job.errors
    assert [e.kind for e in job.errors] == ["released"] * 4
    assert _rows(effects, handle.id) == [(7, 1)]


@pytest.mark.parametrize("pool", ["thread", "child"])
def test_a_transaction_that_cannot_open_on_a_store_that_cannot_write_is_given_back(
    make_app: Make,
    effects: EffectsStore,
    store_url: str,
    pool: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ctx.transaction() fails to open because the store cannot write (errands' own
    call raised it: the store's error, marked as its transaction's), and the handler
    lets that error through: given back uncharged, as a statement in it meeting a full
    store is, and the job completes once the store can write."""
    monkeypatch.setattr(recorder, "UNWRITABLE_PAUSE", 0.01, raising=False)
    effects.create(TX_TABLES)
    app = make_app()
    begin = app.backend.tx_begin
    refused: list[int] = []

    def tx_begin() -> Any:
        if len(refused) < 2:
            refused.append(1)
            raise _cannot_write(store_url)
        return begin()

    monkeypatch.setattr(app.backend, "tx_begin", tx_begin)

    @app.job(name="full.open", retries=0)
    def full_open(ctx: errands.Context, n: int) -> int:
        write_effect(ctx, store_url, n)
        return n

    handle = full_open.enqueue(n=6)
    with worker_on(app, pool, monkeypatch):
        assert handle.result(timeout=30) == 6
    job = handle.job()
    assert (job.state, job.attempt) == (errands.JobState.COMPLETED, 1), job.errors
    assert [e.kind for e in job.errors] == ["released"] * 2, job.errors
    assert _rows(effects, handle.id) == [(6, 1)]


@pytest.mark.parametrize("backend", ["sqlite"])  # (a full file: SQLite's max_page_count)
def test_an_enqueue_in_the_transaction_that_meets_a_full_store_is_given_back(
    make_app: Make, effects: EffectsStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An enqueue given ctx.transaction()'s connection (``conn=``) that meets a full store
    raises errands' StorageFull, from that connection: the store's error, given back
    uncharged when the handler lets it through, as its own statement's would be."""
    monkeypatch.setattr(recorder, "UNWRITABLE_PAUSE", 0.01, raising=False)
    app = make_app()
    full: list[int] = []

    @app.job(name="full.child")
    def full_child(blob: str) -> None:
        return None

    @app.job(name="full.enqueue", retries=0)
    def full_enqueue(ctx: errands.Context) -> int:
        tx = ctx.transaction()
        if len(full) < 2:
            full.append(ctx.attempt)
            pages = tx.execute("PRAGMA page_count").fetchone()[0]
            tx.execute(f"PRAGMA max_page_count = {pages}")  # this connection's: no room
            blob = "x" * 100_000
            app.enqueue_many([full_child.bind(blob=f"{blob}{i}") for i in range(20)], tx.raw)
            raise AssertionError("the store took the write")
        full_child.enqueue(blob="small", conn=tx.raw)
        return 1

    handle = full_enqueue.enqueue()
    with running_worker(app, concurrency=1, maintenance=False):
        assert handle.result(timeout=30) == 1
    job = handle.job()
    assert (job.state, job.attempt) == (errands.JobState.COMPLETED, 1), job.errors
    assert full == [1, 1]
    assert [e.kind for e in job.errors] == ["released"] * 2, job.errors
    assert all("StorageFull" in e.message for e in job.errors), job.errors


@pytest.mark.parametrize("backend", ["sqlite"])  # (SQLite's ATTACH)
def test_a_handlers_attach_of_a_file_that_cannot_be_opened_is_charged(
    make_app: Make, effects: EffectsStore, store_url: str
) -> None:
    """A statement of the handler's on ctx.transaction() that fails on a path of its own
    (an ATTACH of a file in a folder that does not exist: SQLITE_CANTOPEN) is a bug of the
    handler's, not a store that cannot write: charged (here dead, no retries left). It
    was given back uncharged, for ever."""
    effects.create(TX_TABLES)
    app = make_app()

    @app.job(name="own.attach", retries=0)
    def own_attach(ctx: errands.Context, n: int) -> None:
        write_effect(ctx, store_url, n)
        ctx.transaction().execute("ATTACH DATABASE '/nonexistent-dir/cache.db' AS cache")

    handle = own_attach.enqueue(n=3)
    with running_worker(app, concurrency=1, maintenance=False):
        wait_until(lambda: handle.status().is_terminal, timeout=20, what="the job to end")
    job = handle.job()
    assert job.state is errands.JobState.DEAD, job.errors
    [failure] = job.errors
    assert (failure.kind, failure.type) == ("transient", "OperationalError"), failure
    assert _rows(effects, handle.id) == []


@pytest.mark.parametrize(
    ("backend", "how"),
    [
        ("sqlite", "raised"),
        ("postgres", "raised"),
        ("postgres", "own_connection"),  # (a PostgreSQL connection of the handler's own)
        ("postgres", "own_connection_after_abort"),
    ],
)
def test_a_handlers_own_postgresql_class_53_error_is_charged(
    make_app: Make, effects: EffectsStore, store_url: str, how: str
) -> None:
    """A PostgreSQL error of class 53 other than a full disk (too_many_connections) that
    did not come from errands' transaction connection: one the handler raised itself,
    or one a PostgreSQL connection of its own met (even while errands' transaction had
    failed earlier on an error of the handler's, caught). The handler's failure: charged
    (here dead, no retries left), not given back uncharged for ever as the store's. (A
    full disk is given back wherever it is met: see the test above.)"""
    effects.create(TX_TABLES)
    app = make_app()

    @app.job(name="own.disk_full", retries=0)
    def own_disk_full(ctx: errands.Context, n: int) -> None:
        write_effect(ctx, store_url, n)
        if how == "raised":
            raise psycopg.errors.TooManyConnections("sorry, too many clients already")
        if how == "own_connection_after_abort":  # errands' transaction: failed, caught
            with suppress(psycopg.errors.DivisionByZero):
                ctx.transaction().raw.execute("SELECT 1 / 0")
        effects.execute(  # a connection of the handler's own
            "DO $$ BEGIN RAISE EXCEPTION 'sorry, too many clients already' "
            "USING ERRCODE = 'too_many_connections'; END $$"
        )

    handle = own_disk_full.enqueue(n=2)
    with running_worker(app, concurrency=1, maintenance=False):
        wait_until(lambda: handle.status().is_terminal, timeout=20, what="the job to end")
    job = handle.job()
    assert job.state is errands.JobState.DEAD, job.errors
    [failure] = job.errors
    assert (failure.kind, failure.type) == ("transient", "TooManyConnections"), failure
    assert _rows(effects, handle.id) == []


@pytest.mark.parametrize("backend", ["postgres"])  # (a PostgreSQL server's limit)
def test_a_handlers_statement_past_its_own_temp_file_limit_is_charged(
    make_app: Make, effects: EffectsStore, store_url: str
) -> None:
    """A statement of the handler's in ctx.transaction() that needs more temporary file
    space than temp_file_limit allows (SQLSTATE 53400, class 53 like a full disk): the
    same statement meets it again however long it waits, so it is the handler's failure,
    charged (here dead, no retries left). Taken for a store that cannot write, the job
    was given back uncharged, again and again."""
    effects.create(TX_TABLES)
    app = make_app()

    @app.job(name="own.big_sort", retries=0)
    def big_sort(ctx: errands.Context, n: int) -> None:
        write_effect(ctx, store_url, n)
        tx = ctx.transaction()
        tx.execute("SET LOCAL temp_file_limit = '1kB'")  # (as a server's own setting)
        tx.execute("SET LOCAL work_mem = '64kB'")
        tx.execute("SELECT g FROM generate_series(1, 300000) g ORDER BY g DESC").fetchall()

    handle = big_sort.enqueue(n=4)
    with running_worker(app, concurrency=1, maintenance=False):
        wait_until(lambda: handle.status().is_terminal, timeout=20, what="the job to end")
    job = handle.job()
    assert job.state is errands.JobState.DEAD, job.errors
    [failure] = job.errors
    assert failure.type == "ConfigurationLimitExceeded", failure
    assert _rows(effects, handle.id) == []


@pytest.mark.parametrize("pool", ["thread", "child"])
def test_a_job_given_back_for_a_store_that_cannot_write_too_many_times_is_charged(
    make_app: Make,
    effects: EffectsStore,
    store_url: str,
    pool: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The backstop: a job given back uncharged for a store that cannot write
    UNWRITABLE_GIVE_BACKS_MAX times in a row (here 2) is charged its attempt on the
    next, with a failure that says the store could not be written for that long (here
    dead: no retries left), so that no job loops for ever, even on an error taken for
    the store's by mistake. It was given back again and again, without end."""
    monkeypatch.setattr(recorder, "UNWRITABLE_PAUSE", 0.01, raising=False)
    monkeypatch.setattr(recorder, "UNWRITABLE_GIVE_BACKS_MAX", 2, raising=False)
    effects.create(TX_TABLES)
    app = make_app()
    runs: list[int] = []

    @app.job(name="full.for_good", retries=0)
    def full_for_good(ctx: errands.Context) -> None:
        runs.append(ctx.attempt)
        _statement_meets_a_full_store(ctx, store_url)

    handle = full_for_good.enqueue()
    with worker_on(app, pool, monkeypatch):
        wait_until(lambda: handle.status().is_terminal, timeout=20, what="the job to end")
    job = handle.job()
    assert (job.state, job.attempt) == (errands.JobState.DEAD, 1), job.errors
    assert runs == [1, 1, 1]
    assert [e.kind for e in job.errors] == ["released", "released", "transient"], job.errors
    failure = job.errors[-1]
    assert failure.type == "RuntimeError", failure
    assert "cannot be written now 3 times in a row" in failure.message, failure
    assert "the attempt is charged" in failure.message, failure


@pytest.mark.parametrize("backend", ["sqlite"])  # PostgreSQL refuses it itself (aborted)
def test_a_statement_after_sqlite_rolled_the_transaction_back_itself_is_refused(
    make_app: Make, effects: EffectsStore, store_url: str
) -> None:
    """SQLite rolls the whole transaction of ctx.transaction() back on SQLITE_FULL,
    errands' savepoint with it. A handler that catches that error and carries on wrote
    in autocommit mode: its next write was committed on its own, outside the completion
    (and the job then failed as TransactionEnded, dead). That statement is refused now,
    as PostgreSQL refuses one in an aborted transaction: nothing of it is written, and
    the error, the handler's to let through, is charged as usual."""
    effects.create(TX_TABLES)
    app = make_app()

    @app.job(name="full.carries_on", retries=0)
    def carries_on(ctx: errands.Context, n: int) -> int:
        with suppress(sqlite3.OperationalError):
            _statement_meets_a_full_store(ctx, store_url)
        write_effect(ctx, store_url, n)
        return n

    handle = carries_on.enqueue(n=7)
    with running_worker(app, concurrency=1, maintenance=False):
        wait_until(lambda: handle.status().is_terminal, what="the job to end")
    job = handle.job()
    assert job.state is errands.JobState.DEAD, job.errors
    [failure] = job.errors
    assert failure.type == "RuntimeError" and "rolled this transaction back" in failure.message
    assert _rows(effects, handle.id) == []


@pytest.mark.parametrize("backend", ["sqlite"])  # (PostgreSQL rolls back nothing itself)
@pytest.mark.parametrize("pool", ["thread", "child"])
def test_a_raw_statement_that_makes_sqlite_roll_back_itself_is_given_back_uncharged(
    make_app: Make,
    effects: EffectsStore,
    store_url: str,
    pool: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The handler's write through ``ctx.transaction().raw`` meets a full SQLite file:
    SQLite rolls the whole transaction back, errands' savepoint with it, and the store's
    error escapes the handler. errands did not see that statement (only its own
    connection's were watched), so the missing savepoint read as the handler ending the
    transaction: TransactionEnded, dead at once. It is SQLite's doing, seen whatever the
    path: given back uncharged with a pause, as through errands' connection."""
    monkeypatch.setattr(recorder, "UNWRITABLE_PAUSE", PAUSE, raising=False)
    effects.create(TX_TABLES)
    app = make_app()
    releases = Releases(app, monkeypatch)
    full: list[int] = []

    @app.job(name="full.raw", retries=0)
    def full_raw(ctx: errands.Context, n: int) -> int:
        if len(full) < 2:
            full.append(ctx.attempt)
            _statement_meets_a_full_store(ctx, store_url, raw=True)
        write_effect(ctx, store_url, n)
        return n

    handle = full_raw.enqueue(n=3)
    with worker_on(app, pool, monkeypatch) as children:
        assert handle.result(timeout=30) == 3
    if children is not None:
        kinds = [payload[3] for ok, payload in children.answers if not ok]
        assert kinds == [process_child.UNWRITABLE] * 2, children.answers
    job = handle.job()
    assert (job.state, job.attempt) == (errands.JobState.COMPLETED, 1), job.errors
    assert full == [1, 1]
    assert [e.kind for e in job.errors] == ["released"] * 2, job.errors
    _assert_growing_pauses(job, releases.delays, 2)
    assert _rows(effects, handle.id) == [(3, 1)]


@pytest.mark.parametrize("backend", ["sqlite"])
def test_a_handler_that_swallows_sqlites_own_rollback_through_raw_is_retried_not_dead(
    make_app: Make, effects: EffectsStore, store_url: str
) -> None:
    """The handler catches the full store's error of its ``.raw`` write and returns: its
    transaction is gone (SQLite rolled it back), so nothing of it commits and the attempt
    fails; that was TransactionEnded (dead for good, as if it had committed its writes
    itself). It is a failure as any other now, retried: the retry completes, its effect
    written once."""
    effects.create(TX_TABLES)
    app = make_app()

    @app.job(name="full.raw_swallowed", retries=1, backoff=0.01)
    def swallowed(ctx: errands.Context, n: int) -> int:
        if ctx.attempt == 1:
            with suppress(sqlite3.OperationalError):
                _statement_meets_a_full_store(ctx, store_url, raw=True)
            return -1
        write_effect(ctx, store_url, n)
        return n

    handle = swallowed.enqueue(n=8)
    with running_worker(app, concurrency=1, maintenance=False):
        assert handle.result(timeout=30) == 8
    job = handle.job()
    assert (job.state, job.attempt) == (errands.JobState.COMPLETED, 2), job.errors
    [failure] = job.errors
    assert failure.type == "RuntimeError" and "rolled back by SQLite" in failure.message
    assert _rows(effects, handle.id) == [(8, 2)]


@pytest.mark.parametrize("backend", ["sqlite"])
def test_a_raw_write_after_sqlite_rolled_the_transaction_back_fails_the_job_for_good(
    make_app: Make, effects: EffectsStore, store_url: str
) -> None:
    """After SQLite rolled the transaction back, the handler writes again through
    ``.raw`` (the very statement it ran before): that write ran in autocommit mode and is
    committed on its own. That is the handler ending the transaction (TransactionEnded,
    never run again, so the write exists once), even with the store's error let through
    afterwards: not SQLite's rollback, given back to run the write again."""
    effects.create(TX_TABLES)
    app = make_app()
    insert = "INSERT INTO tx_effects (job_id, n, attempt) VALUES (?, ?, ?)"

    @app.job(name="full.raw_carries_on", retries=3)
    def carries_on(ctx: errands.Context) -> None:
        raw = ctx.transaction().raw
        raw.execute(insert, (ctx.job_id, 1, ctx.attempt))
        with suppress(sqlite3.OperationalError):
            _statement_meets_a_full_store(ctx, store_url, raw=True, room=20)
        raw.execute(insert, (ctx.job_id, 2, ctx.attempt))  # committed on its own
        raise sqlite3.OperationalError("database or disk is full")

    handle = carries_on.enqueue()
    with running_worker(app, concurrency=1, maintenance=False):
        wait_until(lambda: handle.status().is_terminal, what="the job to end")
    job = handle.job()
    assert (job.state, job.attempt) == (errands.JobState.DEAD, 1), job.errors
    assert job.errors[-1].type == "TransactionEnded", job.errors
    assert _rows(effects, handle.id) == [(2, 1)]


@pytest.mark.parametrize("backend", ["sqlite"])
@pytest.mark.parametrize("raw", [False, True], ids=["connection", "raw"])
def test_a_step_after_sqlite_rolled_the_transaction_back_itself_is_not_stored(
    make_app: Make, effects: EffectsStore, store_url: str, raw: bool
) -> None:
    """After SQLite rolled the transaction of ctx.transaction() back, a ``ctx.step``
    stored its result on that connection in autocommit mode: committed on its own, so
    the retry skipped the step while the transaction's writes were gone. Its storage is
    refused as any statement is then; nothing of the attempt is stored."""
    effects.create(TX_TABLES)
    app = make_app()

    @app.job(name="full.step_after", retries=0)
    def step_after(ctx: errands.Context) -> int:
        with suppress(sqlite3.OperationalError):
            _statement_meets_a_full_store(ctx, store_url, raw=raw, room=20)
        return int(ctx.step("after", lambda: 5))

    handle = step_after.enqueue()
    with running_worker(app, concurrency=1, maintenance=False):
        wait_until(lambda: handle.status().is_terminal, what="the job to end")
    job = handle.job()
    assert job.state is errands.JobState.DEAD, job.errors
    [failure] = job.errors
    assert failure.type == "RuntimeError" and "rolled this transaction back" in failure.message
    assert app.backend.step_list(handle.id) == []
    assert _rows(effects, handle.id) == []


def test_a_child_whose_transactions_commit_reply_was_lost_reports_the_completion(
    make_app: Make, effects: EffectsStore, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process-pool child completed its job in its ctx.transaction(), and the COMMIT's
    reply was lost: the child reported a transient failure, which the worker wrote and
    the fence refused (a stale write; the workflow's settlement never announced). The
    child sends what its transaction's fan-in did with the failure (MaybeLanded); the
    worker's completer writes the failure, reads the job back once the fence refuses it,
    finds the completion, and reports it with that fan-in (as for its own threads)."""
    effects.create(TX_TABLES)
    app = make_app()
    seen: list[Any] = []
    app.events.subscribe(seen.append)

    @app.job(name="lost.tx", retries=2)
    def lost_tx(ctx: errands.Context, n: int) -> int:
        write_effect(ctx, store_url, n)
        return n

    handle = _batch_of_one(app, "lost", lost_tx.bind(n=3))
    with (
        failing("after_complete_commit", _reply_lost(store_url), 1) as lost,
        worker_on(app, "child", monkeypatch) as children,
    ):
        assert children is not None
        wait_until(lambda: app.workflow_status(handle.id).state == "succeeded", what="settle")
        wait_until(
            lambda: any(e.name == "errands.workflow.settled" for e in seen),
            what="the settled event",
        )
        wait_until(
            lambda: [j.state.value for j in app.jobs()] == ["completed"] * 2,
            what="the callback run",
        )
    assert lost == ["after_complete_commit"]
    # the member's answer: a failure that may have landed, with its completion's result
    # (the callback's: a result the worker writes, it used no ctx.transaction())
    [(member_ok, failure), (callback_ok, result)] = children.answers
    assert (member_ok, failure[3], callback_ok, result.written) == (
        False,
        "transient",
        True,
        None,
    ), children.answers
    assert isinstance(failure[5], process_child.MaybeLanded), failure
    assert failure[5].result_json == "3", failure
    member = next(j for j in app.jobs() if j.name == "lost.tx")
    assert (member.attempt, member.result, member.errors) == (1, 3, [])
    assert _rows(effects, member.id) == [(3, 1)]
    names = [e.name for e in seen]
    assert "errands.job.stale_write_rejected" not in names, names
    assert [(e["workflow_id"], e["state"]) for e in seen if e.name.endswith("settled")] == [
        (handle.id, "succeeded")
    ]


@pytest.mark.parametrize("pool", ["thread", "child"])
def test_a_completion_whose_commit_reply_was_lost_is_read_back_until_the_store_answers(
    make_app: Make,
    effects: EffectsStore,
    store_url: str,
    pool: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The COMMIT of a member's ctx.transaction() went through and its reply was lost,
    and the store was still away when the job was read back (twice). A process-pool
    child read it back once itself: failing, it reported a transient failure, which the
    worker wrote and the fence refused (errands.job.stale_write_rejected: a false alarm;
    no completed event, the workflow's settlement never announced). The worker's own
    thread path read it back once after the refusal, with the same result. Now both go
    through the completer, which reads the job back until the store answers: the
    completion is the attempt's outcome, reported with its fan-in."""
    effects.create(TX_TABLES)
    app = make_app()
    seen: list[Any] = []
    app.events.subscribe(seen.append)

    @app.job(name="unread.tx", retries=2)
    def unread_tx(ctx: errands.Context, n: int) -> int:
        write_effect(ctx, store_url, n)
        return n

    handle = _batch_of_one(app, "unread", unread_tx.bind(n=4))
    member_id = next(j.id for j in app.jobs() if j.name == "unread.tx")
    backend = app.backend
    read = backend.job_get_many
    unread: list[list[int]] = []

    def store_still_away(ids: list[int]) -> Any:
        """The member's reads after its lost reply fail, twice (the store still away)."""
        if lost and member_id in ids and len(unread) < 2:
            unread.append(list(ids))
            raise _reply_lost(store_url)
        return read(ids)

    monkeypatch.setattr(backend, "job_get_many", store_still_away)
    with (
        failing("after_complete_commit", _reply_lost(store_url), 1) as lost,
        worker_on(app, pool, monkeypatch),
    ):
        wait_until(lambda: app.workflow_status(handle.id).state == "succeeded", what="settle")
        wait_until(
            lambda: any(e.name == "errands.workflow.settled" for e in seen),
            what="the settled event",
        )
        wait_until(
            lambda: any(
                e.name in ("errands.job.completed", "errands.job.stale_write_rejected")
                and e["job_id"] == member_id
                for e in seen
            ),
            what="the member's outcome event",
        )
        wait_until(
            lambda: [j.state.value for j in app.jobs()] == ["completed"] * 2,
            what="the callback run",
        )
    assert lost == ["after_complete_commit"]
    assert unread == [[member_id]] * 2  # the store was away at two reads of the job
    member = next(j for j in app.jobs() if j.name == "unread.tx")
    assert (member.attempt, member.result, member.errors) == (1, 4, [])
    assert _rows(effects, member.id) == [(4, 1)]
    names = [e.name for e in seen if e.get("job_id", member_id) == member_id]
    assert "errands.job.stale_write_rejected" not in names, names
    assert "errands.job.completed" in names, names
    assert [(e["workflow_id"], e["state"]) for e in seen if e.name.endswith("settled")] == [
        (handle.id, "succeeded")
    ]


def test_a_batch_whose_reply_was_lost_is_read_back_until_the_store_answers(
    make_app: Make, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The completer's batch of outcomes (job_finish_many) committed, the member's end
    settling its workflow, and its reply was lost; the retry was refused (the lease is
    spent) and the store was still away when the job was read back. Read once, the
    completion was reported as a stale write (errands.job.stale_write_rejected: a false
    alarm; no completed event, the workflow's settlement never announced). The
    completer reads it back until the store answers, as for a ctx.transaction()."""
    app = make_app()
    seen: list[Any] = []
    app.events.subscribe(seen.append)

    @app.job(name="batch.member", retries=2)
    def member(n: int) -> int:
        return n

    handle = _batch_of_one(app, "batch", member.bind(n=5))
    member_id = next(j.id for j in app.jobs() if j.name == "batch.member")
    backend = app.backend
    read = backend.job_get_many
    unread: list[list[int]] = []

    def store_still_away(ids: list[int]) -> Any:
        """The completer's read of the member after the lost reply fails once (the store
        still away)."""
        if lost and member_id in ids and not unread and _on_the_completer():
            unread.append(list(ids))
            raise _reply_lost(store_url)
        return read(ids)

    monkeypatch.setattr(backend, "job_get_many", store_still_away)
    with (
        failing("after_finish_commit", _reply_lost(store_url), 1) as lost,
        running_worker(app, concurrency=1, maintenance=False),
    ):
        wait_until(lambda: app.workflow_status(handle.id).state == "succeeded", what="settle")
        wait_until(
            lambda: any(
                e.name in ("errands.job.completed", "errands.job.stale_write_rejected")
                and e["job_id"] == member_id
                for e in seen
            ),
            what="the member's outcome event",
        )
        wait_until(
            lambda: [j.state.value for j in app.jobs()] == ["completed"] * 2,
            what="the callback run",
        )
        wait_until(
            lambda: any(e.name == "errands.workflow.settled" for e in seen),
            what="the settled event",
        )
    assert lost == ["after_finish_commit"]
    assert unread == [[member_id]]  # the store was away at the first read of the job
    job = app.get_job(member_id)
    assert (job.state, job.attempt, job.result, job.errors) == (
        errands.JobState.COMPLETED,
        1,
        5,
        [],
    )
    names = [e.name for e in seen if e.get("job_id", member_id) == member_id]
    assert "errands.job.stale_write_rejected" not in names, names
    assert "errands.job.completed" in names, names
    assert [(e["workflow_id"], e["state"]) for e in seen if e.name.endswith("settled")] == [
        (handle.id, "succeeded")
    ]


def test_a_give_back_whose_reply_was_lost_is_read_back_until_the_store_answers(
    make_app: Make, effects: EffectsStore, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ctx.transaction() met a full store, so its job was given back; the release
    committed and its reply was lost, the retry was refused (the lease given back), and
    the store was still away when the job was read back. Read once, the give-back was
    reported as a stale write (errands.job.stale_write_rejected, outcome released: a
    false alarm, no released event). It is read back until the store answers: released,
    and the job runs again and completes, its effect written once."""
    effects.create(TX_TABLES)
    app = make_app()
    seen: list[Any] = []
    app.events.subscribe(seen.append)

    @app.job(name="release.tx", retries=0)
    def release_tx(ctx: errands.Context, n: int) -> int:
        write_effect(ctx, store_url, n)
        return n

    handle = release_tx.enqueue(n=7)
    backend = app.backend
    release, read = backend.job_release_many, backend.job_get_many
    lost: list[str] = []
    unread: list[list[int]] = []

    def release_reply_lost(*args: Any, **kwargs: Any) -> Any:
        """The release commits; the reply to its first try is lost."""
        done = release(*args, **kwargs)
        if not lost:
            lost.append("release")
            raise _reply_lost(store_url)
        return done

    def store_still_away(ids: list[int]) -> Any:
        """The completer's read of the job after the lost reply fails once (the store
        still away; not the test's own reads, handle.result's)."""
        if lost and handle.id in ids and not unread and _on_the_completer():
            unread.append(list(ids))
            raise _reply_lost(store_url)
        return read(ids)

    monkeypatch.setattr(backend, "job_release_many", release_reply_lost)
    monkeypatch.setattr(backend, "job_get_many", store_still_away)
    with (
        failing("before_complete_commit", _cannot_write(store_url), 1) as refused,
        running_worker(app, concurrency=1, maintenance=False),
    ):
        assert handle.result(timeout=30) == 7
        wait_until(
            lambda: any(
                e.name in ("errands.job.released", "errands.job.stale_write_rejected") for e in seen
            ),
            what="the give-back's event",
        )
    assert (refused, lost, unread) == (["before_complete_commit"], ["release"], [[handle.id]])
    job = handle.job()
    assert (job.state, job.attempt) == (errands.JobState.COMPLETED, 1), job.errors
    assert [e.kind for e in job.errors] == ["released"], job.errors
    assert _rows(effects, handle.id) == [(7, 1)]
    names = [e.name for e in seen]
    assert "errands.job.stale_write_rejected" not in names, names
    assert names.count("errands.job.released") == 1, names


def test_drain_reports_a_run_given_back_by_a_full_store_and_runs_the_job_again(
    make_app: Make,
    errands_testing: Callable[..., Tester],
    effects: EffectsStore,
    store_url: str,
) -> None:
    """The test tools run the worker's code: a run whose completion met a full store is
    ``released`` (a release ended no run drain() waits for: it waited out its timeout),
    and the job runs again in the same drain, uncharged."""
    effects.create(TX_TABLES)
    app = make_app()

    @app.job(name="full.drained", retries=0)
    def drained(ctx: errands.Context, n: int) -> int:
        write_effect(ctx, store_url, n)
        return n

    handle = drained.enqueue(n=2)
    tester = errands_testing(app)
    with failing("before_complete_commit", _cannot_write(store_url), 1):
        result = tester.drain()
    assert [r.outcome for r in result.runs] == ["released", "completed"]
    assert [r.attempt for r in result.runs] == [1, 1]
    assert handle.result(timeout=5) == 2
    assert _rows(effects, handle.id) == [(2, 1)]
