"""Output for people (rich tables on a terminal, plain text otherwise) and for scripts (--json)."""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

import click

from ..jobs import Job
from ..jsontext import json_text
from ..masking import mask_text, mask_value, sensitive_values

if TYPE_CHECKING:
    from rich.console import Console


def on_terminal() -> bool:
    """Whether stdout is a terminal: rich tables there, plain text otherwise."""
    return sys.stdout.isatty()


def console() -> Console:
    """rich's console (imported here, on a terminal: a command piped into a script, or a
    worker, never pays for rich's ~30 ms of imports)."""
    from rich.console import Console

    # emoji=False: job text is printed as it is (":fire:" in an error stays ":fire:")
    return Console(highlight=False, emoji=False, soft_wrap=not on_terminal())


# Characters that end a line or steer a terminal: C0 and C1 controls (newline, carriage
# return, tab, escape...), DEL, and Unicode's line and paragraph separators.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    return _NAMED_ESCAPES.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def one_line(text: str) -> str:
    """``text`` for one table cell or output line: control characters as escapes (``\\n``,
    ``\\t``, ``\\x1b``), so a job's text (an error message, an actor) can never start a
    fake row of its own, or recolour or rewrite the terminal."""
    return _CONTROL.sub(_escape, text)


def emit_json(data: Any) -> None:
    click.echo(json_text(data, indent=2, default=str))


def notice(text: str, level: str = "warning") -> None:
    """A warning or error of the CLI itself on stderr: ``warning: text``, or, in a
    process whose logging is JSON (``errands worker --log-format json``), a JSON log
    record of that level (logger ``errands.cli``), so its log stays JSON lines."""
    from ..observability import logcontext

    if logcontext.current_format() == "json":
        logging.getLogger("errands.cli").log(logging.getLevelName(level.upper()), text)
    else:
        click.echo(f"{level}: {text}", err=True)


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    if seconds < 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def when(value: datetime | float | None, tz: str | None = None) -> str:
    """``2026-05-01 12:00:03 UTC``, or in time zone ``tz`` with its abbreviation
    (``2026-05-01 14:00:03 CEST``): a time is never shown without its zone."""
    if value is None:
        return "-"
    if not isinstance(value, datetime):
        value = datetime.fromtimestamp(value, tz=UTC)
    local = value.astimezone(ZoneInfo(tz) if tz else UTC)
    return f"{local:%Y-%m-%d %H:%M:%S} {local.tzname() or tz}"


def table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """One row per job (or queue...), each cell on one line (:func:`one_line`); on a
    terminal, a rich table whose cells are plain text, never markup: an error message
    holding ``[/]`` raised MarkupError, and ``[red]`` recoloured the rest of it."""
    cells = [[one_line(str(c)) for c in row] for row in rows]
    if on_terminal():
        from rich.table import Table
        from rich.text import Text

        grid = Table(title=None if title is None else Text(title), header_style="bold")
        for column in columns:
            grid.add_column(Text(column))
        for row_cells in cells:
            grid.add_row(*[Text(c) for c in row_cells])
        console().print(grid)
        return
    widths = [max(len(c) for c in [col, *[r[i] for r in cells]]) for i, col in enumerate(columns)]
    if title:
        click.echo(one_line(title))
    click.echo("  ".join(str(c).ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())
    for row_cells in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row_cells, widths, strict=True)).rstrip())


def job_dict(job: Job) -> dict[str, Any]:
    """A job as JSON, its sensitive arguments masked wherever they appear."""
    secrets = sensitive_values(job)
    return {
        "id": job.id,
        "name": job.name,
        "queue": job.queue,
        "state": job.state.value,
        "args": job.masked_args,
        "meta": mask_value(job.meta, secrets),
        "priority": job.priority,
        "attempt": job.attempt,
        "max_attempts": job.max_attempts,
        "rescues": job.rescues,
        "key": job.masked_key,
        "run_at": job.run_at,
        "cursor": job.cursor,  # jobs list --state available --queue Q --after CURSOR
        "inserted_at": job.inserted_at,
        "attempted_at": job.attempted_at,
        "finished_at": job.finished_at,
        "lease_owner": job.lease_owner,
        "lease_expires_at": job.lease_expires_at,
        "cancel_requested": job.cancel_requested,
        "result": mask_value(job.result, secrets),
        "discarded_by": job.discarded_by,
        "discard_reason": job.discard_reason,
        "progress": None
        if job.progress is None
        else {
            "fraction": job.progress.fraction,
            "message": mask_text(job.progress.message, sensitive_values(job)),
        },
        "waiting_for": job.waiting_for,
        "wait_until": job.wait_until,
        "errors": [
            {
                "at": e.at,
                "attempt": e.attempt,
                "type": e.type,
                "message": mask_text(e.message, secrets),
                "worker": e.worker,
                "kind": e.kind,
                "times": e.times,
                "traceback": mask_text(e.traceback, secrets) or None,
            }
            for e in job.errors
        ],
    }


def progress_text(job: Job) -> str:
    """``40% rendered 40 of 100 pages``, or "-" before any ``ctx.progress``."""
    if job.progress is None:
        return "-"
    text = f"{job.progress.fraction * 100:.0f}%"
    message = mask_text(job.progress.message, sensitive_values(job))
    return f"{text} {message}" if message else text


def short(value: Any, limit: int = 60) -> str:
    text = json_text(value, default=str) if not isinstance(value, str) else one_line(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def job_rows(jobs: Sequence[Job]) -> list[list[Any]]:
    rows = []
    for job in jobs:
        last = job.last_error
        rows.append(
            [
                job.id,
                job.name,
                job.queue,
                job.state.value,
                f"{job.attempt}/{job.max_attempts}",
                when(job.inserted_at),
                short(f"{last.type}: {mask_text(last.message, sensitive_values(job))}", 50)
                if last
                else "",
            ]
        )
    return rows


JOB_COLUMNS = ["id", "name", "queue", "state", "attempt", "inserted", "last error"]


def show_job(
    job: Job, audit: Sequence[Any], steps: Sequence[Any] = (), children: Sequence[Job] = ()
) -> None:
    out = console()
    secrets = sensitive_values(job)
    out.print(f"[bold]job {job.id}[/bold]  {job.name}  queue={job.queue}  state={job.state.value}")
    fields = [
        ("args", json_text(job.masked_args, default=str)),
        ("key", job.masked_key or "-"),
        ("attempt", f"{job.attempt} of {job.max_attempts} (rescues {job.rescues})"),
        ("priority", job.priority),
        ("run at", when(job.run_at)),
        ("inserted", when(job.inserted_at)),
        ("attempted", when(job.attempted_at)),
        ("finished", when(job.finished_at)),
        (
            "lease",
            f"{job.lease_owner} until {when(job.lease_expires_at)}" if job.lease_owner else "-",
        ),
        (
            "result",
            json_text(mask_value(job.result, secrets), default=str)
            if job.result is not None
            else "-",
        ),
    ]
    if job.progress is not None:
        fields.append(("progress", progress_text(job)))
    if job.waiting_for is not None:
        until = f" until {when(job.wait_until)}" if job.wait_until else " (no timeout)"
        fields.append(("waiting for", f"signal {job.waiting_for!r}{until}"))
    if job.discard_reason:
        fields.append(("discarded", f"by {job.discarded_by}: {job.discard_reason}"))
    if job.cancel_requested:
        fields.append(("cancel", "requested"))
    for label, value in fields:
        out.print(f"  {label:<10} {one_line(str(value))}", markup=False)
    if job.errors:
        out.print(f"\n[bold]attempts that failed ({len(job.errors)})[/bold]")
        for err in job.errors:
            out.print(
                f"  #{err.attempt} at {when(err.at)} on {err.worker or '?'}: "
                f"{err.type}: {one_line(mask_text(err.message, secrets))}"
                + (f"  [{err.kind}]" if err.kind else "")
                + (f" ({err.times} times in a row, the last shown)" if err.times > 1 else ""),
                markup=False,
            )
            if err.traceback:
                for line in mask_text(err.traceback, secrets).rstrip().splitlines()[-6:]:
                    out.print(f"      {one_line(line)}", markup=False)
    if job.parent_id is not None:
        out.print(f"  parent     job {job.parent_id}", markup=False)
    if steps:
        out.print(f"\n[bold]steps ({len(steps)})[/bold]")
        for step in steps:
            out.print(
                f"  {step.name}: {short(mask_value(step.result, secrets), 80)}  "
                f"(attempt {step.attempt}, "
                f"{when(step.created_at)})",
                markup=False,
            )
    if children:
        out.print(f"\n[bold]children ({len(children)})[/bold]")
        for child in children:
            out.print(f"  job {child.id} {child.name} {child.state.value}", markup=False)
    if audit:
        out.print("\n[bold]audit[/bold]")
        for event in reversed(audit):
            stamp = when(event.at)
            detail = f" {event.detail}" if event.detail else ""
            line = f"{event.action} by {event.actor}{detail}"
            out.print(f"  {stamp} {one_line(line)}", markup=False)
