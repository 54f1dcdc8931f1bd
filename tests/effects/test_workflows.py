"""Workflows through the public API and the real worker code, on SQLite and PostgreSQL:
the builder, batches and their callbacks, parents' results, members added by a member,
the canvas shorthands, the handle (status, result, cancel, wait) and errands.testing's
workflow tools."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import errands
from errands.testing import Tester
from tests.conftest import LoopTicks, cancel_while_inserting, running_worker

Make = Callable[..., Any]


def test_an_import_pipeline_runs_in_order_and_each_step_reads_its_parents_results(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    app = make_app()
    seen: list[tuple[str, Any]] = []

    @app.job(name="fetch")
    def fetch(url: str) -> list[int]:
        seen.append(("fetch", url))
        return [1, 2, 3]

    @app.job(name="parse")
    def parse(ctx: errands.Context) -> int:
        [rows] = ctx.parent_results()
        seen.append(("parse", rows.result))
        return sum(rows.result)

    @app.job(name="report")
    def report(ctx: errands.Context) -> str:
        results = ctx.parent_results().by_node()
        seen.append(("report", results))
        return "done"

    @app.job(name="notify")
    def notify(ctx: errands.Context) -> None:
        status = ctx.workflow()
        seen.append(("notify", (status.state, status.completed)))

    wf = errands.Workflow("import-42", on_success=notify.bind())
    a = wf.add(fetch.bind(url="https://example.com/rows.csv"), name="fetch")
    b = wf.add(parse.bind(), after=[a], name="parse")
    wf.add(report.bind(), after=[a, b], name="report")
    tester = errands_testing(app)
    handle = app.enqueue_workflow(wf)
    assert set(handle.jobs) == {"fetch", "parse", "report"}
    assert handle.status().pending == 3

    status = tester.drain_workflow(handle)
    assert (status.state, status.completed, status.pending) == ("succeeded", 3, 0)
    tester.assert_callbacks(handle, "on_success")
    assert seen == [
        ("fetch", "https://example.com/rows.csv"),
        ("parse", [1, 2, 3]),
        ("report", {"fetch": [1, 2, 3], "parse": 6}),
        ("notify", ("succeeded", 3)),
    ]
    assert handle.result(timeout=5) == {"fetch": [1, 2, 3], "parse": 6, "report": "done"}


def test_a_batch_fires_on_dead_and_on_settled_with_the_failed_members(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    app = make_app()
    settled: list[Any] = []

    @app.job(name="thumbnail", retries=0)
    def thumbnail(n: int) -> int:
        if n == 2:
            raise errands.Permanent("corrupt image")
        return n

    @app.job(name="on_settled")
    def on_settled(ctx: errands.Context) -> None:
        failed = [m.node for m in ctx.workflow_members() if m.outcome in ("dead", "cancelled")]
        settled.append((ctx.workflow().state, failed))

    @app.job(name="alert")
    def alert() -> None:
        settled.append("alert")

    batch = errands.Batch("album-7", on_settled=on_settled.bind(), on_dead=alert.bind())
    for n in range(4):
        batch.add(thumbnail.bind(n), name=f"thumb-{n}")
    tester = errands_testing(app, raise_errors=False)
    handle = app.enqueue_workflow(batch)
    status = tester.drain_workflow(handle)
    assert (status.state, status.completed, status.dead) == ("failed", 3, 1)
    tester.assert_callbacks(handle, "on_dead", "on_settled")
    assert sorted(settled, key=str) == sorted(["alert", ("failed", ["thumb-2"])], key=str)
    with pytest.raises(errands.WorkflowFailed) as failed:
        handle.result(timeout=5)
    assert failed.value.failed == {"thumb-2": "dead"}


def test_a_run_anyway_member_sees_its_failed_parent_and_a_skipped_one_does_not_run(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    app = make_app()
    ran: list[Any] = []

    @app.job(name="charge", retries=0)
    def charge() -> None:
        raise errands.Permanent("card declined")

    @app.job(name="compensate")
    def compensate(ctx: errands.Context) -> None:
        ran.append(("compensate", [p.node for p in ctx.parent_results().failed]))

    @app.job(name="ship")
    def ship() -> None:
        ran.append("ship")

    wf = errands.Workflow("order-9")
    c = wf.add(charge.bind(), name="charge")
    wf.add(compensate.bind(), after=[c], on_failure="run_anyway", name="compensate")
    wf.add(ship.bind(), after=[errands.Edge(c, "skip")], name="ship")
    tester = errands_testing(app, raise_errors=False)
    handle = app.enqueue_workflow(wf)
    status = tester.drain_workflow(handle)
    assert ran == [("compensate", ["charge"])]
    assert (status.dead, status.completed, status.skipped) == (1, 1, 1)
    outcomes = {m.node: m.outcome for m in handle.members()}
    assert outcomes == {"charge": "dead", "compensate": "completed", "ship": "skipped"}


def test_a_member_after_a_skipped_parent_sees_it_skipped_not_failed(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    """charge dies, reserve (skip) is skipped, undo runs after it: parent_results().failed
    listed reserve (its job is stored cancelled), so the saga compensated a reservation
    that was never attempted as if it had failed. A skipped parent is in .skipped."""
    app = make_app()
    seen: list[Any] = []

    @app.job(name="charge", retries=0)
    def charge() -> None:
        raise errands.Permanent("card declined")

    @app.job(name="reserve")
    def reserve() -> None: ...

    @app.job(name="undo")
    def undo(ctx: errands.Context) -> None:
        page = ctx.parent_results()
        seen.append(([p.node for p in page.failed], [(p.node, p.state) for p in page.skipped]))

    wf = errands.Workflow("saga")
    c = wf.add(charge.bind(), name="charge")
    r = wf.add(reserve.bind(), after=[c], on_failure="skip", name="reserve")
    wf.add(undo.bind(), after=[r], name="undo")
    handle = app.enqueue_workflow(wf)
    errands_testing(app, raise_errors=False).drain_workflow(handle)
    assert seen == [([], [("reserve", "skipped")])]


def test_a_member_adds_members_to_its_own_batch_before_it_settles(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    app = make_app()
    done: list[str] = []

    @app.job(name="page")
    def page(n: int, ctx: errands.Context) -> None:
        if n < 3:
            ctx.add_to_workflow(page.bind(n + 1))
        done.append(f"page-{n}")

    @app.job(name="finished")
    def finished(ctx: errands.Context) -> None:
        done.append(f"finished after {ctx.workflow().completed}")

    batch = errands.Batch("crawl", on_success=finished.bind())
    batch.add(page.bind(1))
    tester = errands_testing(app)
    handle = app.enqueue_workflow(batch)
    status = tester.drain_workflow(handle)
    assert (status.total, status.completed) == (3, 3)
    assert done == ["page-1", "page-2", "page-3", "finished after 3"]


def test_an_async_member_adds_members_with_await_ctx_aadd_to_workflow_not_the_sync_call(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    """In an async def handler the sync ctx.add_to_workflow (it runs the app's
    before_insert hooks, user code, on the worker's one event loop) raises naming
    ``await ctx.aadd_to_workflow()``, which adds the member as the sync call does, its
    hooks run off the loop."""
    app = make_app()
    refused: list[str] = []
    hooked: list[str] = []

    @app.events.before_insert
    def tag(requests: list[Any]) -> None:
        hooked.extend(r.name for r in requests if r.name == "apage")

    @app.job(name="apage")
    async def apage(n: int, ctx: errands.Context) -> None:
        if n < 3:
            try:
                ctx.add_to_workflow(apage.bind(n + 10))
            except errands.ConfigurationError as exc:
                refused.append(str(exc))
            await ctx.aadd_to_workflow(apage.bind(n + 1))

    batch = errands.Batch("acrawl")
    batch.add(apage.bind(1))
    handle = app.enqueue_workflow(batch)
    status = errands_testing(app).drain_workflow(handle)
    assert (status.total, status.completed) == (3, 3)
    members = [app.get_job(m.job_id) for m in app.workflow_members(handle.id)]
    assert sorted(j.args["n"] for j in members) == [1, 2, 3]
    assert len(refused) == 2 and "use await ctx.aadd_to_workflow() instead" in refused[0]
    assert hooked.count("apage") >= 3  # the first member's enqueue and both added ones


def test_a_callback_cannot_add_members_to_its_settled_workflow(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    """on_success runs once the workflow settled: ctx.add_to_workflow there is refused
    with a clear error (the job was dropped on SQLite, stored outside the workflow on
    PostgreSQL), and nothing is added."""
    app = make_app()
    refused: list[str] = []

    @app.job(name="member")
    def member() -> None: ...

    @app.job(name="after")
    def after(ctx: errands.Context) -> None:
        try:
            ctx.add_to_workflow(member.bind())
        except errands.ConfigurationError as exc:
            refused.append(str(exc))

    batch = errands.Batch("settled", on_success=after.bind())
    batch.add(member.bind())
    tester = errands_testing(app)
    handle = app.enqueue_workflow(batch)
    status = tester.drain_workflow(handle)
    assert (status.state, status.total) == ("succeeded", 1)
    assert len(refused) == 1 and "callback of a workflow that has settled" in refused[0]
    assert [j.name for j in app.jobs()].count("member") == 1


def test_a_failed_attempt_adds_no_members(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    app = make_app()
    attempts: list[int] = []

    @app.job(name="flaky", retries=1)
    def flaky(ctx: errands.Context) -> None:
        ctx.add_to_workflow(child.bind())
        attempts.append(ctx.attempt)
        if ctx.attempt == 1:
            raise RuntimeError("first attempt fails after adding")

    @app.job(name="child")
    def child() -> None: ...

    batch = errands.Batch("flaky")
    batch.add(flaky.bind())
    tester = errands_testing(app, raise_errors=False)
    handle = app.enqueue_workflow(batch)
    status = tester.drain_workflow(handle)
    assert attempts == [1, 2]
    assert (status.total, status.completed) == (2, 2)  # one child: the completion's


def test_the_canvas_shorthands_build_chains_groups_chords_and_maps(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    app = make_app()

    @app.job(name="add")
    def add(x: int, y: int = 0) -> int:
        return x + y

    @app.job(name="total")
    def total(ctx: errands.Context) -> int:
        return sum(p.result for p in ctx.parent_results())

    tester = errands_testing(app)
    chord = app.enqueue_workflow(errands.chord([add.bind(1), add.bind(2)], total.bind()))
    chain = app.enqueue_workflow(errands.chain(add.bind(1), add.bind(2), add.bind(3)))
    group = app.enqueue_workflow(errands.group(add.bind(1), add.bind(2, 2)))
    mapped = app.enqueue_workflow(errands.map_jobs(add, [1, {"x": 2, "y": 3}]))
    for handle in (chord, chain, group, mapped):
        assert tester.drain_workflow(handle).state == "succeeded"
    assert chord.result()["body"] == 3
    assert [m.parents for m in chain.members()][1:] == [
        [chain.members()[0].job_id],
        [chain.members()[1].job_id],
    ]
    assert sorted(group.result().values()) == [1, 4]
    assert sorted(mapped.result().values()) == [1, 5]


def test_cancelling_a_workflow_cancels_its_pending_members_and_settles_it_cancelled(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    app = make_app()

    @app.job(name="step")
    def step() -> None: ...

    @app.job(name="on_settled")
    def on_settled() -> None: ...

    wf = errands.Workflow("to-cancel", on_settled=on_settled.bind())
    first = wf.add(step.bind())
    wf.add(step.bind(), after=[first])
    handle = app.enqueue_workflow(wf)
    assert handle.cancel(actor="ops") == 2
    status = handle.wait(timeout=10)
    assert (status.state, status.cancelled) == ("cancelled", 2)
    tester = errands_testing(app)
    tester.drain()
    tester.assert_callbacks(handle, "on_settled")
    assert app.audit(limit=1)[0].action == "workflow_cancel"


def test_a_workflow_cancelled_while_its_member_runs_fails_its_result_saying_so(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    """A member cancels its own workflow and completes: the workflow settled cancelled,
    fired on_success as well, and result() raised WorkflowFailed("... cancelled: "), an
    empty list of failed members. It fires on_settled alone, and result() says why."""
    app = make_app()

    @app.job(name="step")
    def step(ctx: errands.Context) -> None:
        app.cancel_workflow(ctx.workflow().id, actor="step")

    @app.job(name="note")
    def note() -> None: ...

    batch = errands.Batch("cancels-itself", on_success=note.bind(), on_settled=note.bind())
    batch.add(step.bind(), name="step")
    tester = errands_testing(app)
    handle = app.enqueue_workflow(batch)
    status = tester.drain_workflow(handle)
    assert (status.state, status.completed) == ("cancelled", 1)
    tester.assert_callbacks(handle, "on_settled")
    with pytest.raises(errands.WorkflowFailed) as failed:
        handle.result(timeout=5)
    assert str(failed.value).endswith("cancelled: no member failed; its cancel was requested")
    assert failed.value.failed == {}


@pytest.mark.parametrize("form", ["wait", "await_"])
def test_waiting_for_a_workflow_that_does_not_settle_times_out(make_app: Make, form: str) -> None:
    """No worker: wait, and await_ in async code, give up at the timeout with
    ResultTimeout saying how many members are still pending."""
    app = make_app()

    @app.job(name="step")
    def step() -> None: ...

    batch = errands.Batch("never-run")
    batch.add(step.bind())
    handle = app.enqueue_workflow(batch)
    started = time.monotonic()
    with pytest.raises(errands.ResultTimeout, match=r"1 of 1 members still pending after 0\.2 s"):
        if form == "wait":
            handle.wait(timeout=0.2)
        else:
            asyncio.run(handle.await_(timeout=0.2))
    assert time.monotonic() - started < 3


def test_a_workflow_commits_or_rolls_back_with_the_callers_transaction(
    make_app: Make, store_url: str
) -> None:
    app = make_app()

    @app.job(name="step")
    def step() -> None: ...

    batch = errands.Batch("in-my-transaction")
    batch.add(step.bind())
    if store_url.startswith("sqlite"):
        import sqlite3

        conn: Any = sqlite3.connect(store_url.removeprefix("sqlite:///"))
    else:
        import psycopg

        conn = psycopg.connect(app.backend.config.conninfo)  # type: ignore[attr-defined]
    try:
        handle = app.enqueue_workflow(batch, conn=conn)
        conn.rollback()
    finally:
        conn.close()
    with pytest.raises(errands.JobNotFound):
        handle.status()
    assert app.workflows() == []


def test_bad_workflows_are_refused_with_the_fix(make_app: Make) -> None:
    app = make_app()

    @app.job(name="step")
    def step() -> None: ...

    with pytest.raises(errands.ConfigurationError, match="needs a name"):
        errands.Workflow("")
    with pytest.raises(errands.ConfigurationError, match="has no members"):
        app.enqueue_workflow(errands.Workflow("empty"))
    other = errands.Workflow("other")
    foreign = other.add(step.bind())
    wf = errands.Workflow("wf")
    with pytest.raises(errands.ConfigurationError, match="belongs to another workflow"):
        wf.add(step.bind(), after=[foreign])
    with pytest.raises(errands.ConfigurationError, match="choose one of cancel, run_anyway"):
        wf.add(step.bind(), after=[wf.add(step.bind())], on_failure="ignore")
    batch = errands.Batch("b")
    with pytest.raises(errands.ConfigurationError, match="use errands"):
        batch.add(step.bind(), after=[batch.add(step.bind())])
    with pytest.raises(errands.ConfigurationError, match="takes a job made with job"):
        wf.add(step)  # type: ignore[arg-type]
    wf.add(step.bind(), name="same")
    with pytest.raises(errands.ConfigurationError, match="has a node named 'same' already"):
        wf.add(step.bind(), name="same")
    with pytest.raises(ValueError, match="unknown workflow state"):
        app.workflows(state="done")


def test_after_takes_one_node_or_none_and_anything_else_is_refused_naming_the_fix(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    """``wf.add(job, after=node)`` (one node, not a list) and ``after=None`` raised
    "TypeError: 'Node' object is not iterable" from inside the builder. One node is a
    parent, None no parent; anything else is a ConfigurationError naming the fix."""
    app = make_app()

    @app.job(name="step")
    def step(n: int) -> int:
        return n

    wf = errands.Workflow("one-parent")
    first = wf.add(step.bind(1), name="first", after=None)
    wf.add(step.bind(2), name="second", after=first)
    wf.add(step.bind(3), name="third", after=errands.Edge(first, "run_anyway"))
    with pytest.raises(errands.ConfigurationError, match=r"after=\[a, b\], or after=a"):
        wf.add(step.bind(4), after="first")  # type: ignore[arg-type]
    handle = app.enqueue_workflow(wf)
    assert errands_testing(app).drain_workflow(handle).state == "succeeded"
    parents = {m.node: m.parents for m in handle.members()}
    assert parents["first"] == []
    assert parents["second"] == parents["third"] == [handle.jobs["first"].id]


def test_a_member_completing_through_ctx_transaction_fans_in_with_its_writes(
    make_app: Make, errands_testing: Callable[..., Tester], store_url: str, effects: Any
) -> None:
    from effects_store import EffectsStore

    app = make_app()
    effects.create(["CREATE TABLE IF NOT EXISTS wf_tx_effects (id {serial}, n INTEGER NOT NULL)"])
    table = EffectsStore.qualified(store_url, "wf_tx_effects")
    mark = "?" if EffectsStore.is_sqlite(store_url) else "%s"

    @app.job(name="write")
    def write(ctx: errands.Context, n: int) -> int:
        ctx.transaction().execute(f"INSERT INTO {table} (n) VALUES ({mark})", (n,))
        return n

    @app.job(name="after")
    def after(ctx: errands.Context) -> int:
        return sum(p.result for p in ctx.parent_results())

    wf = errands.Workflow("tx")
    writes = [wf.add(write.bind(n)) for n in (1, 2)]
    wf.add(after.bind(), after=writes, name="after")
    tester = errands_testing(app)
    handle = app.enqueue_workflow(wf)
    assert tester.drain_workflow(handle).state == "succeeded"
    assert handle.result()["after"] == 3
    assert sorted(r[0] for r in effects.execute("SELECT n FROM wf_tx_effects")) == [1, 2]


def test_a_workflow_settled_by_a_ctx_transaction_completion_is_reported_as_settled(
    make_app: Make, errands_testing: Callable[..., Tester], store_url: str, effects: Any
) -> None:
    """A member completing inside ctx.transaction() settled its batch with no
    errands.workflow.settled event (nor metric): nothing took the handler thread's
    settled list, which grew on that thread for good. It is reported as a completer's
    finish reports it: one event, whichever path completed the last member."""
    from effects_store import EffectsStore

    app = make_app()
    effects.create(["CREATE TABLE IF NOT EXISTS wf_tx_settled (id {serial}, n INTEGER NOT NULL)"])
    table = EffectsStore.qualified(store_url, "wf_tx_settled")
    mark = "?" if EffectsStore.is_sqlite(store_url) else "%s"
    settled: list[dict[str, Any]] = []
    app.events.subscribe(
        lambda e: settled.append(dict(e.fields)) if e.name == "errands.workflow.settled" else None
    )

    @app.job(name="write")
    def write(ctx: errands.Context, n: int) -> None:
        ctx.transaction().execute(f"INSERT INTO {table} (n) VALUES ({mark})", (n,))

    @app.job(name="plain")
    def plain() -> None: ...

    tester = errands_testing(app)
    for member in (write.bind(1), plain.bind()):
        batch = errands.Batch("one")
        batch.add(member)
        handle = app.enqueue_workflow(batch)
        assert tester.drain_workflow(handle).state == "succeeded"
        deadline = time.monotonic() + 5.0  # the completer reports once its write returned
        while not settled and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [(s["workflow_id"], s["state"]) for s in settled] == [(handle.id, "succeeded")]
        settled.clear()


def test_a_nested_batch_runs_its_callbacks_before_its_parent_and_gates_its_dependents(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    app = make_app()
    order: list[str] = []

    @app.job(name="thumb")
    def thumb(n: int) -> int:
        order.append(f"thumb-{n}")
        return n

    @app.job(name="publish")
    def publish(ctx: errands.Context) -> None:
        [album] = ctx.parent_results()
        order.append(f"publish after {album.node} {album.state}")

    @app.job(name="note")
    def note(what: str) -> None:
        order.append(what)

    album = errands.Batch("thumbnails", on_success=note.bind("thumbnails done"))
    for n in range(2):
        album.add(thumb.bind(n))
    wf = errands.Workflow("album", on_success=note.bind("album done"))
    node = wf.add(album, name="thumbnails")
    wf.add(publish.bind(), after=[node], name="publish")
    tester = errands_testing(app)
    handle = app.enqueue_workflow(wf)
    assert set(handle.children) == {"thumbnails"}
    assert tester.drain_workflow(handle).state == "succeeded"
    # the nested batch's callback is inserted as it settles, with publish released, and
    # before the outer workflow's (which waits for publish)
    assert sorted(order[2:4]) == ["publish after thumbnails completed", "thumbnails done"]
    assert order[4:] == ["album done"]
    assert handle.result()["thumbnails"] == {"thumb#0": 0, "thumb#1": 1}
    [nested] = [m for m in handle.members() if m.workflow_id is not None]
    assert nested.workflow_id == handle.children["thumbnails"].id


def test_aenqueue_workflow_stores_a_workflow_from_async_code(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    app = make_app()

    @app.job(name="step")
    def step(n: int) -> int:
        return n

    async def enqueue() -> errands.WorkflowHandle:
        return await app.aenqueue_workflow(errands.chain(step.bind(1), step.bind(2)))

    handle = asyncio.run(enqueue())
    assert errands_testing(app).drain_workflow(handle).state == "succeeded"
    assert sorted(handle.result().values()) == [1, 2]


def test_a_workflow_is_awaited_from_async_code_without_blocking_the_loop(make_app: Make) -> None:
    """astatus, await_ and aresult are status, wait and result for async code: the same
    outcomes, and the event loop keeps running while the workflow runs (wait slept in
    time.sleep: a call from async code stopped the loop until the workflow settled)."""
    app = make_app()

    @app.job(name="slow_step")
    def slow_step(n: int) -> int:
        time.sleep(0.5)
        return n

    handle = app.enqueue_workflow(errands.chain(slow_step.bind(1), slow_step.bind(2)))

    async def scenario() -> tuple[errands.WorkflowStatus, dict[str, Any], float]:
        assert (await handle.astatus()).pending == 2
        with running_worker(app, concurrency=2):
            with LoopTicks() as ticks:
                status = await handle.await_(timeout=30)
            return status, await handle.aresult(timeout=1), ticks.longest

    status, results, longest = asyncio.run(scenario())
    assert (status.state, status.completed) == ("succeeded", 2)
    assert sorted(results.values()) == [1, 2]
    assert longest < 0.4, f"the event loop was blocked for {longest:.2f} s"


def test_acancel_cancels_a_workflow_and_aresult_raises_workflow_failed(make_app: Make) -> None:
    """acancel cancels the pending members as cancel does; await_ then sees it settled
    cancelled and aresult raises WorkflowFailed naming them."""
    app = make_app()

    @app.job(name="step")
    def step() -> None: ...

    wf = errands.Workflow("to-cancel")
    first = wf.add(step.bind(), name="first")
    wf.add(step.bind(), after=[first], name="second")
    handle = app.enqueue_workflow(wf)

    async def scenario() -> errands.WorkflowStatus:
        assert await handle.acancel(actor="ops") == 2
        status = await handle.await_(timeout=10)
        with pytest.raises(errands.WorkflowFailed, match="first cancelled, second cancelled"):
            await handle.aresult(timeout=1)
        return status

    status = asyncio.run(scenario())
    assert (status.state, status.cancelled) == ("cancelled", 2)


def _one_member_batch_cancelled_across_a_lock_cycle(
    app: errands.App,
    monkeypatch: pytest.MonkeyPatch,
    abort_now: Callable[[int], bool],
    cancel: Callable[[Any], Any],
) -> None:
    """A batch of one pending member, cancelled by ``cancel(handle)`` while the store
    aborts one write transaction after its body ran (the first for which ``abort_now``,
    given the thread's count of settlements waiting to be reported, says so) as a lock
    cycle it broke; then exactly one errands.workflow.settled event, with its state."""
    import contextlib

    settled: list[dict[str, Any]] = []
    app.events.subscribe(
        lambda e: settled.append(dict(e.fields)) if e.name == "errands.workflow.settled" else None
    )

    @app.job(name="member")
    def member() -> None: ...

    batch = errands.Batch("cancelled")
    batch.add(member.bind())
    handle = app.enqueue_workflow(batch)
    backend = app.backend
    transaction = backend._transaction  # type: ignore[attr-defined]
    aborted: list[bool] = []

    @contextlib.contextmanager
    def aborted_once() -> Any:
        earlier = backend.workflows.mark()[0]  # type: ignore[attr-defined]
        with transaction() as run:
            yield run
            if not aborted and abort_now(earlier):
                aborted.append(True)
                raise RuntimeError("deadlock detected (a lock cycle the store broke)")

    monkeypatch.setattr(backend, "_transaction", aborted_once)
    monkeypatch.setattr(backend, "_lock_conflict", lambda exc: "deadlock" in str(exc))
    cancel(handle)

    assert aborted == [True]
    status = handle.status()
    assert status.settled
    deadline = time.monotonic() + 5.0  # the events lane delivers them
    while not settled and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # a second report would come right behind the first
    assert [(s["workflow_id"], s["state"]) for s in settled] == [(handle.id, status.state)]


def test_a_workflow_settled_by_a_cancel_run_again_after_a_lock_cycle_is_reported_once(
    make_app: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator's cancel that the store aborted to break a lock cycle runs again from
    the start. What the aborted try's fan-in settled never happened, but it stayed on the
    thread's list and was reported beside the committed try's: errands.workflow.settled
    (and its metric) twice for one workflow."""
    app = make_app()

    def cancel_its_member(handle: Any) -> None:
        [only] = app.workflow_members(handle.id)
        app.cancel(only.job_id)

    # the first write: after its body, its fan-in settled the workflow
    _one_member_batch_cancelled_across_a_lock_cycle(
        app, monkeypatch, lambda earlier: True, cancel_its_member
    )


def test_an_aenqueue_workflow_cancelled_while_its_insert_runs_still_announces_the_workflow(
    make_app: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without conn=, cancelling the awaiting task does not undo an insert already sent:
    the workflow is stored, and announced (errands.workflow.enqueued, and its members'
    errands.job.enqueued) as aenqueue_many announces its jobs; it was stored unannounced."""
    app = make_app()

    @app.job(name="step")
    def step(n: int) -> int:
        return n

    seen: list[str] = []
    app.events.subscribe(lambda event: seen.append(event.name))
    cancel_while_inserting(
        monkeypatch,
        app.backend,
        "workflow_insert",
        lambda: app.aenqueue_workflow(errands.chain(step.bind(1))),
    )
    deadline = time.monotonic() + 10
    while "errands.workflow.enqueued" not in seen and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(app.workflows()) == 1
    assert seen == ["errands.job.enqueued", "errands.workflow.enqueued"]


HELD = 30.0  # seconds a held read waits for the loop to tick: far past any loop's tick
WORKFLOW_READS = ("workflow_parent_results", "workflow_get", "workflow_members")


def _parent_and_reader(app: errands.App, reader: Any) -> errands.Workflow:
    """A workflow: node ``parent`` (returns 2), then node ``reader`` after it."""

    @app.job(name="parent")
    def parent() -> int:
        return 2

    wf = errands.Workflow("reads")
    wf.add(reader.bind(), after=[wf.add(parent.bind(), name="parent")], name="reader")
    return wf


def test_an_async_member_reads_its_workflow_off_the_event_loop(
    make_app: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ctx.aparent_results(), ctx.aworkflow() and ctx.aworkflow_members() are the
    workflow reads for async def handlers: each read runs in a worker thread while the
    worker's event loop, which runs every async job of the worker, goes on. There were
    only the sync ones, read on that loop: a slow read (a locked row, a pool with no
    connection free) stalled every async job (1.7 s). Here the store holds each read
    until an async job on the same loop has ticked meanwhile."""
    app = make_app()
    ticks, stop = [0], threading.Event()
    let_go: list[tuple[str, bool]] = []  # each held read: whether the loop ticked

    @app.job(name="ticker")
    async def ticker() -> None:
        while not stop.is_set():
            await asyncio.sleep(0.01)
            ticks[0] += 1

    @app.job(name="reader", retries=0)
    async def reader(ctx: errands.Context) -> dict[str, Any]:
        page = await ctx.aparent_results(limit=10)
        status = await ctx.aworkflow()
        members = await ctx.aworkflow_members()
        return {
            "parents": page.by_node(),
            "status": (status.id, status.total),
            "members": sorted(m.node for m in members),
        }

    def held(read: Callable[..., Any], name: str) -> Callable[..., Any]:
        def held_read(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is threading.main_thread():  # the test's own
                return read(*args, **kwargs)
            start, give_up = ticks[0], time.monotonic() + HELD
            while not stop.is_set() and ticks[0] < start + 3 and time.monotonic() < give_up:
                time.sleep(0.01)
            if not stop.is_set():
                let_go.append((name, ticks[0] >= start + 3))
            return read(*args, **kwargs)

        return held_read

    backend = app.backend
    for name in WORKFLOW_READS:
        monkeypatch.setattr(backend, name, held(getattr(backend, name), name))
    handle = app.enqueue_workflow(_parent_and_reader(app, reader))
    with running_worker(app, concurrency=4):
        try:
            ticker.enqueue()
            give_up = time.monotonic() + HELD
            while not ticks[0] and time.monotonic() < give_up:  # the ticker runs first
                time.sleep(0.01)
            results = handle.result(timeout=60)
        finally:
            stop.set()
    assert results["reader"] == {
        "parents": {"parent": 2},
        "status": [handle.id, 2],
        "members": ["parent", "reader"],
    }
    assert {name for name, _ in let_go} == set(WORKFLOW_READS)
    assert [name for name, ticked in let_go if not ticked] == [], "these reads held the loop"


def test_the_sync_workflow_reads_in_an_async_handler_raise_naming_the_async_ones(
    make_app: Make,
) -> None:
    """ctx.parent_results(), ctx.workflow() and ctx.workflow_members() called on the
    event loop of an async def handler raise ConfigurationError naming the await to use
    (they read there, and stalled every async job of the worker while the read waited);
    called from a thread of its own (asyncio.to_thread), they read as in a sync handler."""
    app = make_app()
    refused: dict[str, str] = {}

    @app.job(name="reader", retries=0)
    async def reader(ctx: errands.Context) -> int:
        reads = {
            "parent_results": ctx.parent_results,
            "workflow": ctx.workflow,
            "workflow_members": ctx.workflow_members,
        }
        for name, read in reads.items():
            try:
                read()
            except errands.ConfigurationError as exc:
                refused[name] = str(exc)
        page = await asyncio.to_thread(ctx.parent_results)
        status = await asyncio.to_thread(ctx.workflow)
        members = await asyncio.to_thread(ctx.workflow_members)
        return sum(p.result for p in page) + status.total + len(members)

    handle = app.enqueue_workflow(_parent_and_reader(app, reader))
    with running_worker(app, concurrency=2):
        assert handle.result(timeout=60)["reader"] == 2 + 2 + 2
    assert sorted(refused) == ["parent_results", "workflow", "workflow_members"]
    for name, message in refused.items():
        assert f"use await ctx.a{name}() instead" in message
        assert "async def handler" in message


def test_a_workflow_cancel_whose_later_step_is_run_again_still_reports_what_settled(
    make_app: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A workflow cancel is several transactions; one that settles the workflow commits,
    and a later one is aborted by the store to break a lock cycle and run again. The
    retry dropped every report of the thread, the committed settlement's too: no
    errands.workflow.settled event (nor metric) for a workflow that settled."""
    app = make_app()
    # a step after the one that settled it (a settlement waits to be reported)
    _one_member_batch_cancelled_across_a_lock_cycle(
        app, monkeypatch, lambda earlier: earlier > 0, lambda h: app.cancel_workflow(h.id)
    )
