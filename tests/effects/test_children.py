"""``ctx.enqueue``: children are inserted with the parent's completion, never before.

On SQLite and PostgreSQL: a failed attempt (the handler raising after ``ctx.enqueue``), a
crash before the completion is written (then a rescue after the lease expires), and a
stale duplicate delivery insert no child; only the completion that lands does, once.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import errands
from errands.testing import Tester
from tests.conftest import running_worker

Make = Callable[..., Any]


def _fan_out_app(make_app: Make) -> tuple[errands.App, Any, Any, list[int]]:
    app = make_app()
    delivered: list[int] = []

    @app.job(name="notify", retries=0)
    def notify(user_id: int) -> None:
        delivered.append(user_id)

    @app.job(name="fan_out", retries=5, backoff=2.0)
    def fan_out(ctx: errands.Context, users: list[int]) -> int:
        for user_id in users:
            ctx.enqueue(notify, user_id=user_id)
        if ctx.attempt == 1:
            raise RuntimeError("failed after enqueueing the children")
        return len(users)

    return app, fan_out, notify, delivered


def test_children_of_failed_attempts_are_never_inserted(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    app, fan_out, notify, delivered = _fan_out_app(make_app)
    tester = errands_testing(app)
    # attempt 1 raises by itself; attempt 2 is failed by the test after its handler ran
    tester.fail_attempt(fan_out, 2, after_handler=True)
    parent = fan_out.enqueue(users=[1, 2, 3])

    first = tester.drain(with_retries=False)
    assert first.outcomes == {"retryable": 1}
    assert app.jobs(parent_id=parent.id) == []
    tester.refute_enqueued(notify)

    drained = tester.drain()
    assert [r.outcome for r in drained.runs if r.name == "fan_out"] == ["retryable", "completed"]
    children = app.jobs(parent_id=parent.id)
    assert sorted(c.args["user_id"] for c in children) == [1, 2, 3]
    assert all(c.parent_id == parent.id for c in children)
    assert all(c.state is errands.JobState.COMPLETED for c in children)
    assert sorted(delivered) == [1, 2, 3]
    assert len(app.jobs(name="notify")) == 3


def test_children_are_not_duplicated_by_a_crash_and_rescue(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    app, fan_out, _notify, delivered = _fan_out_app(make_app)
    tester = errands_testing(app)
    tester.crash_before_completion(fan_out, attempt=2)
    parent = fan_out.enqueue(users=[7, 8])

    drained = tester.drain()

    outcomes = [r.outcome for r in drained.runs if r.name == "fan_out"]
    assert outcomes == ["retryable", "crashed", "completed"]
    assert drained.rescued == 1  # the crashed attempt's lease expired and was rescued
    job = parent.job()
    assert [e.kind for e in job.errors] == ["transient", "worker_lost"]
    children = app.jobs(parent_id=parent.id)
    assert sorted(c.args["user_id"] for c in children) == [7, 8]
    assert sorted(delivered) == [7, 8]


def test_children_are_not_inserted_by_a_stale_duplicate_delivery(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    app, fan_out, _notify, _delivered = _fan_out_app(make_app)
    tester = errands_testing(app)
    parent = fan_out.enqueue(users=[4, 5])

    report = tester.drain_duplicated(lambda: len(app.jobs(name="notify")))

    assert parent.id in report.checked
    report.assert_idempotent()
    assert sorted(c.args["user_id"] for c in app.jobs(parent_id=parent.id)) == [4, 5]
    rejected = [r for r in report.drain.runs if r.duplicate and r.name == "fan_out"]
    assert [r.outcome for r in rejected] == ["rejected"]


def test_children_keep_their_own_options_and_keys(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    app = make_app()

    @app.job(name="child", queue="low", retries=0)
    def child(n: int) -> None: ...

    @app.job(name="parent", retries=0)
    def parent_job(ctx: errands.Context) -> None:
        ctx.enqueue(child, n=1, key="child-1", priority=5)
        ctx.enqueue(child.bind(n=2, queue="high", delay=60))
        ctx.enqueue(child, n=3, key="child-1")  # the same key: deduplicated on insert

    tester = errands_testing(app)
    parent = parent_job.enqueue()
    tester.drain(queue="default")

    kids = {c.args["n"]: c for c in app.jobs(parent_id=parent.id)}
    assert set(kids) == {1, 2}
    assert (kids[1].queue, kids[1].priority, kids[1].idempotency_key) == ("low", 5, "child-1")
    assert (kids[2].queue, kids[2].state) == ("high", errands.JobState.SCHEDULED)
    tester.assert_enqueued(child, n=1, queue="low", key="child-1", parent_id=parent.id)
    tester.assert_enqueued(child, n=2, queue="high")


HELD = 10.0  # seconds a held hook waits for the loop to tick: far past any loop's tick


def test_an_async_handler_enqueues_children_with_await_ctx_aenqueue_hooks_off_the_loop(
    make_app: Make,
) -> None:
    """``await ctx.aenqueue(...)`` is ctx.enqueue for async def handlers: the child is
    inserted with the completion, and the app's before_insert hooks (user code) run in a
    worker thread while the event loop, which runs every async job of the worker, goes
    on. Here the hook waits until a task on the handler's loop has ticked: on the loop,
    it could not tick, and the hook gave up after 10 s. Bad arguments raise
    InvalidPayload at the call, as with ctx.enqueue."""
    app = make_app()
    ticked = threading.Event()
    hook_saw: list[bool] = []  # each hooked request: whether the loop ticked meanwhile
    refused: list[str] = []

    @app.events.before_insert
    def tag(requests: list[Any]) -> None:
        for request in requests:
            if request.name == "child":
                hook_saw.append(ticked.wait(HELD))
                request.meta["tagged"] = True

    @app.job(name="child")
    def child(n: int) -> int:
        return n

    @app.job(name="parent", retries=0)
    async def parent(ctx: errands.Context) -> None:
        async def tick() -> None:
            for _ in range(3):
                await asyncio.sleep(0.01)
            ticked.set()

        ticking = asyncio.create_task(tick())
        try:
            await ctx.aenqueue(child, n=1)
            await ctx.aenqueue(child.bind(n=2, priority=5))
            try:
                await ctx.aenqueue(child, n="not a number")
            except errands.InvalidPayload as exc:
                refused.append(str(exc))
        finally:
            ticking.cancel()

    handle = parent.enqueue()
    with running_worker(app, concurrency=2):
        handle.result(timeout=60)
    children = app.jobs(parent_id=handle.id)
    assert sorted((c.args["n"], c.priority) for c in children) == [(1, 0), (2, 5)]
    assert all(c.meta.get("tagged") for c in children)
    assert hook_saw == [True, True], "the before_insert hook held the event loop"
    assert len(refused) == 1


def test_ctx_enqueue_in_an_async_handler_raises_naming_await_ctx_aenqueue(
    make_app: Make,
) -> None:
    """ctx.enqueue() called on the event loop of an async def handler raises
    ConfigurationError naming ``await ctx.aenqueue()`` (it ran the before_insert hooks
    there, stalling every async job of the worker while a slow one ran); called from a
    thread of its own (asyncio.to_thread) it enqueues as in a sync handler."""
    app = make_app()
    refused: list[str] = []

    @app.job(name="child")
    def child(n: int) -> int:
        return n

    @app.job(name="parent", retries=0)
    async def parent(ctx: errands.Context) -> None:
        try:
            ctx.enqueue(child, n=1)
        except errands.ConfigurationError as exc:
            refused.append(str(exc))
        await asyncio.to_thread(ctx.enqueue, child, n=2)

    handle = parent.enqueue()
    with running_worker(app, concurrency=2):
        handle.result(timeout=60)
    assert [c.args["n"] for c in app.jobs(parent_id=handle.id)] == [2]
    [message] = refused
    assert "use await ctx.aenqueue() instead" in message
    assert "async def handler" in message
