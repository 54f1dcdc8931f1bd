"""``create_app``: the dashboard as one ASGI application, to run alone or mount in yours."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import jinja2
from starlette.applications import Starlette
from starlette.convertors import Convertor, register_url_convertor
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import ConfigurationError
from . import actions, pages, web
from .format import FILTERS
from .security import RESOLVER_TIMEOUT, AuthConfig, Authorize, UserResolver
from .web import Settings


class IdConvertor(Convertor[int]):
    """A job's or a workflow's id in a path: 1 to 18 digits, no leading zero (what a
    store keeps). Any int convertor passed 30-digit ids to the store, which raised
    OverflowError: a bare 500; such a path is now simply not found (404)."""

    regex = "[1-9][0-9]{0,17}"

    def convert(self, value: str) -> int:
        return int(value)

    def to_string(self, value: int) -> str:
        return str(value)


# A name of its own: starlette's convertors are global, and "id" would replace a host
# app's own for the routes it compiles after importing the dashboard.
register_url_convertor("errands_id", IdConvertor())

if TYPE_CHECKING:
    from ..app import App

SESSION_COOKIE = "errands_dashboard"
SESSION_MAX_AGE = 8 * 3600

# No inline script or style anywhere: the page runs only the files the package ships.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = [
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
]


class SecurityHeaders:
    """Adds the headers above to every response, and ``no-store`` to every page."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        is_static = "/static/" in scope.get("path", "")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {k.lower() for k, _ in headers}
                headers.extend(h for h in SECURITY_HEADERS if h[0] not in present)
                if not is_static and b"cache-control" not in present:
                    headers.append((b"cache-control", b"no-store"))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def create_app(
    app: App,
    *,
    authorize: Authorize | None = None,
    user: UserResolver | None = None,
    password: str | None = None,
    token: str | None = None,
    secret_key: str | None = None,
    https_only: bool = False,
    resolver_timeout: float = RESOLVER_TIMEOUT,
    refresh_seconds: int = 5,
    title: str = "errands",
    allowed_origins: Iterable[str] = (),
) -> Starlette:
    """The dashboard for ``app`` as an ASGI application (Starlette).

    ``password`` / ``token`` default to ``ERRANDS_DASHBOARD_PASSWORD`` /
    ``ERRANDS_DASHBOARD_TOKEN``; with either, the dashboard shows its own login page.
    ``user(request)`` instead lets your application's login name the user (``None``: not
    signed in): the only authenticated identity (``request.state.user``); a name typed on the
    login page is a label only. With none of them, only loopback clients are served.
    ``authorize(request)`` returns ``"all"``, ``"read"``, a set of actions
    (``{"replay", "discard", "cancel", "pause", "signal", "edit"}``) or ``None`` (no access);
    default ``"all"``.
    ``user`` and ``authorize`` may be ``async``; one that raises, returns something else or
    takes over ``resolver_timeout`` seconds denies the request (500) and logs why.
    ``secret_key`` signs the session cookie (default ``ERRANDS_DASHBOARD_SECRET``, else a
    random key per process, so sessions end on restart). ``https_only`` marks the cookie
    Secure: set it when the dashboard is served over HTTPS. ``allowed_origins``
    (``["https://jobs.example.com"]``): the addresses a browser may post the dashboard's
    forms from besides the request's ``Host``, for a reverse proxy that rewrites ``Host``.
    """
    auth = AuthConfig.build(
        password=password,
        token=token,
        user=user,
        authorize=authorize,
        secret_key=secret_key,
        timeout=resolver_timeout,
    )
    environment = jinja2.Environment(
        loader=jinja2.PackageLoader("errands.dashboard", "templates"),
        autoescape=True,  # every template, whatever its file name
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    environment.filters.update(FILTERS)
    templates = Jinja2Templates(env=environment)
    routes = [
        Route("/", pages.overview, name="overview"),
        Route("/jobs", pages.jobs, name="jobs"),
        Route("/jobs/{job_id:errands_id}", pages.job_detail, name="job"),
        Route(
            "/jobs/{job_id:errands_id}/cancel",
            actions.job_cancel,
            methods=["POST"],
            name="job_cancel",
        ),
        Route(
            "/jobs/{job_id:errands_id}/signal",
            actions.job_signal,
            methods=["POST"],
            name="job_signal",
        ),
        Route(
            "/jobs/{job_id:errands_id}/replay",
            actions.job_replay,
            methods=["POST"],
            name="job_replay",
        ),
        Route(
            "/jobs/{job_id:errands_id}/discard",
            actions.job_discard,
            methods=["POST"],
            name="job_discard",
        ),
        Route("/dlq", pages.dlq, name="dlq"),
        Route("/dlq/preview", actions.dlq_preview, methods=["POST"], name="dlq_preview"),
        Route(
            "/jobs/edit/preview",
            actions.jobs_edit_preview,
            methods=["POST"],
            name="jobs_edit_preview",
        ),
        Route(
            "/jobs/edit/apply", actions.jobs_edit_apply, methods=["POST"], name="jobs_edit_apply"
        ),
        Route("/dlq/apply", actions.dlq_apply, methods=["POST"], name="dlq_apply"),
        Route("/queues", pages.queues, name="queues"),
        Route("/queues/{queue}/tenants", pages.queue_tenants, name="queue_tenants"),
        Route("/queues/{queue}/pause", actions.queue_pause, methods=["POST"], name="queue_pause"),
        Route(
            "/queues/{queue}/resume", actions.queue_resume, methods=["POST"], name="queue_resume"
        ),
        Route("/workers", pages.workers, name="workers"),
        Route("/cron", pages.cron, name="cron"),
        Route("/workflows", pages.workflows, name="workflows"),
        Route("/workflows/{workflow_id:errands_id}", pages.workflow_detail, name="workflow"),
        Route("/audit", pages.audit, name="audit"),
        Route("/login", actions.login_form, methods=["GET"], name="login"),
        Route("/login", actions.login_submit, methods=["POST"], name="login_submit"),
        Route("/logout", actions.logout, methods=["POST"], name="logout"),
        Mount(
            "/static",
            StaticFiles(packages=[("errands.dashboard", "static")]),
            name="static",
        ),
    ]
    middleware = [
        Middleware(SecurityHeaders),
        Middleware(
            SessionMiddleware,
            secret_key=auth.secret_key,
            session_cookie=SESSION_COOKIE,
            max_age=SESSION_MAX_AGE,
            same_site="lax",
            https_only=https_only,
        ),
    ]
    dashboard = Starlette(
        routes=routes, middleware=middleware, exception_handlers={404: web.not_found}
    )
    dashboard.state.errands = Settings(
        app=app,
        auth=auth,
        templates=templates,
        refresh_seconds=max(int(refresh_seconds), 0),
        title=title,
        allowed_origins=origin_hosts(allowed_origins),
    )
    return dashboard


def origin_hosts(origins: Iterable[str]) -> frozenset[str]:
    """``https://jobs.example.com:8443`` (or ``jobs.example.com:8443``) -> its host and
    port, as an ``Origin`` header is compared with ``Host``."""
    if isinstance(origins, str):
        origins = [origins]
    hosts = set()
    for origin in origins:
        text = str(origin).strip()
        parts = urlsplit(text if "://" in text else f"//{text}")
        if not parts.netloc or parts.path.strip("/") or parts.query or "@" in parts.netloc:
            raise ConfigurationError(
                f"allowed_origins: {text!r} is not an origin; give the address the browser "
                "shows, as in https://jobs.example.com (a port too, if it has one)"
            )
        hosts.add(parts.netloc.lower())
    return frozenset(hosts)


def describe(dashboard: Any) -> str:
    """One line on how the dashboard's login is set up (printed by the CLI)."""
    auth: AuthConfig = dashboard.state.errands.auth
    if auth.user is not None:
        return "login: your application's (user= resolver)"
    ways = [w for w, v in (("password", auth.password), ("token", auth.token)) if v]
    if ways:
        return "login: " + " or ".join(ways)
    return "no login: serving loopback clients only"
