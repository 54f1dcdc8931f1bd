"""Workflows with a real worker in threads, and the ``errands workflows`` commands: a DAG
runs to its result, its events are emitted, and the CLI lists, shows and cancels."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from click.testing import CliRunner

import errands
from errands.cli.main import cli
from errands.testing import Tester
from tests.conftest import running_worker


def _cli(app: errands.App, *args: str) -> Any:
    result = CliRunner().invoke(cli, [*args, "--url", app.url], terminal_width=200)
    assert result.exit_code == 0, result.output
    return result.output


def test_a_dag_runs_to_its_result_on_a_real_worker_and_the_cli_shows_it(
    app: errands.App,
) -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    app.events.subscribe(lambda e: events.append((e.name, dict(e.fields))))

    @app.job(name="wf.square")
    def square(x: int) -> int:
        return x * x

    @app.job(name="wf.total")
    def total(ctx: errands.Context) -> int:
        return sum(p.result for p in ctx.parent_results())

    @app.job(name="wf.done")
    def done(ctx: errands.Context) -> None:
        assert ctx.workflow().pending == 0

    wf = errands.Workflow("squares", on_success=done.bind())
    parts = [wf.add(square.bind(x), name=f"square-{x}") for x in range(1, 4)]
    wf.add(total.bind(), after=parts, name="total")
    with running_worker(app, concurrency=4):
        handle = app.enqueue_workflow(wf)
        assert handle.result(timeout=30)["total"] == 14
        callback = handle.status().callbacks["on_success"]
        assert callback is not None
        assert app.get_job(callback).meta["workflow_callback"] == {
            "workflow": handle.id,
            "event": "on_success",
        }
        errands.JobHandle(app, callback, "wf.done").result(timeout=30)
    assert ("errands.workflow.enqueued", {"workflow_id": handle.id, "workflow_name": "squares",
            "kind": "dag", "members": 4}) in events  # fmt: skip

    listed = json.loads(_cli(app, "workflows", "list", "--json"))
    assert [(w["id"], w["state"], w["completed"]) for w in listed] == [(handle.id, "succeeded", 4)]
    shown = json.loads(_cli(app, "workflows", "show", str(handle.id), "--json"))
    by_node = {m["node"]: m for m in shown["members"]}
    assert by_node["total"]["parents"] == [by_node[f"square-{x}"]["job_id"] for x in (1, 2, 3)]
    assert shown["callbacks"] == {"on_success": callback}
    text = _cli(app, "workflows", "show", str(handle.id))
    assert "square-1, square-2, square-3" in text and f"on_success: job {callback}" in text
    assert "squares" in _cli(app, "workflows", "list", "--state", "succeeded")
    assert _cli(app, "workflows", "list", "--state", "failed").strip() == (
        "no workflows in state failed"
    )


def test_a_member_replayed_after_its_workflow_was_pruned_is_told_why_it_is_gone(
    each_store_url: str, errands_testing: Callable[..., Tester]
) -> None:
    """A dead member replayed after its settled workflow was pruned runs on its own: its
    ctx.workflow() says the workflow is gone and why (it said "no workflow with id N")."""
    app = errands.App(each_store_url)
    first = [True]

    @app.job(name="wf.reads_its_workflow", retries=0)
    def reads_its_workflow(ctx: errands.Context) -> None:
        if first:
            first.pop()
            raise RuntimeError("the first run fails")
        ctx.workflow()

    wf = errands.Workflow("pruned")
    wf.add(reads_its_workflow.bind())
    try:
        tester = errands_testing(app)
        handle = app.enqueue_workflow(wf)
        tester.drain_workflow(handle)
        [member] = [m.job_id for m in app.workflow_members(handle.id)]
        assert app.backend.workflow_prune(-1.0, 100) == 1  # past its retention
        assert app.replay([member]).matched == [member]
        tester.drain()
        job = app.get_job(member)
        assert job.state == "dead"
        said = job.errors[-1].message
        assert f"its workflow {handle.id} is gone" in said and "retention" in said, said
    finally:
        app.close()


def test_a_dead_callback_replayed_after_the_retention_reads_its_workflow_and_completes(
    each_store_url: str, errands_testing: Callable[..., Tester]
) -> None:
    """A callback that died waits in the DLQ for a replay: the prune deleted its settled
    workflow meanwhile, and the replayed callback's ctx.workflow() raised JobNotFound (it
    died again). The workflow is kept while the callback is dead; replayed, it reads its
    workflow and completes, and then the workflow goes."""
    app = errands.App(each_store_url)
    down = [True]
    seen: list[str] = []

    @app.job(name="wf.member")
    def member() -> None: ...

    @app.job(name="wf.report", retries=0)
    def report(ctx: errands.Context) -> None:
        status = ctx.workflow()
        if down:
            down.pop()
            raise RuntimeError("the report service is down")
        seen.append(f"{status.name}: {status.state}")

    wf = errands.Workflow("nightly", on_success=report.bind())
    wf.add(member.bind())
    try:
        tester = errands_testing(app)
        handle = app.enqueue_workflow(wf)
        tester.drain_workflow(handle)
        callback = handle.status().callbacks["on_success"]
        assert callback is not None and app.get_job(callback).state == "dead"
        app.backend.workflow_prune(-1.0, 100)  # a prune past its retention
        assert app.workflow_status(handle.id).state == "succeeded"  # kept for the callback
        assert app.replay([callback]).matched == [callback]
        tester.drain()
        assert app.get_job(callback).state == "completed"
        assert seen == ["nightly: succeeded"]
        assert app.backend.workflow_prune(-1.0, 100) == 1
    finally:
        app.close()


def test_dlq_replay_of_a_callback_whose_workflow_is_gone_fails_with_one_clear_line(
    app: errands.App, errands_testing: Callable[..., Tester], monkeypatch: Any
) -> None:
    """A dead callback whose workflow an earlier errands pruned: replayed, it died again
    with JobNotFound from ctx.workflow() in its handler. `errands dlq replay` now leaves
    it dead, says why and what to do, and exits 1."""

    @app.job(name="wf.member")
    def member() -> None: ...

    @app.job(name="wf.report", retries=0)
    def report(ctx: errands.Context) -> None:
        ctx.workflow()
        raise RuntimeError("the report service is down")

    wf = errands.Workflow("nightly", on_success=report.bind())
    wf.add(member.bind())
    tester = errands_testing(app)
    handle = app.enqueue_workflow(wf)
    tester.drain_workflow(handle)
    callback = handle.status().callbacks["on_success"]
    assert callback is not None and app.get_job(callback).state == "dead"
    queries = app.backend.workflows.q  # type: ignore[attr-defined]
    older = queries["wf_prunable"].replace("'completed', ", "'completed', 'dead', ", 1)
    monkeypatch.setitem(queries, "wf_prunable", older)  # the prune of such an errands
    assert app.backend.workflow_prune(-1.0, 100) == 1
    monkeypatch.undo()
    result = CliRunner().invoke(
        cli, ["dlq", "replay", str(callback), "--url", app.url], terminal_width=200
    )
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert f"skipped job {callback}: it is the on_success callback of workflow {handle.id}" in (
        result.output
    )
    assert f"errands dlq discard {callback} --reason" in result.output
    assert app.get_job(callback).state == "dead"


def test_the_cli_cancels_a_workflow_and_an_unknown_one_is_one_clear_line(
    app: errands.App,
) -> None:
    @app.job(name="wf.step")
    def step() -> None: ...

    wf = errands.Workflow("to-cancel")
    wf.add(step.bind(), after=[wf.add(step.bind())])
    handle = app.enqueue_workflow(wf)
    out = _cli(app, "workflows", "cancel", str(handle.id), "--actor", "ops")
    assert out.strip() == (
        f"workflow {handle.id}: 2 pending member(s) cancelled; running ones asked to stop"
    )
    assert handle.status().state == "cancelled"
    assert app.audit(limit=1)[0].actor == "ops"
    missing = CliRunner().invoke(cli, ["workflows", "show", "999", "--url", app.url])
    assert missing.exit_code == 1 and missing.output == "error: no workflow with id 999\n"


def test_ids_and_priorities_beyond_what_a_store_keeps_are_one_clear_line_not_a_traceback(
    app: errands.App,
) -> None:
    """20-digit ids and a priority past PostgreSQL's integer were a traceback from deep
    inside ("Python int too large to convert to SQLite INTEGER"); now click says which
    argument is out of which range, and exits 2 (a usage error)."""
    huge = "99999999999999999999"
    for args in (
        ["jobs", "show", huge],
        ["jobs", "cancel", "1", huge],
        ["dlq", "replay", huge],
        ["workflows", "cancel", huge],
        ["jobs", "list", "--before", huge],
        ["jobs", "edit", "1", "--priority", str(2**40)],
    ):
        result = CliRunner().invoke(cli, [*args, "--url", app.url])
        assert result.exit_code == 2, (args, result.output)
        assert "is not in the range" in result.output, (args, result.output)
        assert isinstance(result.exception, SystemExit), (args, result.exception)


def test_a_cancel_of_several_ids_does_every_one_it_can_and_names_each_that_failed(
    app: errands.App,
) -> None:
    """An unknown id among several ended the loop: the ids after it were never tried nor
    named. Each id is tried now; each failure is one line; the exit code says one failed."""

    @app.job(name="wf.many")
    def step() -> None: ...

    job = step.enqueue(delay=3600)
    wf = errands.Workflow("to-cancel-too")
    wf.add(step.bind())
    flow = app.enqueue_workflow(wf)
    jobs = CliRunner().invoke(cli, ["jobs", "cancel", "999", str(job.id), "--url", app.url])
    assert jobs.exit_code == 1
    assert "job 999:" in jobs.output and f"job {job.id}: cancelled" in jobs.output
    assert job.status() is errands.JobState.CANCELLED
    flows = CliRunner().invoke(cli, ["workflows", "cancel", "999", str(flow.id), "--url", app.url])
    assert flows.exit_code == 1
    assert "workflow 999:" in flows.output and f"workflow {flow.id}: 1 pending" in flows.output
    assert flow.status().state == "cancelled"
