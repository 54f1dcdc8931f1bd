"""The dashboard's pages (GET only; nothing here changes state)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from ..backends.base import queue_state
from ..backends.limits import format_rate
from ..errors import JobNotFound
from ..fleet import MISSED_HEARTBEATS, presumed_dead, presumed_dead_after, queue_names
from ..jobs import ALL_STATES, Job, listed_by_priority
from ..masking import mask_text, mask_value, sensitive_values
from ..observability.fair_keys import KeyRow, top_keys
from ..workflows import WORKFLOW_STATES
from . import charts
from .format import trace_id
from .web import (
    Viewer,
    as_id,
    blocking,
    error_page,
    page,
    query_int,
    query_text,
    render,
    settings,
)
from .workflow_graph import layout

PAGE_SIZE = 50
STATE_ORDER = (
    "available",
    "running",
    "scheduled",
    "retryable",
    "waiting",
    "completed",
    "dead",
    "discarded",
    "cancelled",
)


def known_names(request: Request) -> tuple[list[str], list[str]]:
    """Job names and queues the app registers (for the filter inputs' suggestions)."""
    app = settings(request).app
    names = sorted(app.registry)
    queues = sorted({d.queue for d in app.registry.values()} | {app.default_queue})
    return names, queues


def run_times(job: Job, now: float | None = None) -> dict[str, Any]:
    """When the current (or last) attempt started, for how long it has run or how long it
    took, and the worker running it."""
    started = job.attempted_at.timestamp() if job.attempted_at else None
    running = job.state.value == "running"
    runtime = None
    if started is not None and running:
        runtime = max((now if now is not None else time.time()) - started, 0.0)
    elif started is not None and job.finished_at is not None and job.state.is_terminal:
        runtime = max(job.finished_at.timestamp() - started, 0.0)
    return {
        "started": started,
        "runtime": runtime,
        "running": running,
        "worker": job.lease_owner if running else None,
    }


def masked_job(job: Job) -> dict[str, Any]:
    """What a page may show of a job: arguments masked, and masked in every free text."""
    secrets = sensitive_values(job)
    return {
        "job": job,
        **run_times(job),
        "args": job.masked_args,
        "meta": mask_value(job.meta, secrets),
        "result": mask_value(job.result, secrets),
        "errors": [
            {
                "error": e,
                "message": mask_text(e.message, secrets),
                "traceback": mask_text(e.traceback, secrets),
            }
            for e in job.errors
        ],
        "last_error": mask_text(job.last_error.message, secrets) if job.last_error else "",
        "last_error_type": job.last_error.type if job.last_error else "",
    }


@page
async def overview(request: Request, viewer: Viewer) -> Response:
    app = settings(request).app

    def load() -> dict[str, Any]:
        stats = app.queue_stats()
        now = app.backend.db_now()
        rows = app.backend.job_throughput(charts.WINDOW_SECONDS, charts.BUCKET_SECONDS)
        workers = app.backend.worker_list()
        declared = app.queue_settings()
        unrunnable = app.unrunnable_jobs()
        return {
            "stats": stats,
            "now": now,
            "rows": rows,
            "workers": workers,
            "declared": declared,
            "unrunnable": unrunnable,
        }

    data = await blocking(load)
    total, per_queue = charts.build_series(data["rows"], data["now"])
    by_queue = {s.queue: s for s in data["stats"]}
    paused = {q.name for q in data["declared"] if q.paused}
    names = sorted(set(by_queue) | set(per_queue) | {q.name for q in data["declared"]})
    empty = charts.Series([charts.Minute(m.at) for m in total.minutes])
    queues = []
    for name in names:
        stat = by_queue.get(name)
        series = per_queue.get(name, empty)
        queues.append(
            {
                "name": name,
                "counts": stat.counts if stat else {},
                "oldest": stat.oldest_available_age if stat else None,
                "series": series,
                "throughput": charts.throughput_chart(series, width=260, height=44, axes=False),
                "failures": charts.failure_rate_chart(series, width=260, height=44, axes=False),
                "paused": name in paused,
            }
        )
    totals: dict[str, int] = {}
    for stat in data["stats"]:
        for state, n in stat.counts.items():
            totals[state] = totals.get(state, 0) + n
    return render(
        request,
        viewer,
        "overview.html",
        {
            "nav": "overview",
            "queues": queues,
            "totals": totals,
            "states": STATE_ORDER,
            "total": total,
            "throughput": charts.throughput_chart(total),
            "failures": charts.failure_rate_chart(total),
            "workers": [w for w in data["workers"] if not presumed_dead(w, app.lease)],
            "unrunnable": data["unrunnable"],
            "live": True,
        },
    )


@page
async def jobs(request: Request, viewer: Viewer) -> Response:
    app = settings(request).app
    state = query_text(request, "state")
    queue = query_text(request, "queue")
    name = query_text(request, "name")
    search = query_text(request, "q")
    before_id = query_int(request, "before_id")
    # available jobs of one queue come by priority and due time, paged after a cursor
    by_priority = listed_by_priority(state, queue) and not search
    after = query_text(request, "after") if by_priority else None
    if by_priority:
        before_id = None
    if state is not None and state not in ALL_STATES:
        return error_page(
            request, 400, "Unknown state", f"Choose one of: {', '.join(ALL_STATES)}.", viewer
        )

    def load() -> tuple[list[Job], bool]:
        if search:
            found: dict[int, Job] = {}
            if (wanted := as_id(search)) is not None:
                try:
                    job = app.get_job(wanted)
                    found[job.id] = job
                except JobNotFound:
                    pass
            for row in app.backend.job_find_by_key(search, PAGE_SIZE):
                found.setdefault(row.id, row.to_job())
            return sorted(found.values(), key=lambda j: j.id, reverse=True), False
        rows = app.jobs(
            state=state,
            queue=queue,
            name=name,
            limit=PAGE_SIZE + 1,
            before_id=before_id,
            after=after,
        )
        return rows[:PAGE_SIZE], len(rows) > PAGE_SIZE

    found, more = await blocking(load)
    names, queues = known_names(request)
    filters = {"state": state, "queue": queue, "name": name}
    return render(
        request,
        viewer,
        "jobs.html",
        {
            "nav": "jobs",
            "jobs": [masked_job(j) for j in found],
            "more": more,
            "next_before": found[-1].id if found and more and not by_priority else None,
            "next_after": found[-1].cursor if found and more and by_priority else None,
            "filters": filters,
            "search": search,
            "before_id": before_id or after,  # not the first page
            "states": ALL_STATES,
            "known_names": names,
            "known_queues": queues,
            "live": before_id is None and after is None and not search,
            # a pending state's listing can be edited in bulk (with a dry run first)
            "editable": state in ("scheduled", "available", "retryable"),
            "by_priority": by_priority,
        },
    )


@dataclass
class Moment:
    at: float
    what: str
    detail: str = ""
    kind: str = ""


def timeline(job: Job, audit: list[Any], view: dict[str, Any]) -> list[Moment]:
    moments = [Moment(job.inserted_at.timestamp(), "enqueued", f"queue {job.queue}", "info")]
    if job.state.is_pending and job.run_at.timestamp() > job.inserted_at.timestamp() + 1:
        moments.append(Moment(job.run_at.timestamp(), "due", "runs no earlier", "info"))
    for item in view["errors"]:
        error = item["error"]
        text = f"{error.type}: {item['message']}" if error.type else item["message"]
        moments.append(
            Moment(error.at.timestamp(), f"attempt {error.attempt} failed", text, "failed")
        )
    if job.attempted_at is not None:
        moments.append(
            Moment(job.attempted_at.timestamp(), f"attempt {job.attempt} started", "", "info")
        )
    for event in audit:
        detail = ", ".join(f"{k}: {v}" for k, v in sorted(event.detail.items()))
        moments.append(Moment(event.at, f"{event.action} by {event.actor}", detail, "audit"))
    if job.finished_at is not None:
        moments.append(Moment(job.finished_at.timestamp(), job.state.value, "", job.state.value))
    moments.sort(key=lambda m: m.at)
    return moments


@page
async def job_detail(request: Request, viewer: Viewer) -> Response:
    app = settings(request).app
    job_id = int(request.path_params["job_id"])

    def load() -> dict[str, Any] | None:
        try:
            job = app.get_job(job_id)
        except JobNotFound:
            return None
        audit = app.audit(job_id=job_id, limit=100)
        steps = app.job_steps(job_id)
        children = app.jobs(parent_id=job_id, limit=PAGE_SIZE)
        return {"job": job, "audit": audit, "steps": steps, "children": children}

    data = await blocking(load)
    if data is None:
        return error_page(request, 404, "No such job", f"There is no job with id {job_id}.", viewer)
    job = data["job"]
    view = masked_job(job)
    secrets = sensitive_values(job)
    steps = [{"step": st, "result": mask_value(st.result, secrets)} for st in data["steps"]]
    return render(
        request,
        viewer,
        "job.html",
        {
            "nav": "jobs",
            **view,
            "audit": data["audit"],
            "timeline": timeline(job, data["audit"], view),
            "trace_id": trace_id(job.meta),
            "steps": steps,
            "children": [masked_job(c) for c in data["children"]],
            "pending": job.state.is_pending or job.state.value in ("running", "waiting"),
        },
    )


@page
async def dlq(request: Request, viewer: Viewer) -> Response:
    app = settings(request).app
    queue = query_text(request, "queue")
    name = query_text(request, "name")
    before_id = query_int(request, "before_id")

    def load() -> tuple[list[Job], bool, int]:
        rows = app.jobs(
            state="dead", queue=queue, name=name, limit=PAGE_SIZE + 1, before_id=before_id
        )
        dead = sum(app.backend.job_count_by_queue("dead").values())
        return rows[:PAGE_SIZE], len(rows) > PAGE_SIZE, dead

    found, more, dead_total = await blocking(load)
    names, queues = known_names(request)
    return render(
        request,
        viewer,
        "dlq.html",
        {
            "nav": "dlq",
            "jobs": [masked_job(j) for j in found],
            "more": more,
            "next_before": found[-1].id if found and more else None,
            "filters": {"queue": queue, "name": name},
            "dead_total": dead_total,
            "known_names": names,
            "known_queues": queues,
        },
    )


@page
async def workers(request: Request, viewer: Viewer) -> Response:
    app = settings(request).app
    found = await blocking(app.backend.worker_list)
    rows = [{"worker": w, "dead": presumed_dead(w, app.lease)} for w in found]
    alive = [w for w in found if not presumed_dead(w, app.lease)]
    return render(
        request,
        viewer,
        "workers.html",
        {
            "nav": "workers",
            "rows": rows,
            "live_count": len(alive),
            "dead_after": presumed_dead_after(app.lease),  # for workers before schema 18
            "missed_beats": MISSED_HEARTBEATS,
            "in_flight": sum(w.in_flight for w in alive),
            "live": True,
        },
    )


@page
async def audit(request: Request, viewer: Viewer) -> Response:
    app = settings(request).app
    job_id = query_int(request, "job_id")
    events = await blocking(app.audit, job_id=job_id, limit=200)
    return render(
        request, viewer, "audit.html", {"nav": "audit", "events": events, "job_id": job_id}
    )


@page
async def queues(request: Request, viewer: Viewer) -> Response:
    app = settings(request).app

    def load() -> tuple[list[Any], list[Any], list[Any]]:
        return app.queue_stats(), app.queue_settings(), app.backend.worker_list()

    stats, queue_settings, registry = await blocking(load)
    alive = [w for w in registry if not presumed_dead(w, app.lease)]
    rows: dict[str, dict[str, Any]] = {}

    def row(name: str) -> dict[str, Any]:
        return rows.setdefault(name, {"name": name, "stats": None, "settings": None})

    for stat in stats:
        row(stat.queue)["stats"] = stat
    for item in queue_settings:
        entry = row(item.name)
        entry["settings"] = item
        entry["rate"] = format_rate(item.rate_limit, item.rate_period)
    _, registered = known_names(request)
    for name in registered:
        row(name)
    for entry in rows.values():
        entry["state"] = queue_state(entry["settings"])
        entry["workers"] = sum(1 for w in alive if entry["name"] in queue_names(w.queues))
    return render(
        request,
        viewer,
        "queues.html",
        {"nav": "queues", "queues": [rows[n] for n in sorted(rows)], "live": True},
    )


TENANTS_SHOWN = 50  # keys shown one by one on a fair queue's tenants page; the rest summed


@page
async def queue_tenants(request: Request, viewer: Viewer) -> Response:
    """A fair queue's keys (tenants): weight, backlog, worker time and share, dwell."""
    app = settings(request).app
    name = request.path_params["queue"]

    def load() -> tuple[Any, list[KeyRow]]:
        stored = next((s for s in app.queue_settings() if s.name == name), None)
        return stored or app.queues.get(name), top_keys(
            app.fair_figures(name, weight_wait=0.5), TENANTS_SHOWN
        )

    queue, rows = await blocking(load)
    return render(
        request,
        viewer,
        "tenants.html",
        {"nav": "queues", "queue": name, "settings": queue, "rows": rows, "live": True},
    )


@page
async def workflows(request: Request, viewer: Viewer) -> Response:
    app = settings(request).app
    state = query_text(request, "state")
    if state not in (None, *WORKFLOW_STATES):
        state = None
    before = query_int(request, "before")
    rows = await blocking(app.workflows, state=state, before_id=before, limit=PAGE_SIZE)
    return render(
        request,
        viewer,
        "workflows.html",
        {
            "nav": "workflows",
            "rows": rows,
            "states": list(WORKFLOW_STATES),
            "current_state": state,
            "next_before": rows[-1].id if len(rows) == PAGE_SIZE else None,
        },
    )


@page
async def workflow_detail(request: Request, viewer: Viewer) -> Response:
    app = settings(request).app
    workflow_id = int(request.path_params["workflow_id"])

    def load() -> tuple[Any, list[Any]]:
        return app.workflow_status(workflow_id), app.workflow_members(workflow_id)

    try:
        status, members = await blocking(load)
    except JobNotFound:
        return error_page(
            request,
            404,
            "Workflow not found",
            f"No workflow with id {workflow_id}.",
            viewer,
            fix="It may never have been stored (its enqueue rolled back).",
        )
    return render(
        request,
        viewer,
        "workflow.html",
        {
            "nav": "workflows",
            "w": status,
            "members": members,
            "nodes": {m.job_id: m.node for m in members},
            "graph": layout(members),
        },
    )


@page
async def cron(request: Request, viewer: Viewer) -> Response:
    app = settings(request).app
    entries = await blocking(app.periodic_jobs)
    return render(request, viewer, "cron.html", {"nav": "cron", "entries": entries})
