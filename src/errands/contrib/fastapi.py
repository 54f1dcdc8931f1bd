"""FastAPI helpers: a lifespan that holds the App (and, for development, runs a worker in
the web process) and a dependency that hands the App to endpoints.

::

    from fastapi import FastAPI
    from errands.contrib.fastapi import ErrandsApp, lifespan, mount_dashboard

    jobs = errands.App("postgresql://db/shop")
    api = FastAPI(lifespan=lifespan(jobs))          # worker=True: an embedded worker
    mount_dashboard(api, jobs, path="/admin/jobs", user=current_admin)

    @api.get("/jobs/{job_id}")
    def job_status(job_id: int, app: ErrandsApp) -> dict: ...

Enqueue inside the request's SQLAlchemy transaction with ``job.enqueue(..., conn=session)``:
the job commits or rolls back with the request's own rows. See docs/integrations.md.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from starlette.concurrency import run_in_threadpool

from ..app import App
from ..errors import ConfigurationError
from ._embedded import EmbeddedWorker

EMBEDDED_WORKER_ENV = "ERRANDS_EMBEDDED_WORKER"

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[Any]]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def lifespan(
    app: App,
    *,
    worker: bool | None = None,
    migrate: bool = False,
    inner: Lifespan | None = None,
    close: bool = True,
    **worker_options: Any,
) -> Lifespan:
    """A FastAPI ``lifespan`` that puts ``app`` on ``request.app.state.errands``.

    ``worker``: run an embedded worker (a thread of this process, stopped gracefully at
    shutdown) — for development; production runs ``errands worker`` processes. Default:
    the ``ERRANDS_EMBEDDED_WORKER`` environment variable (1/true/yes) at startup.
    ``migrate``: apply errands' migrations at startup (development convenience).
    ``inner``: your own lifespan, entered inside this one (its state is passed through).
    ``close``: close the App's connections at shutdown. Other keyword arguments are the
    worker's options (``queues``, ``concurrency``, ``poll_interval``...).
    """

    @asynccontextmanager
    async def errands_lifespan(web: FastAPI) -> AsyncIterator[Any]:
        web.state.errands = app
        embedded: EmbeddedWorker | None = None
        try:
            if migrate:
                await run_in_threadpool(app.migrate)
            if _env_flag(EMBEDDED_WORKER_ENV) if worker is None else worker:
                embedded = EmbeddedWorker(app, **worker_options)
                await run_in_threadpool(embedded.start)
            web.state.errands_worker = embedded
            if inner is None:
                yield None
            else:
                async with inner(web) as state:
                    yield state
        finally:
            if embedded is not None:
                await run_in_threadpool(embedded.stop)
            if close:
                app.close()

    return errands_lifespan


def get_app(request: Request) -> App:
    """Dependency: the App the lifespan installed."""
    app = getattr(request.app.state, "errands", None)
    if not isinstance(app, App):
        raise ConfigurationError(
            "no errands App on this FastAPI application: create it with "
            "FastAPI(lifespan=errands.contrib.fastapi.lifespan(app))"
        )
    return app


ErrandsApp = Annotated[App, Depends(get_app)]
"""An endpoint parameter annotated ``ErrandsApp`` receives the App."""


def mount_dashboard(web: FastAPI, app: App, path: str = "/admin/jobs", **options: Any) -> Any:
    """Mount errands' dashboard at ``path`` (``create_app`` options: ``user=``,
    ``authorize=``, ``password=``...). Without ``user=``, ``password=`` or ``token=`` it
    serves loopback clients only. Needs ``errands[dashboard]``; returns the dashboard."""
    from ..dashboard import create_app

    dashboard = create_app(app, **options)
    # unnamed: the dashboard builds its own URLs with url_for("static", ...), which a named
    # Mount would require as "name:static"
    web.mount("/" + path.strip("/"), dashboard)
    return dashboard


__all__ = ["EMBEDDED_WORKER_ENV", "ErrandsApp", "get_app", "lifespan", "mount_dashboard"]
