"""Flask: keep the App on the Flask application, and a ``flask errands-worker`` command.

::

    jobs = errands.App(os.environ["ERRANDS_URL"])
    web = Flask(__name__)
    Errands(web, jobs)                       # current_jobs() in views; flask errands-worker

    @web.post("/orders")
    def create_order():
        with Session(engine) as session, session.begin():
            order = Order(...); session.add(order); session.flush()
            charge_order.enqueue(order_id=order.id, conn=session)   # same transaction

Production runs ``flask errands-worker`` (or ``errands worker module:jobs``) as its own
process; ``embedded_worker=True`` runs one inside the web process for development.
"""

from __future__ import annotations

import atexit
from typing import Any

import click
from flask import Flask, current_app

from ..app import App
from ..cli.params import FiniteFloatRange
from ..errors import ConfigurationError, ErrandsError
from ._embedded import EmbeddedWorker

EXTENSION = "errands"


class Errands:
    def __init__(
        self,
        web: Flask | None = None,
        app: App | None = None,
        *,
        embedded_worker: bool = False,
        **worker_options: Any,
    ) -> None:
        self.app = app
        self.embedded_worker = embedded_worker
        self.worker_options = worker_options
        self.worker: EmbeddedWorker | None = None
        if web is not None:
            self.init_app(web, app)

    def init_app(self, web: Flask, app: App | None = None) -> None:
        app = app or self.app
        if app is None:
            raise ConfigurationError("Errands(web, app): pass the errands App to use")
        self.app = app
        web.extensions[EXTENSION] = app
        web.cli.add_command(_worker_command(app))
        if self.embedded_worker and self.worker is None:
            self.worker = EmbeddedWorker(app, **self.worker_options).start()
            atexit.register(self.worker.stop)


def current_jobs() -> App:
    """The App of the current Flask application (inside a request or app context)."""
    app = current_app.extensions.get(EXTENSION)
    if not isinstance(app, App):
        raise ConfigurationError("no errands App on this Flask application: Errands(web, app)")
    return app


def _worker_command(app: App) -> click.Command:
    @click.command("errands-worker")
    @click.option("-q", "--queues", help="queues to serve: emails,payments or emails=10")
    @click.option("-c", "--concurrency", type=click.IntRange(min=1), help="jobs at once")
    @click.option("--grace", type=FiniteFloatRange(min=0), default=30.0, show_default=True)
    @click.option("--poll-interval", type=FiniteFloatRange(min=0.01), default=1.0)
    def errands_worker(
        queues: str | None, concurrency: int | None, grace: float, poll_interval: float
    ) -> None:
        """Run an errands worker for this application's jobs (until SIGTERM/SIGINT)."""
        from ..observability.logcontext import configure_logging
        from ..worker.collector import use_worker_gc
        from ..worker.switching import use_switch_interval

        configure_logging("text", "info")
        use_switch_interval()  # this process is the worker's own (errands worker's default)
        try:
            worker = app.worker(
                queues=queues, concurrency=concurrency, grace=grace, poll_interval=poll_interval
            )
            use_worker_gc()  # the app imported, the worker built: see worker/collector.py
            code = worker.run()
        except ErrandsError as exc:  # one line naming the problem, as `errands worker`
            raise click.ClickException(str(exc)) from None
        raise SystemExit(code)

    return errands_worker


__all__ = ["Errands", "current_jobs"]
