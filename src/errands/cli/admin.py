"""Admin commands: ``errands status``, ``errands jobs ...``, ``errands dlq ...``."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import click

from ..app import App
from ..errors import ConfigurationError, ErrandsError
from ..jobs import ALL_STATES, ID_MAX, listed_by_priority, parse_cursor
from ..masking import mask_value, sensitive_values
from ..suggest import did_you_mean
from . import render
from .loading import URL_HELP, default_actor, load_app
from .params import FiniteFloatRange

# Ids and priorities as the stores keep them: a larger number was a traceback from deep
# inside ("Python int too large to convert to SQLite INTEGER"), now click's own message.
ID = click.IntRange(min=1, max=ID_MAX)
PRIORITY = click.IntRange(min=-(2**31), max=2**31 - 1)

STATE_CHOICE = click.Choice(ALL_STATES)


def app_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = click.option("--url", help=URL_HELP)(fn)
    fn = click.option(
        "-A",
        "--app",
        "app_path",
        envvar="ERRANDS_APP",
        help="the App as module:attribute (also ERRANDS_APP)",
    )(fn)
    return fn


def json_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--json", "as_json", is_flag=True, help="print JSON for scripts")(fn)


def actor_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--actor",
        default=default_actor,
        show_default="cli:user@host",
        help="who does this (written to the audit log)",
    )(fn)


def _app(app_path: str | None, url: str | None) -> App:
    return load_app(app_path, url, existing=True)


# -- status ----------------------------------------------------------------------------
@click.command()
@app_options
@json_option
@click.option(
    "--max-dead",
    type=click.IntRange(min=0),
    help="exit 3 when more jobs than this are dead (for alerting)",
)
@click.option(
    "--max-age",
    type=FiniteFloatRange(min=0),
    help="exit 3 when the oldest available job waited longer (seconds)",
)
def status(
    app_path: str | None,
    url: str | None,
    as_json: bool,
    max_dead: int | None,
    max_age: float | None,
) -> None:
    """One row per queue: jobs by state and the oldest available job's age."""
    app = _app(app_path, url)
    stats = app.queue_stats()
    states = [
        "scheduled",
        "available",
        "running",
        "retryable",
        "waiting",
        "completed",
        "dead",
        "discarded",
        "cancelled",
    ]
    total_dead = sum(s.counts.get("dead", 0) for s in stats)
    oldest = max((s.oldest_available_age or 0.0 for s in stats), default=0.0)
    unrunnable = app.unrunnable_jobs()
    if as_json:
        render.emit_json(
            {
                "queues": [
                    {
                        "queue": s.queue,
                        "counts": {k: s.counts.get(k, 0) for k in states},
                        "oldest_available_age": s.oldest_available_age,
                    }
                    for s in stats
                ],
                "dead": total_dead,
                "oldest_available_age": oldest,
                "unrunnable": unrunnable,
            }
        )
    else:
        rows = [
            [s.queue, *[s.counts.get(k, 0) for k in states], render.age(s.oldest_available_age)]
            for s in stats
        ]
        if rows:
            render.table(None, ["queue", *states, "oldest available"], rows)
        else:
            click.echo("no jobs yet")
        if unrunnable:
            listed = ", ".join(f"{name} ({n})" for name, n in unrunnable.items())
            click.echo(f"waiting for a worker that defines them (no live worker does): {listed}")
    problems = []
    if max_dead is not None and total_dead > max_dead:
        problems.append(f"{total_dead} dead job(s) > --max-dead {max_dead}")
    if max_age is not None and oldest > max_age:
        problems.append(f"oldest available job waited {oldest:.1f} s > --max-age {max_age:g}")
    if problems:
        click.echo("ALERT: " + "; ".join(problems), err=True)
        raise SystemExit(3)


# -- jobs ------------------------------------------------------------------------------
@click.group()
def jobs() -> None:
    """List, inspect and cancel jobs."""


@jobs.command("list")
@app_options
@json_option
@click.option("--state", type=STATE_CHOICE)
@click.option("--queue")
@click.option("--name")
@click.option("--limit", type=click.IntRange(min=1, max=10_000), default=50, show_default=True)
@click.option("--before", "before_id", type=ID, help="only ids below this one (next page)")
@click.option(
    "--after",
    metavar="CURSOR",
    help="--state available --queue Q: the jobs after this cursor (next page: printed below "
    "a full page)",
)
def jobs_list(
    app_path: str | None,
    url: str | None,
    as_json: bool,
    state: str | None,
    queue: str | None,
    name: str | None,
    limit: int,
    before_id: int | None,
    after: str | None,
) -> None:
    """Jobs, newest first; available jobs of one queue (--state available --queue Q) by
    priority, then due time (a plain queue's claim order, next first)."""
    by_priority = listed_by_priority(state, queue)
    if by_priority and before_id is not None:
        raise click.UsageError(
            "--state available --queue Q lists by priority and due time: page with --after "
            "CURSOR (printed below a full page), not --before"
        )
    if after is not None and not by_priority:
        raise click.UsageError(
            "--after pages --state available --queue Q; other listings page with --before"
        )
    if after is not None:
        try:
            parse_cursor(after)
        except ConfigurationError as exc:  # a cursor that is not one
            raise click.UsageError(str(exc)) from None
    app = _app(app_path, url)
    found = app.jobs(
        state=state, queue=queue, name=name, limit=limit + 1, before_id=before_id, after=after
    )
    more = len(found) > limit
    found = found[:limit]
    if as_json:
        render.emit_json([render.job_dict(j) for j in found])
    elif found:
        render.table(None, render.JOB_COLUMNS, render.job_rows(found))
        if by_priority and more:
            click.echo(f"next page: --after {found[-1].cursor}")
    else:
        click.echo("no matching jobs" + _unknown_filters(app, queue, name))


def _show(app_path: str | None, url: str | None, job_id: int, as_json: bool) -> None:
    app = _app(app_path, url)
    job = app.get_job(job_id)
    audit = app.audit(job_id=job_id)
    steps = app.job_steps(job_id)
    children = app.jobs(parent_id=job_id, limit=100)
    if as_json:
        data = render.job_dict(job)
        data["audit"] = [e.__dict__ for e in audit]
        secrets = sensitive_values(job)
        data["steps"] = [
            {
                "name": s.name,
                "result": mask_value(s.result, secrets),
                "attempt": s.attempt,
                "at": s.created_at,
            }
            for s in steps
        ]
        data["children"] = [{"id": c.id, "name": c.name, "state": c.state.value} for c in children]
        render.emit_json(data)
    else:
        render.show_job(job, audit, steps, children)


@jobs.command("show")
@app_options
@json_option
@click.argument("job_id", type=ID)
def jobs_show(app_path: str | None, url: str | None, as_json: bool, job_id: int) -> None:
    """One job with its arguments, attempts, errors and audit trail."""
    _show(app_path, url, job_id, as_json)


@jobs.command("cancel")
@app_options
@actor_option
@click.argument("job_ids", type=ID, nargs=-1, required=True)
def jobs_cancel(
    app_path: str | None, url: str | None, actor: str, job_ids: tuple[int, ...]
) -> None:
    """Cancel pending jobs at once; ask running ones to stop."""
    app = _app(app_path, url)

    def cancel(job_id: int) -> None:
        result = app.cancel(job_id, actor=actor)
        if result.state == "cancelled":
            click.echo(f"job {job_id}: cancelled (was {result.previous_state})")
        else:
            click.echo(f"job {job_id}: running; cancel requested, its worker stops it")

    each("job", job_ids, cancel)


def each(kind: str, ids: tuple[int, ...], act: Callable[[int], None]) -> None:
    """``act`` on every id, in order: one that fails is one error line and the others are
    still done (the first failure ended the loop, and the ids after it were never tried
    nor named); exit code 1 when any failed."""
    failed = 0
    for item in ids:
        try:
            act(item)
        except ErrandsError as exc:
            failed += 1
            render.notice(f"{kind} {item}: {exc}", "error")
    if failed:
        raise click.exceptions.Exit(1)


def _json_value(text: str, option: str) -> Any:
    """An option's JSON, or a usage error naming the option: one that is not JSON, or is
    nested too deep for Python to read (a RecursionError traceback, before)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise click.BadParameter(
            "the JSON is nested too deep to read (about 1,000 levels of arrays or objects at "
            "most); flatten it",
            param_hint=option,
        ) from None
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint=option) from None


@jobs.command("signal")
@app_options
@actor_option
@json_option
@click.argument("job_id", type=ID)
@click.argument("name")
@click.option("--payload", default="null", show_default=True, help="the signal's payload, as JSON")
def jobs_signal(
    app_path: str | None,
    url: str | None,
    actor: str,
    as_json: bool,
    job_id: int,
    name: str,
    payload: str,
) -> None:
    """Send signal NAME to a job (ctx.wait_for_signal): a job waiting for it resumes; one
    not waiting yet keeps it for its wait. Audited."""
    value = _json_value(payload, "--payload")
    result = _app(app_path, url).signal(job_id, name, value, actor=actor)
    if as_json:
        render.emit_json(
            {"id": result.id, "previous_state": result.previous_state, "resumed": result.resumed}
        )
    elif result.resumed:
        click.echo(f"job {job_id}: signal {name!r} sent; it was waiting for it and resumes")
    else:
        click.echo(
            f"job {job_id}: signal {name!r} kept for its wait (job is {result.previous_state})"
        )


@jobs.command("edit")
@app_options
@actor_option
@json_option
@click.argument("job_ids", type=ID, nargs=-1, required=True)
@click.option("--run-at", type=click.DateTime(), help="run at this time (UTC unless it says)")
@click.option("--delay", type=FiniteFloatRange(min=0), help="run this many seconds from now")
@click.option("--priority", type=PRIORITY, help="the new priority")
@click.option("--queue", help="move to this queue")
@click.option("--args", "args_json", help="replace the arguments (JSON object; needs -A)")
@click.option("--dry-run", is_flag=True, help="show what would be changed; change nothing")
def jobs_edit(
    app_path: str | None,
    url: str | None,
    actor: str,
    as_json: bool,
    job_ids: tuple[int, ...],
    run_at: datetime | None,
    delay: float | None,
    priority: int | None,
    queue: str | None,
    args_json: str | None,
    dry_run: bool,
) -> None:
    """Edit pending jobs (scheduled, available, retryable): when they run, their priority,
    queue or arguments. Running and finished jobs are skipped. Audited."""
    args = None
    if args_json is not None:
        if not app_path:
            raise click.UsageError("--args needs the app (-A module:app) to validate them")
        args = _json_value(args_json, "--args")
        if not isinstance(args, dict):
            raise click.BadParameter("give a JSON object of arguments", param_hint="--args")
    when = None if run_at is None else run_at.replace(tzinfo=run_at.tzinfo or UTC)
    result = _app(app_path, url).edit(
        job_ids, run_at=when, delay=delay, priority=priority, queue=queue, args=args,
        dry_run=dry_run, actor=actor,
    )  # fmt: skip
    _report("edit", result, dry_run, as_json)


# -- dlq -------------------------------------------------------------------------------
@click.group()
def dlq() -> None:
    """The dead-letter queue: inspect, replay, discard."""


@dlq.command("list")
@app_options
@json_option
@click.option("--queue")
@click.option("--name")
@click.option("--limit", type=click.IntRange(min=1, max=10_000), default=50, show_default=True)
@click.option("--before", "before_id", type=ID, help="only ids below this one (next page)")
def dlq_list(
    app_path: str | None,
    url: str | None,
    as_json: bool,
    queue: str | None,
    name: str | None,
    limit: int,
    before_id: int | None,
) -> None:
    """Dead jobs, newest first, with their last error."""
    app = _app(app_path, url)
    found = app.jobs(state="dead", queue=queue, name=name, limit=limit, before_id=before_id)
    if as_json:
        render.emit_json([render.job_dict(j) for j in found])
    elif found:
        render.table(None, render.JOB_COLUMNS, render.job_rows(found))
    elif queue or name:
        click.echo("no matching dead jobs" + _unknown_filters(app, queue, name))
    else:
        click.echo("the dead-letter queue is empty")


def _warn_unknown_filters(
    app: App, matched: list[int], queue: str | None, name: str | None
) -> None:
    if not matched and (hints := _unknown_filters(app, queue, name)):
        click.echo(f"warning: nothing matched{hints}", err=True)


def _unknown_filters(app: App, queue: str | None, name: str | None) -> str:
    """``; no job name 'charge_order' (did you mean shop.charge_order?)`` for each filter
    that no job, worker or code of the app has: a typo, not an empty result."""
    hints = []
    if queue and queue not in (known := app.known_queues()):
        hints.append(did_you_mean("queue", queue, known))
    if name and name not in (names := set(app.registry) | set(app.backend.job_names())):
        hints.append(did_you_mean("job name", name, names))
    return "".join(f"; {hint}" for hint in hints)


@dlq.command("show")
@app_options
@json_option
@click.argument("job_id", type=ID)
def dlq_show(app_path: str | None, url: str | None, as_json: bool, job_id: int) -> None:
    """A dead job's full attempt history."""
    _show(app_path, url, job_id, as_json)


def _selection(job_ids: tuple[int, ...], all_: bool, queue: str | None, name: str | None) -> None:
    if all_ and job_ids:
        raise click.UsageError("give job ids or --all, not both")
    if not all_ and not job_ids:
        raise click.UsageError("give at least one job id, or --all (with --queue/--name filters)")
    if not all_ and (queue or name):
        raise click.UsageError("--queue and --name filter only together with --all")


def _report(verb: str, result: Any, dry_run: bool, as_json: bool) -> None:
    if as_json:
        render.emit_json(
            {
                "dry_run": dry_run,
                "matched": result.matched,
                "skipped": {str(k): v for k, v in result.skipped.items()},
            }
        )
    else:
        ids = ", ".join(map(str, result.matched)) or "none"
        prefix = (
            f"would {verb}" if dry_run else f"{verb}ed".replace("eed", "ed").replace("ited", "ited")
        )
        click.echo(f"{prefix} {len(result.matched)} job(s): {ids}")
        for job_id, why in result.skipped.items():
            click.echo(f"skipped job {job_id}: {why}", err=True)
    if result.skipped:  # as `jobs cancel 5 999`: a script learns that not all were done
        total = len(result.matched) + len(result.skipped)
        skipped = "would be skipped" if dry_run else "skipped"
        if not as_json:
            render.notice(f"{len(result.skipped)} of {total} job(s) {skipped}", "error")
        raise SystemExit(1)


@dlq.command("replay")
@app_options
@actor_option
@json_option
@click.argument("job_ids", type=ID, nargs=-1)
@click.option("--all", "all_", is_flag=True, help="every dead job (narrow with --queue/--name)")
@click.option("--queue")
@click.option("--name")
@click.option("--dry-run", is_flag=True, help="count what would be replayed; change nothing")
@click.option("--fresh", is_flag=True, help="forget the jobs' stored steps: every step runs again")
def dlq_replay(
    app_path: str | None,
    url: str | None,
    actor: str,
    as_json: bool,
    job_ids: tuple[int, ...],
    all_: bool,
    queue: str | None,
    name: str | None,
    dry_run: bool,
    fresh: bool,
) -> None:
    """Run dead jobs again: same id, key and steps, attempts reset. Audited."""
    _selection(job_ids, all_, queue, name)
    app = _app(app_path, url)
    result = app.replay(
        job_ids, all=all_, queue=queue, name=name, dry_run=dry_run, fresh=fresh, actor=actor
    )
    _report("replay", result, dry_run, as_json)
    _warn_unknown_filters(app, result.matched, queue, name)


@dlq.command("discard")
@app_options
@actor_option
@json_option
@click.argument("job_ids", type=ID, nargs=-1)
@click.option("--reason", required=True, help="why (kept on the job and in the audit log)")
@click.option("--all", "all_", is_flag=True, help="every dead job (narrow with --queue/--name)")
@click.option("--queue")
@click.option("--name")
@click.option("--dry-run", is_flag=True, help="count what would be discarded; change nothing")
def dlq_discard(
    app_path: str | None,
    url: str | None,
    actor: str,
    as_json: bool,
    job_ids: tuple[int, ...],
    reason: str,
    all_: bool,
    queue: str | None,
    name: str | None,
    dry_run: bool,
) -> None:
    """Take dead jobs out of the DLQ without running them. Needs --reason. Audited."""
    if not reason.strip():
        raise click.UsageError("--reason must say why (it is kept with the job)")
    _selection(job_ids, all_, queue, name)
    app = _app(app_path, url)
    result = app.discard(
        job_ids, reason=reason, all=all_, queue=queue, name=name, dry_run=dry_run, actor=actor
    )
    _report("discard", result, dry_run, as_json)
    _warn_unknown_filters(app, result.matched, queue, name)
