"""Request plumbing shared by pages and actions: who is asking, what they may do, rendering.

``@page`` handlers get the :class:`Viewer`; ``@action(name)`` handlers also get the parsed
form, and run only after the login, the CSRF token and the right to ``name`` are checked,
in that order. Blocking store calls run in Starlette's thread pool (:func:`blocking`).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode, urlsplit

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.templating import Jinja2Templates

from .. import __version__
from ..backends import redact_url
from ..definition import check_text
from ..errors import ErrandsError, SchemaOutdated
from ..hooks import protect_current_thread
from .security import (
    CSRF_FIELD,
    CSRF_HEADER,
    LOCAL_USER,
    LOGIN_PHRASES,
    Access,
    AuthConfig,
    Identity,
    ResolverError,
    clean_user_name,
    csrf_matches,
    is_loopback_address,
    is_loopback_host_header,
    new_csrf_token,
    proxy_header,
    resolve_access,
    resolve_user,
)

if TYPE_CHECKING:
    from ..app import App

PageHandler = Callable[[Request, "Viewer"], Awaitable[Response]]
ActionHandler = Callable[[Request, "Viewer", FormData], Awaitable[Response]]


@dataclass
class Settings:
    """Everything a handler needs, kept on ``starlette_app.state.errands``."""

    app: App
    auth: AuthConfig
    templates: Jinja2Templates
    refresh_seconds: int
    title: str
    allowed_origins: frozenset[str] = frozenset()  # hosts (netlocs) besides Host's


@dataclass(frozen=True)
class Viewer:
    identity: Identity
    access: Access
    csrf: str

    @property
    def label(self) -> str:
        """The name shown in the header (typed at the login form, unless authenticated)."""
        return self.identity.label

    @property
    def actor(self) -> str:
        """Who the audit log says did it, and how they signed in."""
        return self.identity.actor

    def can(self, action: str) -> bool:
        return self.access.can(action)


ID_TEXT = re.compile("[0-9]{1,18}")


def settings(request: Request) -> Settings:
    return request.app.state.errands  # type: ignore[no-any-return]


async def blocking(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return await run_in_threadpool(fn, *args, **kwargs)


async def acting(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """An operator's action (cancel, replay, discard, edit, signal, pause): as
    :func:`blocking`, on a thread marked the dashboard's own for the call, so the event
    subscribers it reaches (the app's, user code) run on the events lane within
    ``hook_timeout``: inline, a hung one held the request, and a pool thread, for ever."""
    return await run_in_threadpool(_as_own_thread, fn, *args, **kwargs)


def _as_own_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    protect_current_thread(True)
    try:
        return fn(*args, **kwargs)
    finally:
        protect_current_thread(False)  # the pool's thread serves pages next


def csrf_token(request: Request) -> str:
    token = request.session.get("csrf")
    if not token:
        token = new_csrf_token()
        request.session["csrf"] = token
    return str(token)


FLASH_KEPT = 5  # messages the session holds until a page shows them
FLASH_MAX_BYTES = 300  # of one message, as the session cookie holds it (JSON, \u-escaped)


def flash(request: Request, message: str, kind: str = "ok") -> None:
    """A message for the next page, kept in the session cookie: clipped, so a message
    echoing a long input (a 20 KB run-at quoted by fromisoformat made a 27 KB Set-Cookie,
    which browsers drop, and the session with it) keeps the cookie small."""
    messages = list(request.session.get("flash", []))[-(FLASH_KEPT - 1) :]
    messages.append([kind, clip(message, FLASH_MAX_BYTES)])
    request.session["flash"] = messages


def clip(text: str, max_bytes: int) -> str:
    """``text`` cut, with "...", to at most ``max_bytes`` as JSON writes it (ASCII, with
    \\u escapes: up to 12 bytes a character)."""
    if len(json.dumps(text)) - 2 <= max_bytes:
        return text
    size = 3  # "..."
    for end, char in enumerate(text):
        size += len(json.dumps(char)) - 2
        if size > max_bytes:
            return text[:end] + "..."
    return text


def path_for(
    request: Request, name: str, /, query: dict[str, Any] | None = None, **params: Any
) -> str:
    """The path (with the mount prefix) of a named route, plus a query string."""
    path = str(request.url_for(name, **params).path)
    pairs = {k: v for k, v in (query or {}).items() if v not in (None, "")}
    return path + ("?" + urlencode(pairs) if pairs else "")


def redirect(
    request: Request, name: str, /, query: dict[str, Any] | None = None, **params: Any
) -> Response:
    return RedirectResponse(path_for(request, name, query, **params), status_code=303)


def safe_next(request: Request, value: str | None) -> str:
    """Only a path on this site (never ``//host`` or a scheme) is followed after login."""
    if value and value.startswith("/") and not value.startswith("//") and "\\" not in value:
        return value
    return path_for(request, "overview")


def error_page(
    request: Request,
    status: int,
    title: str,
    message: str,
    viewer: Viewer | None = None,
    fix: str = "",
) -> Response:
    """An error page; with the ``viewer`` (signed in) it has the navigation too."""
    conf = settings(request)
    context = {"status": status, "heading": title, "message": message, "fix": fix}
    return conf.templates.TemplateResponse(
        request,
        "error.html",
        {**context, **base_context(request, viewer)},
        status_code=status,
    )


def store_problem(app: App) -> Exception | None:
    """Why the app's database cannot serve the dashboard (unreachable, no or an outdated
    schema), or None when it can."""
    try:
        app.backend.schema_check()
    except Exception as exc:
        return exc
    return None


def store_error_page(request: Request, viewer: Viewer, problem: Exception) -> Response:
    """503: what is wrong with the database and how to fix it, with the navigation."""
    app = settings(request).app
    shown = redact_url(app.url)
    if isinstance(problem, SchemaOutdated):
        title = "The database has no errands schema, or an outdated one"
        fix = (
            f"Run `errands migrate --url {shown}` (or `errands migrate module:app`; in a "
            "Django project, `python manage.py migrate`), then reload this page."
        )
    else:
        title = "The database cannot be reached"
        fix = (
            f"Check that the database server is running and reachable from here, and that "
            f"the URL is right: {shown} (--url, the app's code or ERRANDS_URL). Then reload "
            "this page."
        )
    message = (
        str(problem)
        if isinstance(problem, ErrandsError)
        else f"{type(problem).__name__}: {problem}"
    )
    return error_page(request, 503, title, message, viewer, fix=fix)


def base_context(request: Request, viewer: Viewer | None) -> dict[str, Any]:
    conf = settings(request)
    flashes = request.session.pop("flash", []) if viewer is not None else []
    return {
        "viewer": viewer,
        "title": conf.title,
        "version": __version__,
        "flashes": flashes,
        "login_page": conf.auth.login_page,
        "login_phrases": LOGIN_PHRASES,
        "csrf_field": CSRF_FIELD,
        "csrf": csrf_token(request),
        "path_for": functools.partial(path_for, request),
        "refresh_seconds": conf.refresh_seconds,
        "live_url": request.url.path + ("?" + request.url.query if request.url.query else ""),
    }


def render(
    request: Request, viewer: Viewer, template: str, context: dict[str, Any], status: int = 200
) -> Response:
    conf = settings(request)
    merged = {**base_context(request, viewer), **context}
    return conf.templates.TemplateResponse(request, template, merged, status_code=status)


async def authenticate(request: Request) -> Viewer | Response:
    """The viewer, or the response that turns the request away."""
    try:
        return await identify_and_authorize(request)
    except ResolverError as exc:  # already logged; deny, without a traceback
        return error_page(request, 500, "Access check failed", str(exc))


async def identify_and_authorize(request: Request) -> Viewer | Response:
    auth = settings(request).auth
    if auth.user is not None:
        identity = await resolver_identity(request, auth)
    elif auth.login_page:
        identity = session_identity(request, auth)
    else:
        identity = loopback_refusal(request) or Identity(LOCAL_USER, "loopback")
    if isinstance(identity, Response):
        return identity
    request.state.identity = identity
    request.state.user = identity.user  # None unless the user= resolver vouched for it
    access = await resolve_access(auth, request)
    if access is None:
        return error_page(
            request, 403, "Forbidden", f"{identity.label} may not open this dashboard."
        )
    return Viewer(identity=identity, access=access, csrf=csrf_token(request))


async def resolver_identity(request: Request, auth: AuthConfig) -> Identity | Response:
    """The user your ``user=`` resolver names: the only authenticated identity."""
    user = await resolve_user(auth, request)
    if user is None:
        return error_page(
            request, 401, "Not signed in", "Sign in to the application to see this page."
        )
    return Identity(label=clean_user_name(user, "?", limit=200), method="user", user=user)


def session_identity(request: Request, auth: AuthConfig) -> Identity | Response:
    """A shared-secret login's session: a typed label and how it signed in, no identity."""
    label = request.session.get("label")
    method = request.session.get("login")
    if isinstance(label, str) and method in auth.login_methods:
        return Identity(label=label, method=method)
    if request.method == "GET":
        target = request.url.path + ("?" + request.url.query if request.url.query else "")
        return redirect(request, "login", {"next": target})
    return error_page(request, 401, "Not signed in", "Your session ended: sign in again.")


HOW_TO_LOG_IN = (
    "Set ERRANDS_DASHBOARD_PASSWORD or ERRANDS_DASHBOARD_TOKEN (--password / --token), or "
    "mount it with create_app(user=...) behind your own login."
)


def loopback_refusal(request: Request) -> Response | None:
    """Without a login: None for a direct request from this machine, else the 403 page."""
    client = request.client.host if request.client else None
    if not is_loopback_address(client) or not is_loopback_host_header(
        request.headers.get("host", "")
    ):
        return error_page(
            request,
            403,
            "Login required",
            "This dashboard has no login configured, so it only answers on 127.0.0.1. "
            + HOW_TO_LOG_IN,
        )
    forwarded = proxy_header(request.headers.keys())
    if forwarded is not None:
        return error_page(
            request,
            403,
            "Login required behind a proxy",
            f"This request came through a proxy (it carries {forwarded}), and this dashboard "
            "has no login: it only answers requests made directly on this machine. Configure "
            "a login before putting it behind a proxy. " + HOW_TO_LOG_IN,
        )
    return None


def page(fn: PageHandler) -> Callable[[Request], Awaitable[Response]]:
    @functools.wraps(fn)
    async def endpoint(request: Request) -> Response:
        viewer = await authenticate(request)
        if isinstance(viewer, Response):
            return viewer
        try:
            return await fn(request, viewer)
        except Exception as exc:
            # The database (unreachable, not migrated): a page saying what to do.
            problem = await blocking(store_problem, settings(request).app)
            if problem is not None:
                return store_error_page(request, viewer, problem)
            if isinstance(exc, ErrandsError):  # a filter errands refuses: a clear 400
                return error_page(request, 400, "Bad request", str(exc), viewer)
            raise

    return endpoint


async def not_found(request: Request, exc: Exception) -> Response:
    """404 for any path the dashboard does not have, with the navigation (signed in)."""
    viewer = await authenticate(request)
    if isinstance(viewer, Response):
        return viewer
    return error_page(
        request,
        404,
        "Page not found",
        f"The dashboard has no page at {request.url.path}. Use the links above.",
        viewer,
    )


def csrf_ok(request: Request, form: FormData, viewer_token: str) -> bool:
    given = form.get(CSRF_FIELD) or request.headers.get(CSRF_HEADER)
    return csrf_matches(viewer_token, given if isinstance(given, str) else None)


def origin_refusal(request: Request) -> Response | None:
    """The 403 page when the browser's ``Origin`` names another host than the request's
    ``Host`` (and than ``allowed_origins``), else None. The host only is compared: a
    TLS-terminating proxy may change the scheme. A proxy that rewrites ``Host`` (nginx's
    default: ``proxy_pass http://127.0.0.1:8080`` sends ``Host: 127.0.0.1:8080``) fails
    every action this way, so the page names both headers and the fix."""
    origin = request.headers.get("origin")
    if not origin:
        return None
    origin_host = urlsplit(origin).netloc.lower()
    host = request.headers.get("host", "").lower()
    if origin_host == host or origin_host in settings(request).allowed_origins:
        return None
    return error_page(
        request,
        403,
        "Origin does not match Host",
        f"The browser sent this form from {origin[:200]!r} (its Origin header), but the "
        f"request names the host {host[:200]!r} (its Host header), so it was refused as "
        "coming from another site.",
        fix="If you opened the dashboard at that address through a reverse proxy, the "
        "proxy rewrites Host: have it pass the browser's Host through (nginx: "
        "proxy_set_header Host $host;), or list the public address in "
        "create_app(allowed_origins=[...]) (errands dashboard --allowed-origin). "
        "Otherwise, reload the dashboard from its own address.",
    )


def action(
    right: str | None,
) -> Callable[[ActionHandler], Callable[[Request], Awaitable[Response]]]:
    """A state change: login, then CSRF token, then the right to ``right``."""

    def decorate(fn: ActionHandler) -> Callable[[Request], Awaitable[Response]]:
        @functools.wraps(fn)
        async def endpoint(request: Request) -> Response:
            viewer = await authenticate(request)
            if isinstance(viewer, Response):
                return viewer
            form = await request.form()
            if not csrf_ok(request, form, viewer.csrf):
                return error_page(
                    request,
                    403,
                    "CSRF check failed",
                    "This form is stale or did not come from the dashboard. Reload the page "
                    "and try again.",
                )
            refused = origin_refusal(request)
            if refused is not None:
                return refused
            if right is not None and not viewer.can(right):
                return error_page(
                    request,
                    403,
                    "Not allowed",
                    f"{viewer.label} has read-only access here and may not {right}.",
                )
            try:
                return await fn(request, viewer, form)
            except Exception:
                # The database (unreachable, not migrated): the page saying what to do, as
                # a page gives it (an action gave a bare 500).
                problem = await blocking(store_problem, settings(request).app)
                if problem is not None:
                    return store_error_page(request, viewer, problem)
                raise

        return endpoint

    return decorate


def form_text(form: FormData, name: str) -> str:
    value = form.get(name)
    return value.strip() if isinstance(value, str) else ""


def query_text(request: Request, name: str, limit: int = 200) -> str | None:
    value = request.query_params.get(name, "").strip()[:limit]
    return check_text(f"the {name!r} filter", value) or None


def as_id(text: str) -> int | None:
    """``text`` as a job's or a workflow's id (1 to 18 ASCII digits, not 0), else None:
    ``str.isdigit`` takes "²" too, which int() then refuses (a bare 500), and the App
    refuses id 0 (ConfigurationError: a 500 for ?before_id=0)."""
    text = text.strip()
    value = int(text) if ID_TEXT.fullmatch(text) else 0
    return value if value >= 1 else None


def query_int(request: Request, name: str) -> int | None:
    return as_id(request.query_params.get(name, ""))
