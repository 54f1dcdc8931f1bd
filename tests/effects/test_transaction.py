"""``ctx.transaction()``: the handler's writes commit with the job's completion, or not at all.

In-process, on SQLite and PostgreSQL (the crash-at-the-commit half runs in real worker
processes: test_kill_storms.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from effects_store import TX_TABLES, EffectsStore

import errands
from errands.backends.base import ClaimParams, FinishParams, QueueClaim
from errands.testing import Tester

Make = Callable[..., Any]


def write_effect(ctx: errands.Context, store_url: str, n: int) -> None:
    """INSERT one tx_effects row through the completion transaction."""
    table = EffectsStore.qualified(store_url, "tx_effects")
    sql = f"INSERT INTO {table} (job_id, n, attempt) VALUES (%s, %s, %s)"
    conn = ctx.transaction()
    if EffectsStore.is_sqlite(store_url):
        sql = sql.replace("%s", "?")
    conn.execute(sql, (ctx.job_id, n, ctx.attempt))


def _rows(effects: EffectsStore, job_id: int) -> list[tuple[Any, ...]]:
    return effects.execute("SELECT n, attempt FROM tx_effects WHERE job_id = %s", (job_id,))


def test_write_through_the_transaction_is_rolled_back_when_the_handler_raises(
    make_app: Make,
    errands_testing: Callable[..., Tester],
    effects: EffectsStore,
    store_url: str,
) -> None:
    effects.create(TX_TABLES)
    app = make_app()

    @app.job(name="record", retries=2, backoff=1.0)
    def record(ctx: errands.Context, n: int) -> int:
        write_effect(ctx, store_url, n)
        if ctx.attempt == 1:
            raise RuntimeError("after the write")
        return n

    tester = errands_testing(app)
    handle = record.enqueue(n=4)
    drained = tester.drain(with_retries=False)

    assert drained.outcomes == {"retryable": 1}
    assert _rows(effects, handle.id) == []  # the failed attempt's write never happened

    assert tester.drain().completed == 1
    assert _rows(effects, handle.id) == [(4, 2)]  # committed with attempt 2's completion
    assert handle.status() is errands.JobState.COMPLETED


def test_handler_that_always_fails_leaves_no_effect_row_and_dies(
    make_app: Make,
    errands_testing: Callable[..., Tester],
    effects: EffectsStore,
    store_url: str,
) -> None:
    effects.create(TX_TABLES)
    app = make_app()

    @app.job(name="doomed", retries=1, backoff=1.0, permanent=(ValueError,))
    def doomed(ctx: errands.Context) -> None:
        write_effect(ctx, store_url, 1)
        raise ValueError("invalid after the write")

    tester = errands_testing(app)
    handle = doomed.enqueue()
    assert tester.drain().dead == 1
    assert _rows(effects, handle.id) == []


def test_a_stale_attempt_cannot_commit_its_transaction(
    make_app: Make,
    errands_testing: Callable[..., Tester],
    effects: EffectsStore,
    store_url: str,
) -> None:
    """The lease is taken over while the handler runs (as a rescue and a new claim would):
    the handler still writes and returns, and its completion transaction — write included
    — is refused by the fence."""
    effects.create(TX_TABLES)
    app = make_app()
    started, proceed = threading.Event(), threading.Event()

    @app.job(name="slow_writer", retries=0)
    def slow_writer(ctx: errands.Context, n: int) -> int:
        started.set()
        proceed.wait(30)
        write_effect(ctx, store_url, n)
        return n

    tester = errands_testing(app)
    with tester.worker(concurrency=1):
        handle = slow_writer.enqueue(n=5)
        assert started.wait(30)
        # Another worker now holds the job (on SQLite this must happen before the handler
        # opens its transaction, which takes the database's write lock).
        effects.execute(
            "UPDATE errands_jobs SET lease_token = 'taken-over' WHERE id = %s", (handle.id,)
        )
        proceed.set()
        deadline = time.monotonic() + 30
        while not [r for r in tester.history if r.job_id == handle.id]:
            assert time.monotonic() < deadline, "the stale attempt never finished"
            time.sleep(0.02)

    [run] = [r for r in tester.history if r.job_id == handle.id]
    assert run.outcome == "rejected"
    assert _rows(effects, handle.id) == []
    job = handle.job()
    assert job.state is errands.JobState.RUNNING  # still the other worker's
    assert job.result is None


def test_transaction_connection_refuses_commit_and_the_job_dies_with_transaction_ended(
    make_app: Make,
    errands_testing: Callable[..., Tester],
    effects: EffectsStore,
    store_url: str,
) -> None:
    effects.create(TX_TABLES)
    app = make_app()

    @app.job(name="committer", retries=3)
    def committer(ctx: errands.Context) -> None:
        write_effect(ctx, store_url, 1)
        ctx.transaction().commit()

    tester = errands_testing(app)
    handle = committer.enqueue()
    assert tester.drain().dead == 1
    job = handle.job()
    assert job.last_error is not None
    assert job.last_error.type == "TransactionEnded"
    assert "commit is not allowed" in job.last_error.message
    assert _rows(effects, handle.id) == []


def test_a_statement_with_semicolons_inside_its_literals_or_body_runs_in_the_transaction(
    make_app: Make,
    errands_testing: Callable[..., Tester],
    effects: EffectsStore,
    store_url: str,
) -> None:
    """A ``;`` followed by END, COMMIT or ROLLBACK inside a string literal, a comment, a
    PostgreSQL dollar-quoted body or an SQLite trigger body is not a statement of its
    own: the text was split on every ``;``, so ``DO $$ BEGIN PERFORM 1; END $$`` was
    refused as END (TransactionEnded: the job dead for good). They run now, in the
    transaction that completes the job."""
    effects.create(TX_TABLES)
    app = make_app()

    @app.job(name="semicolons", retries=0)
    def semicolons(ctx: errands.Context, n: int) -> int:
        tx = ctx.transaction()
        tx.execute("SELECT '; COMMIT' AS a /* ; END */ -- ; ROLLBACK\n")
        if EffectsStore.is_sqlite(store_url):
            tx.execute(
                "CREATE TEMP TRIGGER semicolons AFTER INSERT ON tx_effects "
                "BEGIN SELECT 1; SELECT 2; END"
            )
        else:
            tx.execute("DO $$ BEGIN PERFORM 1; END $$")
            tx.execute(
                "CREATE FUNCTION pg_temp.semicolons() RETURNS int AS $body$ "
                "BEGIN RETURN 1; END; $body$ LANGUAGE plpgsql"
            )
        write_effect(ctx, store_url, n)
        return n

    tester = errands_testing(app)
    handle = semicolons.enqueue(n=9)
    assert tester.drain().completed == 1, handle.job().errors
    assert _rows(effects, handle.id) == [(9, 1)]


def test_completion_transaction_commits_from_another_thread_than_the_one_that_opened_it(
    make_app: Make, effects: EffectsStore, store_url: str
) -> None:
    """The worker commits ctx.transaction() on whichever thread decides the outcome (the
    handler's, the claimer's when the handler already finished, the lease keeper's on a
    timeout). On SQLite that once failed with "SQLite objects created in a thread can only
    be used in that same thread" and leaked the write lock, freezing every worker."""
    effects.create(TX_TABLES)
    app = make_app()

    @app.job(name="noop_tx")
    def noop_tx() -> None: ...

    handle = noop_tx.enqueue()
    backend = app.backend
    [row] = backend.job_claim(ClaimParams([QueueClaim("default", 1)], 1, "w-test", 30.0))
    opened: dict[str, Any] = {}

    def open_and_write() -> None:
        conn = backend.tx_begin()
        table = EffectsStore.qualified(store_url, "tx_effects")
        sql = f"INSERT INTO {table} (job_id, n, attempt) VALUES (%s, 1, 1)"
        conn.execute(sql.replace("%s", "?") if effects.sqlite else sql, (handle.id,))
        opened["conn"] = conn

    thread = threading.Thread(target=open_and_write)
    thread.start()
    thread.join(30)

    outcome = FinishParams(row.id, row.lease_token or "", "completed", result_json="null")
    assert backend.tx_finish(opened["conn"], outcome) is True
    assert _rows(effects, handle.id) == [(1, 1)]
    assert handle.status() is errands.JobState.COMPLETED
    noop_tx.enqueue()  # the store is not left locked


def test_transaction_is_refused_on_an_in_memory_sqlite_store(
    errands_testing: Callable[..., Tester],
) -> None:
    app = errands.App("sqlite:///:memory:")
    try:

        @app.job(name="in_memory", retries=0)
        def in_memory(ctx: errands.Context) -> None:
            ctx.transaction()

        tester = errands_testing(app)
        handle = in_memory.enqueue()
        assert tester.drain().outcomes == {"dead": 1}
        job = handle.job()
        assert job.last_error is not None
        assert "needs a file database" in job.last_error.message
    finally:
        app.close()


def test_a_handler_that_sets_its_own_row_factory_still_completes_its_steps_and_workflow(
    make_app: Make, errands_testing: Callable[..., Tester], store_url: str
) -> None:
    """A handler asks its ctx.transaction() for dict rows (psycopg's dict_row, a sqlite3
    row factory): errands' own statements in it read their rows by position all the same.
    On SQLite the completion's workflow fan-in read column names and released nothing
    (the dependent waited for ever); a ctx.step in the transaction raised KeyError: 0 on
    every attempt."""
    app = make_app()
    ran: list[str] = []

    def dict_rows(conn: Any) -> None:
        if EffectsStore.is_sqlite(store_url):
            conn.row_factory = lambda cursor, row: {
                d[0]: v for d, v in zip(cursor.description, row, strict=True)
            }
            conn.text_factory = bytes
        else:
            from psycopg.rows import dict_row

            conn.row_factory = dict_row

    @app.job(name="rows.parent")
    def parent(ctx: errands.Context) -> int:
        dict_rows(ctx.transaction())
        value = ctx.step("once", lambda: 41) + 1
        ran.append("parent")
        return value

    @app.job(name="rows.child")
    def child(ctx: errands.Context) -> None:
        ran.append("child")

    wf = errands.Workflow("rows")
    wf.add(child.bind(), after=[wf.add(parent.bind())])
    tester = errands_testing(app)
    handle = app.enqueue_workflow(wf)
    status = tester.drain_workflow(handle)
    assert (status.state, status.completed) == ("succeeded", 2)
    assert ran == ["parent", "child"]
