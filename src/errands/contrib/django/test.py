"""Testing Django projects that use errands.

- ``TEST_RUNNER = "errands.contrib.django.test.DiscoverRunner"``: Django's runner, closing
  errands' own connections before the test databases are dropped (PostgreSQL refuses to
  drop a database other sessions use). With pytest-django, call
  :func:`errands.contrib.django.close_apps` in a session fixture's teardown instead.
- :func:`run_worker`: a worker in a background thread, to run tasks inside a test. It
  sees committed jobs only, so such tests are ``TransactionTestCase``s, and
- :class:`TransactionTestCase` empties errands' tables after each test, as Django's
  flushes the models' tables (or call :func:`clear_jobs`).
"""

from __future__ import annotations

from typing import Any

from django.db import connections
from django.test import TransactionTestCase as DjangoTransactionTestCase
from django.test.runner import DiscoverRunner as DjangoDiscoverRunner

from .._embedded import EmbeddedWorker
from .app import backend_params, close_apps, get_app, serving_queues
from .migrate import errands_databases

# Every errands table but errands_migrations, children before parents (a test compares
# this list with a migrated store's tables: workflows, signals, fair usage and weights and
# dead-hook records were left out, and carried over into the next test).
TABLES = (
    "errands_steps",
    "errands_signals",
    "errands_dead_hooks",
    "errands_rate_log",
    "errands_workflow_edges",
    "errands_workflow_members",
    "errands_workflow_pending",
    "errands_jobs",
    "errands_workflows",
    "errands_audit",
    "errands_workers",
    "errands_leaders",
    "errands_queues",
    "errands_job_limits",
    "errands_cron",
    "errands_fair_usage",
    "errands_fair_weights",
)


class DiscoverRunner(DjangoDiscoverRunner):
    def teardown_databases(self, old_config: Any, **kwargs: Any) -> None:
        close_apps()
        super().teardown_databases(old_config, **kwargs)


def run_worker(alias: str = "default", **options: Any) -> EmbeddedWorker:
    """A worker for task backend ``alias`` in a background thread, started; a context
    manager that stops it gracefully::

        with run_worker():
            result = charge_order.enqueue(order.id)
            ...

    Options are the worker's (``queues``, ``concurrency``, ``grace``...); by default it
    serves the backend's QUEUES and polls every 50 ms.
    """
    params = backend_params(alias)
    app = get_app(alias)
    app.autodiscover()
    options.setdefault("queues", serving_queues(params, app))
    options.setdefault("poll_interval", 0.05)
    options.setdefault("maintenance_tick", 0.2)
    options.setdefault("grace", 5.0)
    return EmbeddedWorker(app, **options).start()


def clear_jobs() -> None:
    """Delete every job (and step, audit entry, worker, queue setting) errands stores in
    Django's databases. Run it with no worker running."""
    from ...backends.postgres.config import parse_postgres_url

    for database, urls in errands_databases().items():
        connection = connections[database]
        with connection.cursor() as cursor:
            for url in urls:
                if url.startswith("sqlite"):
                    for table in TABLES:
                        cursor.execute(f"DELETE FROM {table}")
                else:
                    schema = parse_postgres_url(url).schema
                    cursor.execute(
                        "TRUNCATE " + ", ".join(f'"{schema}".{table}' for table in TABLES)
                    )


class TransactionTestCase(DjangoTransactionTestCase):
    """Django's ``TransactionTestCase`` that also empties errands' tables after each test
    (Django flushes only its models' tables)."""

    def _post_teardown(self) -> None:
        try:
            clear_jobs()
        finally:
            super()._post_teardown()
