"""Everything that changes state: login, logout, and the admin actions.

Every admin action calls the App's admin API (``replay``, ``discard``, ``cancel``,
``pause``, ``resume``, ``signal``, ``edit``) with the viewer's :attr:`~.security.Identity.actor`
(``dashboard:<user>``, or ``dashboard:<label> (shared password)`` and the like), so the
audit log says who did it and how they signed in.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

from anyio import sleep
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import Response

from ..errors import ErrandsError
from .security import CSRF_FIELD, UNNAMED, clean_user_name, csrf_matches, new_csrf_token
from .web import (
    Viewer,
    acting,
    action,
    as_id,
    base_context,
    error_page,
    flash,
    form_text,
    redirect,
    render,
    safe_next,
    settings,
)

MAX_IDS = 10_000
T = TypeVar("T")


# -- login -------------------------------------------------------------------------------
async def login_form(request: Request) -> Response:
    conf = settings(request)
    if not conf.auth.login_page:
        return redirect(request, "overview")
    return _login_page(request, request.query_params.get("next"), None)


def _login_page(
    request: Request, next_path: str | None, problem: str | None, status: int = 200
) -> Response:
    conf = settings(request)
    context = {
        **base_context(request, None),
        "next": safe_next(request, next_path),
        "problem": problem,
        "accepts": conf.auth.login_methods,
    }
    return conf.templates.TemplateResponse(request, "login.html", context, status_code=status)


def _throttled(request: Request, next_path: str, wait: float) -> Response:
    seconds = max(math.ceil(wait), 1)
    problem = f"Too many failed logins; try again in {seconds} s."
    response = _login_page(request, next_path, problem, status=429)
    response.headers["retry-after"] = str(seconds)
    return response


async def login_submit(request: Request) -> Response:
    conf = settings(request)
    if not conf.auth.login_page:
        return redirect(request, "overview")
    form = await request.form()
    given = form.get(CSRF_FIELD)
    if not csrf_matches(request.session.get("csrf"), given if isinstance(given, str) else None):
        return error_page(
            request, 403, "CSRF check failed", "The login form was stale. Reload it and try again."
        )
    next_path = form_text(form, "next")
    # The typed name is a label only: it is shown and audited, and never grants anything.
    label = clean_user_name(form_text(form, "user"), UNNAMED)
    throttle = conf.auth.throttle
    address = request.client.host if request.client else "unknown"
    key = (address, label.casefold())
    wait = throttle.retry_after(key)
    if wait:
        return _throttled(request, next_path, wait)
    # Every attempt waits, the right one too: were only failures slowed, a guesser could
    # stop waiting early and take the silence for "wrong". Past the free failures the
    # checks take turns (LoginThrottle.admit): attempts sent at once wait in line.
    delay = throttle.admit(key)
    if delay is None:
        return _throttled(request, next_path, throttle.max_delay)
    if delay:
        await sleep(delay)
    kind = conf.auth.check_secret(str(form.get("secret") or ""))
    if kind is None:
        throttle.failed(key)
        return _login_page(request, next_path, "Wrong password or token.", status=400)
    throttle.succeeded(key)
    request.session.clear()  # a fresh session: no fixation
    request.session["label"] = label
    request.session["login"] = kind
    request.session["csrf"] = new_csrf_token()
    return _see_other(safe_next(request, next_path))


@action(None)
async def logout(request: Request, viewer: Viewer, form: FormData) -> Response:
    request.session.clear()
    if settings(request).auth.login_page:
        return redirect(request, "login")
    return redirect(request, "overview")


def _see_other(path: str) -> Response:
    from starlette.responses import RedirectResponse

    return RedirectResponse(path, status_code=303)


# -- one job -----------------------------------------------------------------------------
def _job_id(request: Request) -> int:
    return int(request.path_params["job_id"])


async def _run(request: Request, fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return await acting(fn, *args, **kwargs)
    except ErrandsError as exc:
        flash(request, str(exc), "error")
        return None


@action("cancel")
async def job_cancel(request: Request, viewer: Viewer, form: FormData) -> Response:
    job_id = _job_id(request)
    result = await _run(request, settings(request).app.cancel, job_id, actor=viewer.actor)
    if result is not None:
        if result.state == "cancelled":
            flash(request, f"Job {job_id} cancelled.")
        else:
            flash(request, f"Job {job_id} is running: asked it to stop.")
    return redirect(request, "job", job_id=job_id)


@action("signal")
async def job_signal(request: Request, viewer: Viewer, form: FormData) -> Response:
    job_id = _job_id(request)
    name = form_text(form, "signal").strip()
    text = form_text(form, "payload").strip() or "null"
    try:
        payload = json.loads(text)
    except (ValueError, RecursionError) as exc:  # (nested too deep: a RecursionError)
        flash(request, f"The payload is not JSON: {exc}", "error")
        return redirect(request, "job", job_id=job_id)
    app = settings(request).app
    result = await _run(request, app.signal, job_id, name, payload, actor=viewer.actor)
    if result is not None:
        flash(
            request,
            f"Signal {name!r} sent to job {job_id}"
            + (
                "; it was waiting for it and resumes." if result.resumed else "; kept for its wait."
            ),
        )
    return redirect(request, "job", job_id=job_id)


@action("replay")
async def job_replay(request: Request, viewer: Viewer, form: FormData) -> Response:
    job_id = _job_id(request)
    result = await _run(request, settings(request).app.replay, [job_id], actor=viewer.actor)
    if result is not None:
        _report(request, "replay", result)
    return redirect(request, "job", job_id=job_id)


@action("discard")
async def job_discard(request: Request, viewer: Viewer, form: FormData) -> Response:
    job_id = _job_id(request)
    reason = form_text(form, "reason")
    if not reason:
        flash(request, "Discarding needs a reason (it goes into the audit log).", "error")
        return redirect(request, "job", job_id=job_id)
    result = await _run(
        request, settings(request).app.discard, [job_id], reason=reason, actor=viewer.actor
    )
    if result is not None:
        _report(request, "discard", result)
    return redirect(request, "job", job_id=job_id)


def _report(request: Request, op: str, result: Any) -> None:
    done = "replayed" if op == "replay" else "discarded"
    if result.matched:
        ids = ", ".join(str(i) for i in result.matched[:10])
        more = f" and {len(result.matched) - 10} more" if len(result.matched) > 10 else ""
        flash(request, f"{len(result.matched)} job(s) {done}: {ids}{more}.")
    for job_id, why in list(result.skipped.items())[:10]:
        flash(request, f"Job {job_id} skipped: {why}.", "error")
    if not result.matched and not result.skipped:
        flash(request, f"Nothing to {op}: no dead job matched.", "error")


# -- the dead-letter queue ---------------------------------------------------------------
def _dlq_selection(form: FormData) -> dict[str, Any]:
    op = form_text(form, "op")
    scope = form_text(form, "scope") or "selected"
    ids: list[int] = []
    raw = [v for v in form.getlist("ids") if isinstance(v, str)]
    for value in raw:
        ids.extend(i for i in map(as_id, value.split(",")) if i is not None)
    return {
        "op": op,
        "scope": scope,
        "ids": list(dict.fromkeys(ids))[:MAX_IDS],
        "queue": form_text(form, "queue") or None,
        "name": form_text(form, "name") or None,
        "reason": form_text(form, "reason"),
    }


def _dlq_call(request: Request, viewer: Viewer, sel: dict[str, Any], dry_run: bool) -> Any:
    app = settings(request).app
    options: dict[str, Any] = {"actor": viewer.actor, "dry_run": dry_run}
    if sel["scope"] == "all":
        options.update(all=True, queue=sel["queue"], name=sel["name"])
        ids: list[int] = []
    else:
        ids = sel["ids"]
    if sel["op"] == "replay":
        return app.replay(ids, **options)
    return app.discard(ids, reason=sel["reason"], **options)


def _dlq_problem(request: Request, viewer: Viewer, sel: dict[str, Any]) -> Response | None:
    if sel["op"] not in ("replay", "discard") or sel["scope"] not in ("selected", "all"):
        return error_page(request, 400, "Bad request", "Choose replay or discard.")
    if not viewer.can(sel["op"]):
        return error_page(
            request,
            403,
            "Not allowed",
            f"{viewer.label} has read-only access here and may not {sel['op']}.",
        )
    return None


@action(None)
async def dlq_preview(request: Request, viewer: Viewer, form: FormData) -> Response:
    """The dry run: how many jobs the action would touch, and a button to confirm it."""
    sel = _dlq_selection(form)
    problem = _dlq_problem(request, viewer, sel)
    if problem is not None:
        return problem
    back = {"queue": sel["queue"], "name": sel["name"]}
    if sel["scope"] == "selected" and not sel["ids"]:
        flash(request, "Select at least one job, or choose every job matching the filter.", "error")
        return redirect(request, "dlq", back)
    if sel["op"] == "discard" and not sel["reason"]:
        flash(request, "Discarding needs a reason (it goes into the audit log).", "error")
        return redirect(request, "dlq", back)
    result = await _run(request, _dlq_call, request, viewer, sel, True)
    if result is None:
        return redirect(request, "dlq", back)
    return render(
        request,
        viewer,
        "dlq_confirm.html",
        {
            "nav": "dlq",
            "sel": sel,
            "matched": result.matched,
            "skipped": result.skipped,
            # apply exactly the jobs the dry run counted (the filter again only past MAX_IDS)
            "apply_scope": "selected" if len(result.matched) <= MAX_IDS else "all",
            "ids_value": ",".join(str(i) for i in result.matched[:MAX_IDS]),
        },
    )


@action(None)
async def dlq_apply(request: Request, viewer: Viewer, form: FormData) -> Response:
    sel = _dlq_selection(form)
    problem = _dlq_problem(request, viewer, sel)
    if problem is not None:
        return problem
    back = {"queue": sel["queue"], "name": sel["name"]}
    if sel["scope"] == "selected" and not sel["ids"]:
        flash(request, "Nothing to do: no job was selected.", "error")
        return redirect(request, "dlq", back)
    result = await _run(request, _dlq_call, request, viewer, sel, False)
    if result is not None:
        _report(request, sel["op"], result)
    return redirect(request, "dlq", back)


# -- editing pending jobs (one from its page, or many from the jobs page) -----------------
def _edit_form(form: FormData) -> tuple[list[int], dict[str, Any]]:
    """The ids and the edit a form asks for (ValueError, saying what is wrong)."""
    ids: list[int] = []
    for value in form.getlist("ids"):
        ids.extend(i for i in map(as_id, str(value).split(",")) if i is not None)
    options: dict[str, Any] = {}
    if text := form_text(form, "run_at"):
        when = _parsed(
            datetime.fromisoformat, text, "run at", "a date and time, as 2026-05-01T12:00"
        )
        options["run_at"] = when if when.tzinfo else when.replace(tzinfo=UTC)
    if text := form_text(form, "delay"):
        options["delay"] = _parsed(float, text, "delay", "a number of seconds")
    if text := form_text(form, "priority"):
        options["priority"] = _parsed(int, text, "priority", "a whole number")
    if form_text(form, "queue"):
        options["queue"] = form_text(form, "queue")
    if form_text(form, "args"):
        try:
            args = json.loads(form_text(form, "args"))
        except RecursionError:
            raise ValueError("the arguments are nested too deep") from None
        if not isinstance(args, dict):
            raise ValueError("the arguments must be a JSON object")
        options["args"] = args
    return list(dict.fromkeys(ids))[:MAX_IDS], options


def _parsed(parse: Callable[[str], T], text: str, field: str, wanted: str) -> T:
    """``parse(text)``, or a ValueError quoting at most the start of ``text`` (Python's
    own message quotes all of it, into the flash message and the session cookie)."""
    try:
        return parse(text)
    except ValueError:
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise ValueError(f"{field} {shown!r} is not {wanted}") from None


async def _edit(request: Request, viewer: Viewer, form: FormData, dry_run: bool) -> Any:
    try:
        ids, options = _edit_form(form)
    except ValueError as exc:
        flash(request, f"Cannot edit: {exc}", "error")
        return None
    if not ids:
        flash(request, "Select at least one job to edit.", "error")
        return None
    app = settings(request).app
    result = await _run(request, app.edit, ids, dry_run=dry_run, actor=viewer.actor, **options)
    return None if result is None else (ids, options, result)


def _back(form: FormData) -> dict[str, Any]:
    return {
        "state": form_text(form, "state") or None,
        "queue": form_text(form, "back_queue") or None,
    }


@action("edit")
async def jobs_edit_preview(request: Request, viewer: Viewer, form: FormData) -> Response:
    """The dry run of an edit: the jobs it would change, and a button to apply it."""
    done = await _edit(request, viewer, form, dry_run=True)
    if done is None:
        return redirect(request, "jobs", _back(form))
    _, options, result = done
    fields = {k: form_text(form, k) for k in ("run_at", "delay", "priority", "queue", "args")}
    return render(
        request,
        viewer,
        "edit_confirm.html",
        {
            "nav": "jobs",
            "matched": result.matched,
            "skipped": result.skipped,
            "ids_value": ",".join(str(i) for i in result.matched),
            "fields": fields,
            "changes": sorted(options),
            "back": _back(form),
        },
    )


@action("edit")
async def jobs_edit_apply(request: Request, viewer: Viewer, form: FormData) -> Response:
    done = await _edit(request, viewer, form, dry_run=False)
    if done is not None:
        _, _, result = done
        if result.matched:
            flash(request, f"{len(result.matched)} job(s) edited: "
                  + ", ".join(str(i) for i in result.matched[:10]) + ".")  # fmt: skip
        for job_id, why in list(result.skipped.items())[:10]:
            flash(request, f"Job {job_id} skipped: {why}.", "error")
    ids = _edit_form(form)[0] if done is not None else []
    if len(ids) == 1 and form_text(form, "from_job"):
        return redirect(request, "job", job_id=ids[0])
    return redirect(request, "jobs", _back(form))


# -- queues ------------------------------------------------------------------------------
async def _queue_toggle(request: Request, viewer: Viewer, verb: str) -> Response:
    app = settings(request).app
    queue = request.path_params["queue"]
    fn = getattr(app, verb, None)
    if fn is None:
        return error_page(
            request, 501, "Not available", f"This version of errands cannot {verb} queues yet."
        )
    try:
        await acting(fn, queue, actor=viewer.actor)
    except ErrandsError as exc:
        flash(request, str(exc), "error")
    else:
        flash(request, f"Queue {queue} {'paused' if verb == 'pause' else 'resumed'}.")
    return redirect(request, "queues")


@action("pause")
async def queue_pause(request: Request, viewer: Viewer, form: FormData) -> Response:
    return await _queue_toggle(request, viewer, "pause")


@action("pause")
async def queue_resume(request: Request, viewer: Viewer, form: FormData) -> Response:
    return await _queue_toggle(request, viewer, "resume")
