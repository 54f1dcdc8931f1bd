"""``errands workflows list | show | cancel``: batches, chains and DAGs (docs/workflows.md)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import click

from ..workflows import WORKFLOW_STATES, Member, WorkflowStatus
from . import render
from .admin import ID, _app, actor_option, app_options, each, json_option

COLUMNS = ["id", "name", "kind", "state", "total", "pending", "completed", "dead",
           "cancelled", "skipped", "created"]  # fmt: skip


def status_dict(status: WorkflowStatus) -> dict[str, Any]:
    return {**asdict(status), "settled": status.settled}


def status_row(status: WorkflowStatus) -> list[Any]:
    return [
        status.id, status.name, status.kind, status.state, status.total, status.pending,
        status.completed, status.dead, status.cancelled, status.skipped,
        render.when(status.created_at),
    ]  # fmt: skip


@click.group()
def workflows() -> None:
    """List, inspect and cancel workflows (batches, chains, DAGs)."""


@workflows.command("list")
@app_options
@json_option
@click.option("--state", type=click.Choice(WORKFLOW_STATES))
@click.option("--limit", type=click.IntRange(min=1, max=10_000), default=50, show_default=True)
@click.option("--before", "before_id", type=ID, help="only ids below this one (next page)")
def workflows_list(
    app_path: str | None,
    url: str | None,
    as_json: bool,
    state: str | None,
    limit: int,
    before_id: int | None,
) -> None:
    """Workflows, newest first, with their members' counts by outcome."""
    found = _app(app_path, url).workflows(state=state, limit=limit, before_id=before_id)
    if as_json:
        render.emit_json([status_dict(s) for s in found])
    elif found:
        render.table(None, COLUMNS, [status_row(s) for s in found])
    else:
        click.echo("no workflows" + (f" in state {state}" if state else ""))


@workflows.command("show")
@app_options
@json_option
@click.argument("workflow_id", type=ID)
def workflows_show(app_path: str | None, url: str | None, as_json: bool, workflow_id: int) -> None:
    """One workflow: its counts, callbacks, and every member with its parents."""
    app = _app(app_path, url)
    status = app.workflow_status(workflow_id)
    members = app.workflow_members(workflow_id)
    if as_json:
        render.emit_json({**status_dict(status), "members": [asdict(m) for m in members]})
        return
    render.table(None, COLUMNS, [status_row(status)])
    if status.callbacks:
        fired = ", ".join(
            f"{event}: " + (f"job {job}" if job is not None else "not fired")
            for event, job in status.callbacks.items()
        )
        click.echo(f"callbacks: {fired}")
    render.table(
        None,
        ["job", "node", "name", "state", "outcome", "after"],
        [_member_row(m, members) for m in members],
    )


def _member_row(member: Member, members: list[Member]) -> list[Any]:
    nodes = {m.job_id: m.node for m in members}
    return [
        member.job_id,
        member.node,
        f"workflow {member.workflow_id}"
        if member.workflow_id is not None
        else member.job_name or "(pruned)",
        member.state or "-",
        member.outcome or "pending",
        ", ".join(nodes.get(p, str(p)) for p in member.parents) or "-",
    ]


@workflows.command("cancel")
@app_options
@actor_option
@click.argument("workflow_ids", type=ID, nargs=-1, required=True)
def workflows_cancel(
    app_path: str | None, url: str | None, actor: str, workflow_ids: tuple[int, ...]
) -> None:
    """Cancel workflows: pending members at once, running ones asked to stop."""
    app = _app(app_path, url)

    def cancel(workflow_id: int) -> None:
        cancelled = app.cancel_workflow(workflow_id, actor=actor)
        click.echo(
            f"workflow {workflow_id}: {cancelled} pending member(s) cancelled; running ones "
            "asked to stop"
        )

    each("workflow", workflow_ids, cancel)
