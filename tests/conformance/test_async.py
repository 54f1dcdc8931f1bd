"""The async API on every backend: ``ajob_insert_many`` with and without the caller's async
connection (driver, SQLAlchemy ``AsyncSession`` and ``AsyncConnection``), its commit and
rollback with the caller's transaction, and the App's async calls (``aenqueue``,
``aenqueue_many``, ``aresult``, ``astatus``, ``aget_job``, ``acancel``) with the same
outcomes and errors as the sync ones, including a cancelled awaiting task."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

import errands
from errands.backends import Backend
from errands.backends.base import ListParams

from .conftest import Harness
from .support import claim_one, finish, get, request

T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


def count(backend: Backend, name: str = "conformance.job") -> int:
    return len(backend.job_list(ListParams(name=name, limit=1000)))


@pytest.fixture
def app(backend: Backend) -> Iterator[errands.App]:
    """An App on the harness's store (the backend is the one under test)."""
    application = errands.App(backend.url)
    application._backend = backend
    yield application
    application.results.close()
    application._backend = None  # the backend fixture closes it


def test_ajob_insert_many_without_a_connection_stores_the_jobs(backend: Backend) -> None:
    """Without conn=, the async insert stores every job at once, in order."""
    results = run(backend.ajob_insert_many([request(), request(key="k")]))
    assert [r.deduplicated for r in results] == [False, False]
    assert [get(backend, r.id).state for r in results] == ["available", "available"]


def test_ajob_insert_many_commits_with_the_callers_async_connection(
    backend: Backend, harness: Harness, tmp_path: Path
) -> None:
    """Jobs inserted on the caller's async connection appear when the caller commits."""

    async def scenario() -> list[int]:
        conn = await harness.async_connection(backend, tmp_path, same_store=True)
        try:
            results = await backend.ajob_insert_many([request(), request()], conn=conn)
            assert count(backend) == 0, "visible before the caller's commit"
            await conn.commit()
            return [r.id for r in results]
        finally:
            await conn.close()

    ids = run(scenario())
    assert [get(backend, i).state for i in ids] == ["available", "available"]


def test_ajob_insert_many_rolls_back_with_the_callers_async_connection(
    backend: Backend, harness: Harness, tmp_path: Path
) -> None:
    """A rolled-back caller transaction keeps none of the jobs inserted in it."""

    async def scenario() -> None:
        conn = await harness.async_connection(backend, tmp_path, same_store=True)
        try:
            await backend.ajob_insert_many([request(), request(key="gone")], conn=conn)
            await conn.rollback()
        finally:
            await conn.close()

    run(scenario())
    assert count(backend) == 0
    assert run(backend.ajob_insert_many([request(key="gone")]))[0].deduplicated is False


def test_ajob_insert_many_deduplicates_keys_on_the_callers_async_connection(
    backend: Backend, harness: Harness, tmp_path: Path
) -> None:
    """A key already taken returns the existing job, deduplicated, as the sync insert does."""
    (first,) = backend.job_insert_many([request(key="once")])

    async def scenario() -> list[Any]:
        conn = await harness.async_connection(backend, tmp_path, same_store=True)
        try:
            results = await backend.ajob_insert_many(
                [request(key="once"), request(key="twice")], conn=conn
            )
            await conn.commit()
            return results
        finally:
            await conn.close()

    again, other = run(scenario())
    assert (again.id, again.deduplicated) == (first.id, True)
    assert other.deduplicated is False


def test_ajob_insert_many_refuses_an_async_connection_to_another_store(
    backend: Backend, harness: Harness, tmp_path: Path
) -> None:
    """An async connection to another database is refused and nothing is written."""

    async def scenario() -> None:
        conn = await harness.async_connection(backend, tmp_path, same_store=False)
        try:
            with pytest.raises(errands.ConfigurationError, match="connection to"):
                await backend.ajob_insert_many([request()], conn=conn)
        finally:
            await conn.close()

    run(scenario())
    assert count(backend) == 0


def test_ajob_insert_many_refuses_a_sync_connection(
    backend: Backend, harness: Harness, tmp_path: Path
) -> None:
    """A sync connection is not an async one: the error names what aenqueue takes."""
    with (
        harness.caller_connection(backend, tmp_path, same_store=True) as conn,
        pytest.raises(errands.ConfigurationError, match="aenqueue"),
    ):
        run(backend.ajob_insert_many([request()], conn=conn))
    assert count(backend) == 0


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_an_sqlalchemy_async_session_commits_or_rolls_back_the_job(
    backend: Backend, harness: Harness, outcome: str
) -> None:
    """A job enqueued in an AsyncSession's transaction shares its fate."""
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    async def scenario() -> None:
        engine = create_async_engine(harness.sqlalchemy_async_url(backend))
        try:
            async with AsyncSession(engine) as session:
                await session.begin()
                await backend.ajob_insert_many([request()], conn=session)
                await (session.commit() if outcome == "commit" else session.rollback())
        finally:
            await engine.dispose()

    run(scenario())
    assert count(backend) == (1 if outcome == "commit" else 0)


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_an_sqlalchemy_async_connection_commits_or_rolls_back_the_job(
    backend: Backend, harness: Harness, outcome: str
) -> None:
    """A job enqueued on an SQLAlchemy AsyncConnection shares its transaction's fate."""
    from sqlalchemy.ext.asyncio import create_async_engine

    async def scenario() -> None:
        engine = create_async_engine(harness.sqlalchemy_async_url(backend))
        try:
            async with engine.connect() as conn:
                transaction = await conn.begin()
                await backend.ajob_insert_many([request(), request()], conn=conn)
                await (transaction.commit() if outcome == "commit" else transaction.rollback())
        finally:
            await engine.dispose()

    run(scenario())
    assert count(backend) == (2 if outcome == "commit" else 0)


@pytest.mark.parametrize("outcome", ["commit", "close"])
def test_an_sqlalchemy_async_connection_used_commit_as_you_go_carries_the_job(
    backend: Backend, harness: Harness, outcome: str
) -> None:
    """The enqueue is the first statement on an AsyncConnection that began nothing (2.0's
    commit-as-you-go): it begins the transaction as a statement of the caller's would, so
    ``commit()`` stores the job and closing without it does not. SQLAlchemy's commit() had
    no transaction to commit, the pool rolled the job back, and the caller held the
    handle of a job that never was."""
    from sqlalchemy.ext.asyncio import create_async_engine

    async def scenario() -> None:
        engine = create_async_engine(harness.sqlalchemy_async_url(backend))
        try:
            async with engine.connect() as conn:
                await backend.ajob_insert_many([request()], conn=conn)
                if outcome == "commit":
                    await conn.commit()
        finally:
            await engine.dispose()

    run(scenario())
    assert count(backend) == (1 if outcome == "commit" else 0)


def test_an_async_connection_given_to_a_sync_enqueue_is_refused_naming_aenqueue(
    backend: Backend, harness: Harness
) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    async def scenario() -> None:
        engine = create_async_engine(harness.sqlalchemy_async_url(backend))
        try:
            async with engine.connect() as conn:
                with pytest.raises(errands.ConfigurationError, match="aenqueue"):
                    backend.job_insert_many([request()], conn=conn)
        finally:
            await engine.dispose()

    run(scenario())
    assert count(backend) == 0


def test_a_cancelled_aenqueue_in_the_callers_transaction_leaves_nothing_after_rollback(
    backend: Backend, harness: Harness, tmp_path: Path
) -> None:
    """Cancelling the task awaiting an enqueue on the caller's connection, then rolling
    back (as an aborted request does), stores nothing."""

    async def scenario() -> None:
        conn = await harness.async_connection(backend, tmp_path, same_store=True)
        try:
            insert = backend.ajob_insert_many([request() for _ in range(50)], conn=conn)
            task = asyncio.create_task(insert)
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await conn.rollback()
        finally:
            await conn.close()

    run(scenario())
    assert count(backend) == 0


# -- the App's async calls -------------------------------------------------------------------
def _jobs(app: errands.App) -> tuple[Any, Any]:
    @app.job(name="conformance.job")
    def add(a: int, b: int) -> int:
        return a + b

    @app.job(name="conformance.other")
    def other() -> None:
        return None

    return add, other


def test_aenqueue_and_aenqueue_many_store_validated_jobs(app: errands.App) -> None:
    """aenqueue and aenqueue_many validate like enqueue and return handles."""
    add, _ = _jobs(app)

    async def scenario() -> None:
        one = await add.aenqueue(a=1, b=2, key="sum")
        again = await add.aenqueue(a=1, b=2, key="sum")
        many = await app.aenqueue_many([add.bind(a=i, b=i) for i in range(3)])
        assert (again.id, again.deduplicated) == (one.id, True)
        assert len({h.id for h in many}) == 3
        assert await one.astatus() is errands.JobState.AVAILABLE
        assert (await app.aget_job(one.id)).args == {"a": 1, "b": 2}
        with pytest.raises(errands.InvalidPayload):
            await add.aenqueue(a="x", b=2)
        with pytest.raises(errands.JobNotFound):
            await app.aget_job(999_999)

    run(scenario())
    assert len(app.jobs(name="conformance.job")) == 4


def test_aresult_returns_the_result_and_raises_as_result_does(
    app: errands.App, backend: Backend
) -> None:
    """aresult returns a completed job's result; dead and cancelled jobs raise; a job
    still pending past the timeout raises ResultTimeout."""
    add, other = _jobs(app)
    done = add.enqueue(a=2, b=3)
    row = claim_one(backend)
    assert finish(backend, row, "completed", result_json="5")
    cancelled = other.enqueue()
    pending = other.enqueue(delay=3600)

    async def scenario() -> None:
        assert await done.aresult(timeout=5) == 5
        result = await cancelled.acancel()
        assert result.state == "cancelled"
        with pytest.raises(errands.JobCancelled):
            await cancelled.aresult(timeout=5)
        with pytest.raises(errands.ResultTimeout):
            await pending.aresult(timeout=0.1)

    run(scenario())


def test_aresult_raises_job_failed_for_a_dead_job(app: errands.App, backend: Backend) -> None:
    """A dead job's aresult raises JobFailed carrying the last error, as result() does."""
    add, _ = _jobs(app)
    handle = add.enqueue(a=1, b=1)
    row = claim_one(backend)
    assert finish(backend, row, "dead", error={"attempt": 1, "type": "Boom", "message": "no"})
    with pytest.raises(errands.JobFailed, match="Boom: no"):
        run(handle.aresult(timeout=5))


def test_cancelling_the_task_awaiting_aresult_stops_only_the_wait(
    app: errands.App, backend: Backend
) -> None:
    """The awaiting task is cancelled cleanly; the job is untouched and can still be
    awaited to completion afterwards."""
    add, _ = _jobs(app)
    handle = add.enqueue(a=4, b=4)

    async def scenario() -> None:
        waiter = asyncio.create_task(handle.aresult(timeout=30))
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert await handle.astatus() is errands.JobState.AVAILABLE
        row = claim_one(backend)
        assert finish(backend, row, "completed", result_json="8")
        assert await handle.aresult(timeout=5) == 8

    run(scenario())


def test_async_calls_keep_the_event_loop_free(app: errands.App) -> None:
    """While aenqueue and aresult wait on the store, other tasks keep running: a ticker
    scheduled every 5 ms never falls far behind."""
    add, _ = _jobs(app)

    async def scenario() -> float:
        worst = 0.0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal worst
            loop = asyncio.get_running_loop()
            while not stop.is_set():
                before = loop.time()
                await asyncio.sleep(0.005)
                worst = max(worst, loop.time() - before - 0.005)

        tick = asyncio.create_task(ticker())
        handles = await app.aenqueue_many([add.bind(a=i, b=i) for i in range(200)])
        with pytest.raises(errands.ResultTimeout):
            await handles[0].aresult(timeout=0.2)
        stop.set()
        await tick
        return worst

    assert run(scenario()) < 0.5


def test_a_slow_before_insert_hook_runs_off_the_event_loop_in_aenqueue(
    app: errands.App,
) -> None:
    """before_insert hooks are user code: a slow one ran on the event loop in aenqueue,
    aenqueue_many and aenqueue_workflow, and every other task waited for it. They run
    on a thread now: a task scheduled meanwhile runs while the hook sleeps."""
    import threading
    import time

    add, _ = _jobs(app)
    hook_threads: list[int] = []

    @app.events.before_insert
    def slow(requests: list[Any]) -> None:
        hook_threads.append(threading.get_ident())
        time.sleep(0.3)

    async def scenario() -> list[str]:
        order: list[str] = []

        async def other_task() -> None:
            await asyncio.sleep(0.05)
            order.append("other task ran")

        batch = errands.Batch("hooked")
        batch.add(add.bind(a=5, b=6))
        for enqueue in (
            lambda: add.aenqueue(a=1, b=2),
            lambda: app.aenqueue_many([add.bind(a=3, b=4)]),
            lambda: app.aenqueue_workflow(batch),
        ):
            task = asyncio.create_task(other_task())
            await enqueue()
            order.append("enqueued")
            await task
        return order

    loop_thread = threading.get_ident()
    assert run(scenario()) == ["other task ran", "enqueued"] * 3
    assert hook_threads and loop_thread not in hook_threads


HELD = 30.0  # seconds a held subscriber waits to be let go: far past any loop's tick


def test_every_async_enqueue_runs_the_event_subscribers_off_the_event_loop(
    app: errands.App, backend: Backend, harness: Harness, tmp_path: Path
) -> None:
    """Event subscribers are user code: aenqueue(conn=), aenqueue_many(conn=) and
    aenqueue_workflow (with conn= or without) ran those of errands.job.enqueued and
    errands.workflow.enqueued on the event loop, and a slow one held every task on it
    (one sleeping 1 s stalled the loop 1 s an enqueue, 2 s a workflow). Here each
    subscriber call is held until a task on the loop has ticked meanwhile: it never runs
    on the loop's thread, and every enqueue lets the loop run while it is held."""
    import threading

    add, _ = _jobs(app)
    entered, released = threading.Event(), threading.Event()
    held_on: list[int] = []  # the thread of each subscriber call

    def held(event: Any) -> None:
        held_on.append(threading.get_ident())
        entered.set()
        if threading.get_ident() != loop_thread:  # (there nothing could let it go)
            released.wait(HELD)

    app.events.subscribe(held)

    async def ticks_then_releases() -> None:
        while not entered.is_set():
            await asyncio.sleep(0.01)
        for _ in range(3):  # the loop ran while the subscriber was held
            await asyncio.sleep(0.01)
        released.set()

    async def scenario() -> dict[str, bool]:
        conn = await harness.async_connection(backend, tmp_path, same_store=True)

        async def committed(enqueue: Awaitable[Any]) -> None:
            await enqueue
            await conn.commit()

        def batch() -> errands.Batch:
            made = errands.Batch("announced")
            made.add(add.bind(a=5, b=6))
            return made

        enqueues = {
            "aenqueue(conn=)": lambda: committed(add.aenqueue(a=1, b=2, conn=conn)),
            "aenqueue_many(conn=)": lambda: committed(
                app.aenqueue_many([add.bind(a=3, b=4)], conn=conn)
            ),
            "aenqueue_workflow(conn=)": lambda: committed(
                app.aenqueue_workflow(batch(), conn=conn)
            ),
            "aenqueue_workflow()": lambda: app.aenqueue_workflow(batch()),
            "aenqueue_many()": lambda: app.aenqueue_many([add.bind(a=7, b=8)]),
        }
        let_go: dict[str, bool] = {}
        try:
            for what, enqueue in enqueues.items():
                entered.clear()
                released.clear()
                ticker = asyncio.create_task(ticks_then_releases())
                await enqueue()
                let_go[what] = released.is_set()  # by the ticker, while it was held
                ticker.cancel()
        finally:
            await conn.close()
        return let_go

    loop_thread = -1  # the event loop's thread, once it runs

    async def on_the_loop() -> dict[str, bool]:
        nonlocal loop_thread
        loop_thread = threading.get_ident()
        return await scenario()

    let_go = run(on_the_loop())
    assert len(let_go) == 5
    assert [what for what, ok in let_go.items() if not ok] == [], "these held the event loop"
    assert len(held_on) == 7 and loop_thread not in held_on  # 5 jobs, 2 workflows
    assert count(backend) == 5


def test_asignal_sends_a_signal_as_signal_does(app: errands.App, backend: Backend) -> None:
    """asignal resumes a job waiting for the signal and refuses a finished one."""
    from errands.backends.base import FinishParams

    add, _ = _jobs(app)
    waiting, done = add.enqueue(a=1, b=1, priority=9), add.enqueue(a=2, b=2)
    row = claim_one(backend)
    assert row.id == waiting.id
    (ok,) = backend.job_finish_many(
        [FinishParams(row.id, row.lease_token or "", "waiting", wait_signal="go")]
    )
    assert ok and waiting.status() is errands.JobState.WAITING
    assert finish(backend, claim_one(backend), "completed", result_json="4")

    async def scenario() -> None:
        assert (await app.asignal(waiting.id, "go", {"n": 1})).resumed
        with pytest.raises(errands.InvalidTransition):
            await app.asignal(done.id, "go")

    run(scenario())
    assert waiting.status() is errands.JobState.AVAILABLE
