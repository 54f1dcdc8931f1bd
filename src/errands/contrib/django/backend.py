"""``ErrandsBackend``: Django's Tasks framework on errands' engine.

::

    TASKS = {
        "default": {
            "BACKEND": "errands.contrib.django.ErrandsBackend",
            "QUEUES": ["default", "payments"],
            "OPTIONS": {"RETRIES": 3, "QUEUE_LIMITS": {"payments": {"limit": 5}}},
        }
    }

Jobs live in Django's own database (``OPTIONS["DATABASE"]``, default ``"default"``), in
errands' tables created by ``manage.py migrate``. ``enqueue`` writes through Django's
connection, inside a savepoint of the caller's ``transaction.atomic()`` when there is
one: the job commits or rolls back with the caller's own rows, so no ``on_commit`` is
needed. ``python manage.py errands_worker`` runs them.
"""

from __future__ import annotations

from datetime import UTC
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core import checks
from django.db import connections, transaction
from django.utils import timezone

from ...definition import BoundJob, EnqueueOptions, check_name
from ...errors import ConfigurationError
from ._compat import (
    BaseTaskBackend,
    InvalidTask,
    Task,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
    task_enqueued,
)
from .app import (
    DjangoApp,
    app_for,
    check_options,
    django_time,
    send_signal,
    sqlite_path,
    translate_missing_tables,
    vendor_of,
)
from .task import ErrandsTask


class ErrandsBackend(BaseTaskBackend):
    task_class = ErrandsTask

    supports_defer = True  # run_after: a scheduled job, due at that time (database clock)
    supports_async_task = True  # async def tasks run on the worker's event loop
    supports_get_result = True  # results are rows in Django's database
    supports_priority = True  # higher first within a queue, as Django specifies

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        check_options(alias, self.options)
        self.params = params
        self.database = str(self.options.get("DATABASE") or "default")

    @property
    def app(self) -> DjangoApp:
        """The errands App behind this backend (the full errands API)."""
        return app_for(self.alias, self.params)

    # -- validation ------------------------------------------------------------------------
    def validate_task(self, task: Task) -> None:
        super().validate_task(task)
        try:
            check_name("queue", task.queue_name)
            # Registering builds the errands definition: bad errands options fail here,
            # when the @task decorator runs, not at the first enqueue.
            self.app.register_task(task)
        except ConfigurationError as exc:
            raise InvalidTask(str(exc)) from None

    # -- enqueue -----------------------------------------------------------------------------
    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        """Store the task as an errands job, in the caller's transaction if any."""
        self.validate_task(task)
        app = self.app
        definition = app.register_task(task)
        result = TaskResult(  # normalises args/kwargs to JSON types (TypeError otherwise)
            task=task,
            id="",
            status=TaskResultStatus.READY,
            enqueued_at=None,
            started_at=None,
            finished_at=None,
            last_attempted_at=None,
            args=args,
            kwargs=kwargs,
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )
        arguments = definition.arguments(result.args, result.kwargs)
        key_template = getattr(task, "key", None) or definition.key_template
        run_after = task.run_after
        if run_after is not None and timezone.is_naive(run_after):
            run_after = timezone.make_aware(run_after)
        unique_for = getattr(task, "unique_for", None)
        if key_template is None and (unique_for or definition.unique_for) is not None:
            raise ConfigurationError(
                f"task {task.module_path} is unique_for a period, which applies to a key: "
                'give each enqueue one (task.using(key="...").enqueue(...)) or the task a '
                'key template (@task(key="order:{order_id}", unique_for=...))'
            )
        request = definition.request(
            (),
            {"args": result.args, "kwargs": result.kwargs},
            EnqueueOptions(
                key=definition.format_key(key_template, arguments) if key_template else None,
                run_at=run_after,
                priority=task.priority,
                queue=task.queue_name,
                unique_for=unique_for,
            ),
        )
        request.meta["django"] = {"backend": self.alias}
        if run_after is not None:
            request.meta["django"]["run_after"] = run_after.astimezone(UTC).timestamp()
        connection = connections[self.database]
        with translate_missing_tables(self.database), transaction.atomic(using=self.database):
            # a savepoint inside the caller's atomic(): a failed insert leaves it usable
            (handle,) = app.enqueue_many(
                [BoundJob(definition, request)], conn=connection.connection
            )
            if handle.deduplicated:  # the key's job already exists: that is the result
                return self.get_result(str(handle.id))
            # The stored row's time (the database clock), so that the result equals what
            # get_result() and refresh() give for it later.
            stored = app.read_job(handle.id)
        object.__setattr__(result, "id", str(handle.id))
        enqueued_at = None if stored is None else django_time(stored.inserted_at)
        object.__setattr__(result, "enqueued_at", enqueued_at or timezone.now())
        transaction.on_commit(
            lambda: send_signal(task_enqueued, type(self), result), using=self.database
        )
        return result

    async def aenqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        """``enqueue`` in Django's thread for the database connection (so it joins the
        transaction of that thread's ``atomic()``)."""
        return await sync_to_async(self.enqueue, thread_sensitive=True)(
            task=task, args=args, kwargs=kwargs
        )

    # -- results -----------------------------------------------------------------------------
    def get_result(self, result_id: str) -> TaskResult:
        """The job's current state as a ``TaskResult`` (read through Django's connection)."""
        try:
            job_id = int(result_id)
        except (TypeError, ValueError):
            raise TaskResultDoesNotExist(result_id) from None
        job = self.app.read_job(job_id)
        if job is None:
            raise TaskResultDoesNotExist(result_id)
        return self.app.task_result(job, self.alias)

    async def aget_result(self, result_id: str) -> TaskResult:
        return await sync_to_async(self.get_result, thread_sensitive=True)(result_id=result_id)

    # -- system checks -----------------------------------------------------------------------
    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        messages: list[checks.CheckMessage] = []
        where = f"TASKS[{self.alias!r}]"
        if self.database not in settings.DATABASES:
            return [
                checks.Error(
                    f"{where}: OPTIONS['DATABASE'] is {self.database!r}, not in DATABASES",
                    hint="Name the Django database that holds errands' tables.",
                    id="errands.E001",
                )
            ]
        try:
            vendor = vendor_of(self.database)
        except Exception as exc:
            return [checks.Error(f"{where}: {exc}", id="errands.E002")]
        for queue in sorted(self.queues):
            try:
                check_name("queue", queue)
            except ConfigurationError as exc:
                messages.append(checks.Error(f"{where}: QUEUES: {exc}", id="errands.E003"))
        conf = settings.DATABASES[self.database]
        if vendor == "sqlite" and not self.options.get("URL"):
            if sqlite_path(conf.get("NAME")) is None:
                messages.append(
                    checks.Error(
                        f"{where}: DATABASES[{self.database!r}] is an in-memory SQLite database",
                        hint="errands needs a file: an in-memory database is private to one "
                        "connection.",
                        id="errands.E004",
                    )
                )
            elif sqlite_path((conf.get("TEST") or {}).get("NAME")) is None:
                messages.append(
                    checks.Warning(
                        f"{where}: tests on DATABASES[{self.database!r}] use an in-memory "
                        "SQLite database, which errands' worker cannot share",
                        hint=f"Set DATABASES[{self.database!r}]['TEST']['NAME'] to a file "
                        "path to run tasks in tests.",
                        id="errands.W001",
                    )
                )
        if vendor == "postgresql":
            try:
                import psycopg  # noqa: F401
                import psycopg_pool  # noqa: F401
            except ImportError:
                messages.append(
                    checks.Error(
                        f"{where}: errands on PostgreSQL needs psycopg 3 and psycopg_pool",
                        hint="pip install 'errands[postgres]'",
                        id="errands.E005",
                    )
                )
        return messages


__all__ = ["ErrandsBackend"]
