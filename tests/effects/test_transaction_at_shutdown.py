"""``ctx.transaction()`` at a graceful stop, on SQLite and PostgreSQL, with real workers
in threads: a job is recorded ``completed`` only with its transaction's writes (I3).

At the end of the grace period the stop asks the handlers still running to stop and lets
go of (rolls back) their transactions. It used to do so without taking their outcome
first: a handler returning at that very moment (it had read no stop yet) went on to
decide after the transaction was gone, and its completion was written outside it, the
job ``completed`` with none of its writes. Now the stop takes each attempt over in one
step with its handler's decision: a handler that decided first keeps its outcome (and
commits it in its transaction); one that did not records nothing, and the job is given
back (released, uncharged). As a backstop, a handler returning after its transaction was
let go of never completes the job outside it: the job is given back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from effects_store import TX_TABLES, EffectsStore

import errands
from errands import JobState
from errands.worker.recorder import OutcomeRecorder
from errands.worker.runtime import AttemptRuntime
from tests.integration.helpers import WorkerThread, wait_until

Make = Callable[..., Any]


def write_effect(ctx: errands.Context, store_url: str) -> None:
    """INSERT one tx_effects row through the completion transaction."""
    table = EffectsStore.qualified(store_url, "tx_effects")
    sql = f"INSERT INTO {table} (job_id, n, attempt) VALUES (%s, %s, %s)"
    if EffectsStore.is_sqlite(store_url):
        sql = sql.replace("%s", "?")
    ctx.transaction().execute(sql, (ctx.job_id, 1, ctx.attempt))


def _rows(effects: EffectsStore, job_id: int) -> list[tuple[Any, ...]]:
    return effects.execute("SELECT n, attempt FROM tx_effects WHERE job_id = %s", (job_id,))


def test_a_transaction_handler_returning_as_the_grace_ends_is_never_completed_without_its_writes(
    make_app: Make,
    effects: EffectsStore,
    store_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The handler returns as the grace period ends and its thread is preempted right
    before it decides (held here until the stop has let go of its transaction; another
    job, in a durable step across the stop, keeps the stop from giving jobs back
    meanwhile, as the code before took the outcome only then). The job is given back,
    uncharged, its transaction's writes rolled back: never ``completed`` without them."""
    effects.create(TX_TABLES)
    app = make_app()
    let_go = threading.Event()  # the stop let go of the transaction job's transaction
    held = threading.Event()  # its handler returned, and waits to decide
    decided = threading.Event()  # ... and has decided (or been refused)
    finish = threading.Event()  # the other job's step may end

    @app.job(name="stop.tx", retries=3)
    def tx_job(ctx: errands.Context) -> str:
        write_effect(ctx, store_url)
        return "done"

    @app.job(name="stop.step", retries=3)
    def step_job(ctx: errands.Context) -> str:
        def charge() -> str:
            with errands.shielded():  # a provider call across the stop
                finish.wait(120)
            return "ch"

        return str(ctx.step("charge", charge))

    real_decided = OutcomeRecorder.decided

    def preempted(self: OutcomeRecorder, attempt: Any, *args: Any, **kwargs: Any) -> bool:
        if attempt.row.name != "stop.tx" or kwargs.get("handler_running"):
            return real_decided(self, attempt, *args, **kwargs)
        held.set()
        let_go.wait(60)  # preempted after it read no stop, until the stop let go
        try:
            return real_decided(self, attempt, *args, **kwargs)
        finally:
            decided.set()

    real_let_go = AttemptRuntime.let_go

    def letting_go(self: AttemptRuntime) -> None:
        real_let_go(self)
        if self.attempt.row.name == "stop.tx":  # (its transaction taken, on its own thread)
            wait_until(lambda: self.tx is None, timeout=60, what="the transaction let go of")
            let_go.set()

    monkeypatch.setattr(OutcomeRecorder, "decided", preempted)
    monkeypatch.setattr(AttemptRuntime, "let_go", letting_go)

    worker = WorkerThread(app, grace=0.2, abandon_after=300, concurrency=2, prefetch=0).start()
    stopper: threading.Thread | None = None
    try:
        step_handle = step_job.enqueue()
        wait_until(lambda: step_handle.status() is JobState.RUNNING, timeout=30, what="step")
        wait_until(
            lambda: any(s == ["charge"] for s in _steps_running(worker)),
            timeout=30,
            what="the other job in its step",
        )
        handle = tx_job.enqueue()
        assert held.wait(30), "the transaction job's handler never returned"
        stopper = threading.Thread(target=worker.stop, kwargs={"timeout": 120})
        stopper.start()  # like SIGTERM: the grace period ends with the handler deciding
        assert decided.wait(60), "the transaction job's handler never decided"
    finally:
        let_go.set()
        finish.set()
        if stopper is not None:
            stopper.join(120)
        else:
            worker.stop()

    job = handle.job()
    rows = _rows(effects, handle.id)
    # I3: completed exactly when its transaction's writes are there
    assert (job.state is JobState.COMPLETED) == bool(rows), (job.state, rows)
    # the stop took it over (the handler decided only after the stop let go): given back
    assert (job.state, job.attempt) == (JobState.AVAILABLE, 0), job.errors
    assert [e.kind for e in job.errors] == ["released"]
    assert rows == []


def _steps_running(worker: WorkerThread) -> list[list[str]]:
    return [a.runtime.steps_in_flight() for a in worker.worker.attempts() if a.runtime]


def test_a_handler_returning_after_its_transaction_was_let_go_of_is_given_back_not_completed(
    make_app: Make, effects: EffectsStore, store_url: str
) -> None:
    """The backstop: whoever let go of a handler's ctx.transaction() before its outcome
    was decided (nothing of it committed), the handler's return is not written as a plain
    completion outside it (the job ``completed`` with none of its writes). The job is
    given back, uncharged, and its next run completes it with its writes, once."""
    effects.create(TX_TABLES)
    app = make_app()
    written = threading.Event()
    go_on = threading.Event()

    @app.job(name="letgo.tx", retries=0)
    def tx_job(ctx: errands.Context) -> str:
        write_effect(ctx, store_url)
        if ctx.attempt == 1 and not go_on.is_set():
            written.set()
            go_on.wait(60)
        return "done"

    worker = WorkerThread(app).start()
    try:
        handle = tx_job.enqueue()
        assert written.wait(30)
        [attempt] = [a for a in worker.worker.attempts() if a.id == handle.id]
        runtime = attempt.runtime
        assert runtime is not None
        runtime.let_go()  # (no decision taken with it: what the stop did before)
        wait_until(lambda: runtime.tx is None, timeout=30, what="the transaction let go of")
        go_on.set()
        assert handle.result(timeout=60) == "done"
    finally:
        go_on.set()
        worker.stop()

    job = handle.job()
    assert (job.state, job.attempt) == (JobState.COMPLETED, 1)
    assert [e.kind for e in job.errors] == ["released"]  # given back: uncharged
    assert _rows(effects, handle.id) == [(1, 1)]  # the completing run's writes, once
