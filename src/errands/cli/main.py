"""``errands worker | status | jobs | dlq | workflows | migrate | demo``.

Every listing takes ``--json``. Errors print one line naming the problem and the fix, and
exit non-zero (1 for a failed operation, 2 for bad usage) — never a traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from typing import Any

import click

from .. import __version__
from ..errors import ConfigurationError, ErrandsError
from ..loading import sqlite_file
from ..observability.logcontext import configure_logging
from ..worker.collector import use_worker_gc
from ..worker.switching import SWITCH_INTERVAL, use_switch_interval
from .admin import dlq, jobs, status
from .dashboard import dashboard
from .loading import URL_HELP, load_app
from .params import FiniteFloatRange
from .render import notice
from .scheduling import cron, queues
from .workflows import workflows

APP_HELP = "the App as module:attribute (also ERRANDS_APP)"
log = logging.getLogger("errands.worker")


class ErrandsGroup(click.Group):
    """Turns every ErrandsError into one clear line and exit code 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ErrandsError as exc:
            notice(str(exc), "error")
            ctx.exit(1)


@click.group(cls=ErrandsGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="errands")
def cli() -> None:
    """errands: durable background jobs."""


@cli.command()
@click.argument("app_path", required=False, metavar="MODULE:APP")
@click.option("-A", "--app", "app_option", envvar="ERRANDS_APP", help=APP_HELP)
@click.option("--url", help=URL_HELP)
@click.option("-q", "--queues", help="queues to serve: emails,payments or emails=10,payments=2")
@click.option("-c", "--concurrency", type=click.IntRange(min=1), help="jobs at once (default 10)")
@click.option(
    "--prefetch",
    type=click.IntRange(min=0),
    help="jobs claimed beyond -c while handlers are quick, waiting for a free thread "
    "(default: 4 x -c, and 16 x -c for a fair queue; 0: off; at most 10,000)",
)
@click.option(
    "--grace",
    type=FiniteFloatRange(min=0),
    default=30.0,
    show_default=True,
    help="seconds in-flight jobs get to finish on SIGTERM",
)
@click.option(
    "--poll-interval",
    type=FiniteFloatRange(min=0.01),
    default=1.0,
    show_default=True,
    help="seconds between claims when the queues are idle",
)
@click.option(
    "--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
    default="info",
    show_default=True,
)
@click.option(
    "--switch-interval",
    type=FiniteFloatRange(min=0.0005, max=1.0),
    default=SWITCH_INTERVAL,
    show_default=True,
    help="seconds a thread holds the GIL while others wait for it (Python's default is "
    "0.005; see docs/concurrency.md)",
)
@click.option(
    "-p",
    "--processes",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="run this many worker processes under one supervisor (at most 1,024)",
)
@click.option(
    "--pool",
    type=click.Choice(["thread", "process"]),
    default="thread",
    show_default=True,
    help="where sync handlers run: threads, or child processes a timeout can kill",
)
@click.option(
    "--suspect-lanes",
    type=click.IntRange(min=1),
    help="rescued jobs (which may have crashed their last worker) run at most this many at "
    "once, each in a child process of its own (default and at most: -c; 1: one at a time "
    "in this process). Fewer lanes hold fewer child processes after a burst of rescues",
)
@click.option(
    "--express",
    type=click.IntRange(min=0),
    help="handler threads beyond -c for fair queues' keys with nothing running, used only "
    "when every slot is busy: a quiet tenant's job starts at once behind another's backlog "
    "(default with a fair queue: -c / 2, rounded down; 0: off)",
)
@click.option(
    "--no-maintenance",
    is_flag=True,
    help="never take the leader duties (rescue, cron, promotion, pruning)",
)
@click.option(
    "--maintenance-tick",
    type=FiniteFloatRange(min=0.01),
    help="seconds between maintenance rounds (leader election, rescue of expired leases, "
    "promotion); default: the app's lease / 4, at most 1",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(min=1, max=65535),
    help="serve Prometheus metrics at http://ADDR:PORT/metrics (needs errands[metrics])",
)
@click.option(
    "--metrics-addr",
    default="0.0.0.0",
    show_default=True,
    help="address the --metrics-port server binds (0.0.0.0: every interface, with no "
    "login; 127.0.0.1: this host only)",
)
def worker(
    app_path: str | None,
    app_option: str | None,
    url: str | None,
    queues: str | None,
    concurrency: int | None,
    prefetch: int | None,
    grace: float,
    poll_interval: float,
    log_format: str,
    log_level: str,
    switch_interval: float,
    no_maintenance: bool,
    maintenance_tick: float | None,
    processes: int,
    metrics_port: int | None,
    metrics_addr: str,
    pool: str,
    suspect_lanes: int | None,
    express: int | None,
) -> None:
    """Run a worker until SIGTERM or SIGINT (a second signal exits at once)."""
    configure_logging(log_format, log_level)
    from ..worker.supervisor import check_processes, stop_with_supervisor, supervisor_link

    check_processes(processes)  # before the app's import (a typo forked until out of memory)
    if metrics_port is not None and processes > 1:
        raise click.UsageError(
            "--metrics-port serves one process's metrics; with --processes N, run N workers "
            "with a --metrics-port each instead"
        )

    signalled = _keep_stop_signals()  # a SIGTERM while the app imports: a graceful stop
    _hangup_stops()
    supervisor = supervisor_link()  # before the app's import, which may start processes
    app = load_app(app_path or app_option, url, need_code=True)
    warn_new_database(app.url)
    if processes > 1:
        from ..worker.supervisor import Supervisor, child_command
        from ..worker.worker import check_counts

        check_counts(queues, concurrency, express, prefetch)  # once, not in every child
        app.backend.schema_check()  # fail once, clearly, rather than in every child
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the supervisor handles its own
        if signalled:
            sys.exit(0)  # stopped before any child started
        sys.exit(Supervisor(child_command(sys.argv[1:]), processes).run())
    if metrics_port is not None:
        from ..observability.metrics import serve_metrics

        try:
            serve_metrics(app, metrics_port, metrics_addr)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot serve metrics on {metrics_addr}:{metrics_port}: {exc.strerror or exc}; "
                "choose another --metrics-port"
            ) from None
    use_switch_interval(switch_interval)  # this process is the worker's own
    w = app.worker(
        queues=queues,
        concurrency=concurrency,
        prefetch=prefetch,
        grace=grace,
        poll_interval=poll_interval,
        maintenance=not no_maintenance,
        maintenance_tick=maintenance_tick,
        pool=pool,
        app_path=app_path or app_option,
        suspect_lanes=suspect_lanes,
        express=express,
    )
    stop_with_supervisor(w, supervisor)  # a child of --processes N: stops once it is gone
    use_worker_gc()  # the app imported, the worker built: see worker/collector.py
    code = w.run(signalled=signalled)
    if w.stuck_threads():
        # A handler thread ignored its timeout or the shutdown; Python cannot kill it,
        # and its job was already released or recorded, so leave without waiting for it.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _keep_stop_signals() -> list[int]:
    """Until the worker installs its own handlers: SIGTERM is remembered (the worker
    stops gracefully once started) instead of killing the process with Python's default
    (exit -15) while it imports the app and opens the store; a second one exits at once,
    status 1, as it does once the worker runs (each was remembered: the worker started,
    and stopped gracefully, exit 0). SIGINT (Ctrl-C) keeps interrupting at once."""
    from ..worker.worker import Worker  # (imported here: never in the handler)

    exit_now = Worker._exit_now
    received: list[int] = []
    pid = os.getpid()

    def keep(signum: int, frame: Any) -> None:
        if os.getpid() != pid:  # a forked child's (it inherits the handler the worker's
            signal.signal(signum, signal.SIG_DFL)  # relay puts back): as by default
            os.kill(os.getpid(), signum)
            return
        if received:
            exit_now(signum)
        received.append(signum)

    with contextlib.suppress(ValueError):  # not the main thread (an embedding host)
        signal.signal(signal.SIGTERM, keep)
    return received


def _hangup_stops() -> None:
    """A SIGHUP (the terminal the worker runs in closed) stops the worker gracefully, as
    it stops a supervisor's (``--processes N``): it is sent on as one SIGTERM (a hangup
    can come twice, and a second SIGTERM would skip the grace period). Its default action
    killed a lone worker at once, its running jobs left to be rescued after their leases
    (each rescue counted toward their poison limit). Ignored (``nohup``), it stays
    ignored; a supervisor puts its own handler in place of this one."""
    hangup = getattr(signal, "SIGHUP", None)  # POSIX only
    if hangup is None or signal.getsignal(hangup) is signal.SIG_IGN:
        return
    pid = os.getpid()
    sent: list[int] = []

    def stop(signum: int, frame: Any) -> None:
        if os.getpid() != pid:  # a forked child's: as by default
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if not sent:
            sent.append(signum)
            os.kill(pid, signal.SIGTERM)

    with contextlib.suppress(ValueError):  # not the main thread (an embedding host)
        signal.signal(hangup, stop)


def warn_new_database(url: str) -> None:
    """A worker about to create a new SQLite file: say so, with its absolute path (started
    from the wrong folder, a worker would otherwise wait on an empty database)."""
    path = sqlite_file(url)
    if path is not None and not os.path.exists(path) and os.path.isdir(os.path.dirname(path)):
        notice(
            f"there is no database at {path} yet: this worker creates a new, empty "
            "one. If your jobs are stored elsewhere, start it from that folder or pass "
            "--url sqlite:////absolute/path/to/your.db"
        )


@cli.command()
@click.argument("app_path", required=False, metavar="MODULE:APP")
@click.option("-A", "--app", "app_option", envvar="ERRANDS_APP", help=APP_HELP)
@click.option("--url", help=URL_HELP)
@click.option(
    "--sql",
    "print_sql",
    is_flag=True,
    help="print the SQL instead of applying it (for your own migration tooling)",
)
@click.option(
    "--after",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="with --sql: only migrations newer than this version",
)
def migrate(
    app_path: str | None, app_option: str | None, url: str | None, print_sql: bool, after: int
) -> None:
    """Apply pending schema migrations (safe to run from several processes at once)."""
    if print_sql:
        from ..backends import migration_script

        target = url or (load_app(app_path or app_option).url)
        click.echo(migration_script(target, after), nl=False)
        return
    app = load_app(app_path or app_option, url)
    applied = app.migrate()
    if applied:
        for name in applied:
            click.echo(f"applied {name}")
    else:
        click.echo("schema is up to date")


@cli.command()
@click.option(
    "--db",
    "db_path",
    default="errands-demo.db",
    show_default=True,
    help="SQLite file for the demo (recreated on each run)",
)
@click.option(
    "--jobs",
    "job_count",
    type=click.IntRange(min=10, max=5000),
    default=300,
    show_default=True,
    help="how many jobs to enqueue",
)
def demo(db_path: str, job_count: int) -> None:
    """Run a small realistic app end to end on a fresh SQLite file."""
    from ..demo import run_demo

    sys.exit(run_demo(db_path, job_count))


cli.add_command(status)
cli.add_command(queues)
cli.add_command(cron)
cli.add_command(jobs)
cli.add_command(dlq)
cli.add_command(dashboard)
cli.add_command(workflows)


def main() -> None:
    cli(prog_name="errands")
