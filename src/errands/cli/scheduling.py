"""``errands queues``, ``errands cron list`` and ``errands jobs policy``."""

from __future__ import annotations

import click

from ..backends.base import queue_state
from ..backends.limits import format_rate
from ..observability.fair_keys import TOP_KEYS_DEFAULT, top_keys
from ..retry import ExponentialBackoff, retry_delay
from . import render
from .admin import _app, actor_option, app_options, jobs, json_option


@click.group(invoke_without_command=True)
@click.pass_context
@app_options
@json_option
def queues(ctx: click.Context, app_path: str | None, url: str | None, as_json: bool) -> None:
    """Queues with their state, limits and counts; pause and resume them."""
    if ctx.invoked_subcommand is not None:
        return
    app = _app(app_path, url)
    settings = {s.name: s for s in app.queue_settings()}
    stats = {s.queue: s for s in app.queue_stats()}
    names = sorted(set(settings) | set(stats) | set(app.queues))
    rows = []
    for name in names:
        s = settings.get(name)
        declared = app.queues.get(name)  # limits in this app's code, stored when workers start
        limits = s if s is not None and (s.max_running or s.rate_limit) else declared
        counts = stats[name].counts if name in stats else {}
        rows.append(
            {
                "queue": name,
                "state": queue_state(s),
                "limit": None if limits is None else limits.max_running,
                "rate": None
                if limits is None
                else format_rate(limits.rate_limit, limits.rate_period),
                "available": counts.get("available", 0)
                + counts.get("scheduled", 0)
                + counts.get("retryable", 0),
                "running": counts.get("running", 0),
                "dead": counts.get("dead", 0),
                "updated_by": None if s is None else s.updated_by,
                "fair": bool(
                    (s is not None and s.fair) or (declared is not None and declared.fair)
                ),
            }
        )
    if as_json:
        render.emit_json(rows)
    elif rows:
        render.table(
            None,
            ["queue", "state", "limit", "rate", "pending", "running", "dead", "changed by"],
            [
                [r["queue"], r["state"], r["limit"] or "-", r["rate"] or "-", r["available"],
                 r["running"], r["dead"], r["updated_by"] or "-"]
                for r in rows
            ],
        )  # fmt: skip
    else:
        click.echo("no queues yet")


@queues.command("show")
@app_options
@json_option
@click.option(
    "--top",
    type=click.IntRange(1, 1000),
    default=TOP_KEYS_DEFAULT,
    show_default=True,
    help="fair queues: the keys shown one by one (the most recent worker time first); "
    "the rest are summed as 'other'",
)
@click.argument("name")
def queues_show(app_path: str | None, url: str | None, as_json: bool, top: int, name: str) -> None:
    """One queue's settings and, for a fair queue, its keys: worker time, share, dwell."""
    app = _app(app_path, url)
    if name not in app.known_queues():
        raise click.ClickException(f"no queue named {name!r}; `errands queues` lists them")
    stored = next((s for s in app.queue_settings() if s.name == name), None)
    settings = stored or app.queues.get(name)
    fair = settings is not None and settings.fair
    keys = [row.as_dict() for row in top_keys(app.fair_figures(name), top)]
    data = {
        "queue": name,
        "state": queue_state(stored),
        "fair": fair,
        "aging": None if settings is None else settings.aging,
        "limit": None if settings is None else settings.max_running,
        "rate": None
        if settings is None
        else format_rate(settings.rate_limit, settings.rate_period),
        "keys": keys,
    }
    if as_json:
        render.emit_json(data)
        return
    aging = data["aging"]
    click.echo(
        f"queue {name}: {data['state']}, {'fair' if fair else 'not fair'}"
        + (f", aging {aging:g}s" if aging else "")
    )
    if keys:
        render.table(
            None,
            ["key", "weight", "due", "running", "recent s", "share", "total s", "attempts",
             "mean dwell"],
            [
                [k["key"] if k["keys"] == 1 else f"other ({k['keys']} keys)",
                 f"{k['weight']:g}" + (" (code)" if k["weight_source"] == "code" else ""),
                 k["due"], k["running"], f"{k['recent_worker_seconds']:.1f}",
                 f"{100 * k['share']:.0f}%", f"{k['worker_seconds_total']:.1f}", k["attempts"],
                 "-" if k["mean_dwell_seconds"] is None else f"{k['mean_dwell_seconds']:.2f}s"]
                for k in keys
            ],
        )  # fmt: skip
    elif fair:
        click.echo("no fair keys have run or wait here yet")


@queues.command("weight")
@app_options
@actor_option
@click.argument("key")
@click.argument("weight")
def queues_weight(app_path: str | None, url: str | None, actor: str, key: str, weight: str) -> None:
    """Set a fair key's weight (a number above 0; 'reset' for the default, 1), for every
    fair queue. A key of weight 5 gets five times the worker time of one of weight 1
    while both have jobs waiting. Audited."""
    if weight == "reset":
        value = None
    else:
        try:
            value = float(weight)
        except ValueError:
            raise click.BadParameter(
                f"{weight!r}: write a number above 0, such as 5 or 0.5, or 'reset'"
            ) from None
    _app(app_path, url).fair_weight(key, value, actor=actor)
    click.echo(f"fair key {key}: weight {'1 (default)' if value is None else f'{value:g}'}")


@queues.command("pause")
@app_options
@actor_option
@click.option(
    "--force",
    is_flag=True,
    help="pause a queue that no job, worker or code uses yet (else refused as a typo)",
)
@click.argument("name")
def queues_pause(app_path: str | None, url: str | None, actor: str, force: bool, name: str) -> None:
    """Stop claims from a queue on every worker (running jobs finish). Audited."""
    _app(app_path, url).pause(name, actor=actor, force=force)
    click.echo(f"queue {name}: paused (workers stop claiming within one poll interval)")


@queues.command("resume")
@app_options
@actor_option
@click.argument("name")
def queues_resume(app_path: str | None, url: str | None, actor: str, name: str) -> None:
    """Let workers claim from a paused queue again. Audited."""
    _app(app_path, url).resume(name, actor=actor)
    click.echo(f"queue {name}: resumed")


@queues.command("forget")
@app_options
@actor_option
@click.argument("name")
def queues_forget(app_path: str | None, url: str | None, actor: str, name: str) -> None:
    """Delete a queue's stored settings (paused flag, limits), so a mistyped queue stops
    being listed. Refused while jobs wait in it. Audited."""
    if _app(app_path, url).forget_queue(name, actor=actor):
        click.echo(f"queue {name}: forgotten (its stored settings are deleted)")
    else:
        click.echo(f"queue {name}: nothing stored, nothing to forget")


@click.group()
def cron() -> None:
    """Periodic jobs."""


@cron.command("list")
@app_options
@json_option
def cron_list(app_path: str | None, url: str | None, as_json: bool) -> None:
    """Every periodic job with its queue, schedule, next run and last enqueued slot, times
    in the job's own time zone. A queue no live worker serves is marked: its runs wait."""
    app = _app(app_path, url)
    infos = app.periodic_jobs()
    if as_json:
        render.emit_json([i.__dict__ for i in infos])
    elif infos:
        render.table(
            None,
            ["name", "queue", "schedule", "tz", "next run", "last slot", "last job", "catch up"],
            [
                [i.name, i.queue if i.served else f"{i.queue} (no live worker)", i.expression,
                 i.timezone, render.when(i.next_run, i.timezone),
                 render.when(i.last_slot, i.timezone), i.last_job_id or "-",
                 {None: "latest", True: "all", False: "skip"}[i.catch_up]]
                for i in infos
            ],
        )  # fmt: skip
        unserved = sorted({i.queue for i in infos if not i.served})
        if unserved:
            click.echo(
                f"warning: no live worker serves {', '.join(unserved)}: those periodic jobs' "
                "runs wait there; start a worker for it (errands worker module:app -q "
                f"{','.join(unserved)})",
                err=True,
            )
    else:
        click.echo("no periodic jobs (declare them with @app.periodic; pass -A module:app)")


@jobs.command("policy")
@app_options
@json_option
@click.argument("name")
def jobs_policy(app_path: str | None, url: str | None, as_json: bool, name: str) -> None:
    """A job type's effective policy: queue, retries and delays, timeout, lease, limits."""
    app = _app(app_path, url)
    definition = app.registry.get(name)
    if definition is None:
        known = ", ".join(sorted(app.registry)) or "none (pass -A module:app)"
        raise click.UsageError(f"no job named {name!r}; known: {known}")
    backoff = definition.backoff
    delays = []
    for attempt in range(1, definition.max_attempts):
        if isinstance(backoff, ExponentialBackoff):
            jitter = f" ±{backoff.jitter * 100:.0f}%" if backoff.jitter else ""
            delays.append(f"{backoff.nominal(attempt):g}s{jitter}")
        else:
            delays.append(f"{retry_delay(backoff, attempt, job=definition.name):g}s")
    queue = app.queues.get(definition.queue)
    policy = {
        "name": definition.name,
        "queue": definition.queue,
        "priority": definition.priority,
        "attempts": definition.max_attempts,
        "retry_delays": delays,
        "permanent": [e.__name__ for e in definition.permanent],
        "timeout": definition.timeout,
        "lease": definition.lease or app.lease,
        "sensitive": sorted(definition.sensitive),
        "concurrency_key": definition.concurrency_key,
        "concurrency_limit": definition.concurrency_limit,
        "rate": format_rate(*(definition.rate or (None, None))),
        "queue_limit": None if queue is None else queue.max_running,
        "queue_rate": None if queue is None else format_rate(queue.rate_limit, queue.rate_period),
        "unique_for": definition.unique_for,
        "retention": app.retention,
        "poison_after": app.poison_after,
    }
    if as_json:
        render.emit_json(policy)
        return
    for key, value in policy.items():
        shown = ", ".join(map(str, value)) if isinstance(value, list) else value
        click.echo(f"{key:<18} {shown if shown not in (None, '', []) else '-'}")
