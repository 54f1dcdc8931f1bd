"""``python manage.py errands_worker``: run the jobs of an ErrandsBackend.

The same worker as ``errands worker`` (leases, heartbeats, retries, dead-letter queue,
graceful stop on SIGTERM/SIGINT within ``--grace``), with the project's Django settings:
it imports every installed app's ``tasks`` module and runs Django's ``@task`` functions
and any native ``@get_app().job`` functions.

Its counts (``-c``, ``--express``, ``--prefetch``) are held to the bounds ``errands
worker`` holds them to (the same check), before anything is opened. It runs one worker
process: ``errands worker --processes N`` starts its children by running its own command
line again, which a management command cannot do faithfully (``manage.py``, ``django-admin
--settings ...``, ``--pythonpath`` or ``call_command()`` from code). For more processes,
run more of it under the process manager (systemd, supervisord, Kubernetes replicas), on
one host or many, or raise ``-c``; ``--processes`` other than 1 is refused saying so.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from errands.errors import ConfigurationError, ErrandsError, SchemaOutdated

log = logging.getLogger("errands.django")


PROCESSES_REFUSED = (
    "--processes {n}: this command runs one worker process (errands worker --processes N "
    "starts its children from its own command line, which a Django management command "
    "cannot repeat faithfully); run {n} `manage.py errands_worker` processes under your "
    "process manager (systemd, supervisord, Kubernetes replicas) instead, or raise -c"
)


class Command(BaseCommand):
    help = (
        "Run an errands worker for Django's tasks (until SIGTERM or SIGINT): one worker "
        "process; for more, run more of it under your process manager, or raise -c."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        from errands.worker.worker import CONCURRENCY_MAX, PREFETCH_MAX

        parser.add_argument(
            "--backend",
            default="default",
            help="the task backend alias in TASKS (default: default)",
        )
        parser.add_argument(
            "-q",
            "--queues",
            help="queues to serve: emails,payments or emails=10,payments=2 "
            "(default: the backend's QUEUES)",
        )
        parser.add_argument(
            "-c",
            "--concurrency",
            type=int,
            help=f"jobs at once (default 10; at most {CONCURRENCY_MAX:,})",
        )
        parser.add_argument(
            "--prefetch",
            type=int,
            help="jobs claimed beyond -c while handlers are quick, waiting for a free thread "
            f"(default: 4 x -c, and 16 x -c for a fair queue; 0: off; at most {PREFETCH_MAX:,})",
        )
        parser.add_argument(
            "--processes",
            type=int,
            default=1,
            help="only 1: this command runs one worker process; for more, run more of it "
            "under your process manager (systemd, supervisord, Kubernetes replicas), or "
            "raise -c",
        )
        parser.add_argument(
            "--grace",
            type=_seconds,
            default=30.0,
            help="seconds in-flight jobs get to finish on SIGTERM (default 30)",
        )
        parser.add_argument(
            "--poll-interval",
            type=_seconds,
            default=1.0,
            help="seconds between claims when the queues are idle (default 1)",
        )
        parser.add_argument(
            "--express",
            type=int,
            help="handler threads beyond -c for fair queues' keys with nothing running, "
            "used only while every slot is busy (default with a fair queue: -c / 2; 0: off)",
        )
        parser.add_argument(
            "--no-maintenance",
            action="store_true",
            help="never take the leader duties (rescue, prune)",
        )
        parser.add_argument(
            "--maintenance-tick",
            type=_seconds,
            help="seconds between maintenance rounds (default: the lease / 4, at most 1)",
        )
        parser.add_argument(
            "--log-format",
            choices=["text", "json"],
            help="take over the root logger with errands' text or JSON lines (default: keep "
            "Django's LOGGING)",
        )
        parser.add_argument(
            "--log-level",
            choices=["debug", "info", "warning", "error"],
            default="info",
            help="with --log-format: the root level (default info)",
        )
        parser.add_argument(
            "--metrics-port",
            type=int,
            help="serve Prometheus metrics at http://ADDR:PORT/metrics (errands[metrics])",
        )
        parser.add_argument(
            "--metrics-addr", default="0.0.0.0", help="address of --metrics-port (0.0.0.0)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        from errands.observability.logcontext import configure_logging, install_record_factory
        from errands.worker.collector import use_worker_gc
        from errands.worker.switching import use_switch_interval
        from errands.worker.worker import check_counts

        from ...app import backend_params, get_app, serving_queues

        if options["processes"] != 1:
            raise CommandError(PROCESSES_REFUSED.format(n=options["processes"]))
        if options["grace"] < 0 or options["poll_interval"] <= 0:
            raise CommandError("--grace must be >= 0 and --poll-interval > 0")
        spec = options["queues"]
        if spec is not None and not spec.replace(",", "").strip():
            # as `errands worker -q ""`: an empty value is not a missing one
            raise CommandError(
                f"--queues {spec!r} names no queue (an unset $QUEUE?): name them, as in "
                "--queues emails,payments, or leave --queues out to serve the backend's QUEUES"
            )
        try:
            # errands worker's own check (least and most of each), before anything opens:
            # only the lower bounds were checked here, and --concurrency 100000 imported
            # the tasks, served the metrics and read the schema before the worker refused
            check_counts(spec, options["concurrency"], options["express"], options["prefetch"])
        except ConfigurationError as exc:
            raise CommandError(str(exc)) from None
        alias = options["backend"]
        try:
            params = backend_params(alias)
        except Exception as exc:
            raise CommandError(str(exc)) from None
        use_switch_interval()  # this process is the worker's own (errands worker's default)
        if options["log_format"]:
            configure_logging(options["log_format"], options["log_level"])
        else:
            install_record_factory()  # job id, name, queue and attempt on every record
        app = get_app(alias)
        names = app.autodiscover()
        queues = serving_queues(params, app) if spec is None else spec
        if options["metrics_port"] is not None:
            from errands.observability.metrics import serve_metrics

            try:
                serve_metrics(app, options["metrics_port"], options["metrics_addr"])
            except OSError as exc:
                raise CommandError(
                    f"cannot serve metrics on {options['metrics_addr']}:"
                    f"{options['metrics_port']}: {exc.strerror or exc}"
                ) from None
        try:
            app.backend.schema_check()
            worker = app.worker(
                queues=queues,
                concurrency=options["concurrency"],
                prefetch=options["prefetch"],
                express=options["express"],
                grace=options["grace"],
                poll_interval=options["poll_interval"],
                maintenance=not options["no_maintenance"],
                maintenance_tick=options["maintenance_tick"],
            )
            self.stdout.write(
                f"errands worker {worker.id} on {_display(app)}: queues "
                f"{', '.join(worker.queue_limits)}; {len(names)} task(s) found"
            )
            self.stdout.flush()
            use_worker_gc()  # the app imported, the worker built: see worker/collector.py
            code = worker.run()
        except SchemaOutdated as exc:
            detail = str(exc).split("; run:")[0]
            raise CommandError(
                f"errands' tables in Django's database {app.database!r} are missing or "
                f"outdated ({detail}); run: python manage.py migrate"
            ) from None
        except ErrandsError as exc:
            raise CommandError(str(exc)) from None
        finally:
            app.close()
        if worker.stuck_threads():
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        if code:
            sys.exit(code)


def _seconds(text: str) -> float:
    """An option's seconds. ``float()`` reads "nan" and "inf" too, which the range
    checks let through (NaN compares false with either bound): a usage error instead,
    worded as the errands CLI's."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number; give seconds, such as 30"
        ) from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a finite number; give seconds, such as 30"
        )
    return value


def _display(app: Any) -> str:
    url = str(app.url)
    if "@" in url and url.startswith("postgres"):
        scheme, rest = url.split("://", 1)
        credentials, host = rest.split("@", 1)
        return f"{scheme}://{credentials.split(':', 1)[0]}@{host}"
    return url
