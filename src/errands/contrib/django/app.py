"""The errands App behind a Django task backend: where it stores jobs, how a Django task
becomes an errands job definition, and how a job row reads back as a ``TaskResult``.

One ``DjangoApp`` per task backend alias, shared by every thread (Django builds a backend
instance per thread). Its database URL is derived from Django's ``DATABASES`` each time
it is needed, so it follows the test runner's switch to the test database.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import importlib
import inspect
import json
import logging
import os
import re
import string
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote, urlencode

from django.conf import settings
from django.core.cache import caches
from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, close_old_connections
from django.utils import timezone
from django.utils.module_loading import import_string

from ...app import App
from ...backends import Backend, open_backend
from ...context import Context
from ...definition import JobDefinition
from ...errors import ConfigurationError, InvalidPayload, SchemaOutdated
from ...forking import fresh_lock_at_fork
from ...jobs import Job, JobError, JobRow, JobState
from ...outcomes import Permanent
from ._compat import (
    SUCCESSFUL,
    InvalidTask,
    Task,
    TaskContext,
    TaskError,
    TaskResult,
    TaskResultStatus,
    normalize_json,
    task_backends,
    task_finished,
    task_started,
)

log = logging.getLogger("errands.django")

BACKEND_PATH = "errands.contrib.django.ErrandsBackend"
_PLACEHOLDER_URL = "django:"

# OPTIONS an ErrandsBackend understands (docs/integrations.md describes each).
OPTION_NAMES = frozenset(
    {
        "DATABASE",
        "URL",
        "URL_PARAMS",
        "RETRIES",
        "TIMEOUT",
        "BACKOFF",
        "LEASE",
        "RETENTION",
        "POISON_AFTER",
        "MAX_PAYLOAD_BYTES",
        "MAX_RESULT_BYTES",
        "QUEUE_LIMITS",
        "TASK_MODULES",
    }
)

STATUS_FOR_STATE = {
    JobState.SCHEDULED: TaskResultStatus.READY,
    JobState.AVAILABLE: TaskResultStatus.READY,
    JobState.RETRYABLE: TaskResultStatus.READY,  # "ready to be executed again"
    JobState.RUNNING: TaskResultStatus.RUNNING,
    JobState.COMPLETED: SUCCESSFUL,
    JobState.DEAD: TaskResultStatus.FAILED,
    JobState.CANCELLED: TaskResultStatus.FAILED,
    JobState.DISCARDED: TaskResultStatus.FAILED,
}

# libpq connection options Django passes through OPTIONS that errands' URL must carry too.
LIBPQ_OPTIONS = (
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "sslpassword",
    "sslcrl",
    "connect_timeout",
    "application_name",
    "options",
    "target_session_attrs",
    "service",
    "passfile",
    "gssencmode",
    "channel_binding",
)

_CLASS_PATH = re.compile(r"^[A-Za-z_][\w.]*$")


class WorkerLost(Exception):
    """The worker running an attempt died or lost its lease; errands rescued the job.

    The ``exception_class`` of the ``TaskError`` recorded for such an attempt."""


# -- where the jobs live ----------------------------------------------------------------------
def vendor_of(database: str) -> str:
    try:
        engine = str(settings.DATABASES[database].get("ENGINE", ""))
    except KeyError:
        raise ImproperlyConfigured(
            f"errands: OPTIONS['DATABASE'] is {database!r}, which is not in DATABASES"
        ) from None
    if "sqlite" in engine or "spatialite" in engine:
        return "sqlite"
    if "postgres" in engine or "postgis" in engine:
        return "postgresql"
    raise ImproperlyConfigured(
        f"errands stores jobs in SQLite or PostgreSQL; DATABASES[{database!r}] uses {engine!r}. "
        "Point the backend's OPTIONS['DATABASE'] at a SQLite or PostgreSQL database"
    )


def sqlite_path(name: Any) -> str | None:
    """The file behind a Django SQLite NAME, or None for an in-memory database."""
    text = str(name or "")
    if text.startswith("file:"):
        text, _, query = text[5:].partition("?")
        if "mode=memory" in query:
            return None
    if text in ("", ":memory:"):
        return None
    return os.path.abspath(text)


def database_url(database: str, params: Mapping[str, Any] | None = None) -> str:
    """The errands URL of Django's database ``database`` (same file, same server)."""
    vendor = vendor_of(database)
    conf = settings.DATABASES[database]
    extra = {str(k): str(v) for k, v in (params or {}).items()}
    if vendor == "sqlite":
        path = sqlite_path(conf.get("NAME"))
        if path is None:
            raise ImproperlyConfigured(
                f"errands cannot share the in-memory SQLite database of DATABASES[{database!r}] "
                "(an in-memory database is private to one connection): use a file. In tests, "
                f"set DATABASES[{database!r}]['TEST']['NAME'] to a file path"
            )
        suffix = f"?{urlencode(extra)}" if extra else ""
        return f"sqlite:///{path}{suffix}"
    user, password = conf.get("USER") or "", conf.get("PASSWORD") or ""
    host, port = str(conf.get("HOST") or ""), str(conf.get("PORT") or "")
    options = conf.get("OPTIONS") or {}
    query = {k: str(options[k]) for k in LIBPQ_OPTIONS if options.get(k) is not None}
    if host.startswith("/"):  # a Unix socket directory
        query["host"], host = host, ""
    elif ":" in host:  # IPv6
        host = f"[{host}]"
    netloc = ""
    if user:
        netloc = quote(str(user), safe="") + (
            f":{quote(str(password), safe='')}" if password else ""
        )
        netloc += "@"
    netloc += host + (f":{port}" if port else "")
    query.update(extra)
    name = quote(str(conf.get("NAME") or ""), safe="")
    return f"postgresql://{netloc}/{name}" + (f"?{urlencode(query)}" if query else "")


# -- a Django task as an errands job ----------------------------------------------------------
def _seconds(value: float | timedelta | None) -> float | None:
    if value is None:
        return None
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


class ResultNotJSON(Permanent):
    """A task returned a value that is not JSON: a permanent failure (the same value comes
    back on every retry). Raised from the framework's own error (a ``TypeError``), which
    Django's ``TaskError.exception_class`` shows, as Django's built-in backends do."""


def json_result(task: Task, value: Any) -> Any:
    """A task's return value as Django stores it (JSON types), or a permanent failure."""
    try:
        return normalize_json(value)
    except (TypeError, ValueError) as exc:
        raise ResultNotJSON(
            f"{task.module_path} returned a {type(value).__name__}, which is not JSON "
            f"({exc}); Django tasks must return JSON-serialisable values"
        ) from exc


class TaskDefinition(JobDefinition[Any, Any]):
    """The errands job definition of one Django task (named by the task's module path).

    The stored payload is ``{"args": [...], "kwargs": {...}}``, exactly what Django's
    ``TaskResult`` holds; ``key`` and ``concurrency_key`` templates name the task's own
    parameters.
    """

    def __init__(self, app: DjangoApp, task: Task, defaults: Mapping[str, Any]) -> None:
        self.task = task
        signature = inspect.signature(task.func)
        parameters = list(signature.parameters.values())
        if task.takes_context:
            parameters = parameters[1:]
        self.task_signature = signature.replace(parameters=parameters)
        self.parameter_names = tuple(p.name for p in parameters)

        def option(name: str, default_key: str | None = None, default: Any = None) -> Any:
            value = getattr(task, name, None)
            if value is None and default_key is not None:
                value = defaults.get(default_key)
            return default if value is None else value

        self.key_template: str | None = option("key")
        if self.key_template is not None:
            self._template_fields("key", self.key_template)
        super().__init__(
            app,
            _runner(app, task),
            name=task.module_path,
            queue=task.queue_name,
            priority=task.priority,
            retries=option("retries", "RETRIES", 3),
            backoff=option("backoff", "BACKOFF"),
            timeout=option("timeout", "TIMEOUT"),
            lease=option("lease"),
            permanent=option("permanent", default=()),
            sensitive=(),
            unique_for=option("unique_for"),
            concurrency_key=option("concurrency_key"),
            concurrency_limit=option("concurrency_limit"),
            rate=option("rate"),
        )

    def _template_fields(self, what: str, template: str) -> None:
        try:
            fields = {f for _, f, _, _ in string.Formatter().parse(template) if f}
        except ValueError as exc:
            raise ConfigurationError(
                f"task {self.task.module_path}: {what}={template!r} is not a valid template: "
                f"{exc} (write {{{{ and }}}} for literal braces)"
            ) from None
        unknown = {f.split(".")[0].split("[")[0] for f in fields} - set(self.parameter_names)
        if unknown:
            raise ConfigurationError(
                f"task {self.task.module_path}: {what}={template!r} names {sorted(unknown)}, "
                f"which are not parameters; parameters are {list(self.parameter_names)}"
            )

    def _check_key(self, template: str | None, limit: int | None) -> tuple[str | None, int | None]:
        if template is not None:
            self._template_fields("concurrency_key", template)
            limit = 1 if limit is None else limit
            if not isinstance(limit, int) or limit < 1:
                raise ConfigurationError(
                    f"task {self.task.module_path}: concurrency_limit must be an int >= 1"
                )
            return template, limit
        return super()._check_key(template, limit)

    def arguments(self, args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call bound to the task's parameters (defaults applied); InvalidPayload when
        the arguments do not fit its signature, so nothing is stored."""
        try:
            bound = self.task_signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise InvalidPayload(f"{self.name}: {exc}") from None
        bound.apply_defaults()
        return dict(bound.arguments)

    def format_key(self, template: str, arguments: Mapping[str, Any]) -> str:
        """The idempotency key of one enqueue, built and checked as errands builds every
        key (``JobDefinition.build_key``)."""
        return self.build_key("key", template, arguments)

    def _template_values(self, args_json: str) -> dict[str, Any]:
        """What a key template (concurrency_key) reads: the task's own parameters (the
        stored payload is the call's ``args``/``kwargs``, bound to the task's signature,
        defaults applied)."""
        stored = json.loads(args_json)
        return self.arguments(stored.get("args", []), stored.get("kwargs", {}))


def _runner(app: DjangoApp, task: Task) -> Callable[..., Any]:
    """The errands handler of a Django task: calls the task function with the stored
    arguments, sending ``task_started`` first (the worker sends ``task_finished`` once the
    outcome is written)."""
    if inspect.iscoroutinefunction(task.func):
        from asgiref.sync import sync_to_async

        # The ORM from an async task runs on asgiref's thread for thread-sensitive code
        # (sync_to_async): its connections are checked there, as a sync task's are on its
        # thread (one past CONN_MAX_AGE, or broken by a database restart, stayed broken
        # for every later async task).
        close_connections = sync_to_async(close_old_connections, thread_sensitive=True)

        async def run_task_async(ctx: Context, args: list[Any], kwargs: dict[str, Any]) -> Any:
            await close_connections()
            try:
                running = await asyncio.to_thread(app.running_result, task, ctx)
                if task.takes_context:
                    value = await task.func(TaskContext(task_result=running), *args, **kwargs)
                else:
                    value = await task.func(*args, **kwargs)
                return json_result(task, value)
            except BaseException as exc:
                app.failures.remember(ctx.job_id, exc)
                raise
            finally:
                await close_connections()
                await asyncio.to_thread(caches.close_all)  # (in this task's context)

        return run_task_async

    def run_task(ctx: Context, args: list[Any], kwargs: dict[str, Any]) -> Any:
        # A worker thread is a long-lived Django thread: treat every job like a request.
        close_old_connections()
        try:
            running = app.running_result(task, ctx)
            if task.takes_context:
                value = task.func(TaskContext(task_result=running), *args, **kwargs)
            else:
                value = task.func(*args, **kwargs)
            return json_result(task, value)
        except BaseException as exc:
            app.failures.remember(ctx.job_id, exc)
            raise
        finally:
            close_old_connections()
            # As at a request's end (Django's close_caches): each job runs in a context
            # of its own, where the caches it opened (a Redis client and its connections)
            # are left at its end, closed when collected if not here.
            caches.close_all()

    return run_task


class TaskFailed(Exception):
    """A task's failure, rebuilt from its recorded error when the exception itself is not
    at hand (it was raised in a child process): the exception Django's ``task_finished``
    log line shows when the recorded class cannot be rebuilt."""


class Failures:
    """The last exception each job's task raised in this process, kept until the job's
    ``task_finished`` is sent, so the signal goes out inside an exception handler with it
    (as Django's own backends send it), and Django's log line carries its traceback."""

    LIMIT = 1000  # jobs: a failure whose signal never comes is dropped, oldest first

    def __init__(self) -> None:
        self._by_job: dict[int, BaseException] = {}
        self._lock = threading.Lock()

    def remember(self, job_id: int, exc: BaseException) -> None:
        with self._lock:
            self._by_job.pop(job_id, None)
            self._by_job[job_id] = exc
            while len(self._by_job) > self.LIMIT:
                self._by_job.pop(next(iter(self._by_job)))

    def take(self, job: Job) -> BaseException | None:
        """The exception of the job's last failed attempt: the one raised here, else one
        rebuilt from its recorded error; None when no attempt failed."""
        with self._lock:
            found = self._by_job.pop(job.id, None)
        if found is not None or job.last_error is None:
            return found
        error = job.last_error
        try:
            cls = import_string(exception_class_path(error))
            if isinstance(cls, type) and issubclass(cls, BaseException):
                return cls(error.message)
        except Exception:
            pass  # a class that cannot be imported or built from one message
        return TaskFailed(f"{error.type}: {error.message}")


class _Registry(dict[str, JobDefinition[Any, Any]]):
    """The App's job registry; a name it does not hold is looked up as a Django task's
    module path (``shop.tasks.charge_order``), so a worker runs every task of the
    project even when no code imported its module yet."""

    def __init__(self, resolve: Callable[[str], JobDefinition[Any, Any] | None]) -> None:
        super().__init__()
        self._resolve = resolve

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        found = super().get(name)
        if found is None:
            found = self._resolve(name)
        return default if found is None else found


# The events Django's signals are sent for (DjangoApp._bridge_signals); the rest are not
# delivered to the bridge (each job's errands.job.started took a place on the events lane).
_BRIDGED = frozenset(
    {"errands.job.completed", "errands.job.dead", "errands.job.cancelled", "errands.job.rescued"}
)


class _Bridge:
    """The signal bridge as a subscriber that says which events it wants."""

    def __init__(self, deliver: Callable[[Any], None]) -> None:
        self.deliver = deliver

    def __call__(self, event: Any) -> None:
        self.deliver(event)

    @staticmethod
    def wants(name: str) -> bool:
        return name in _BRIDGED


class DjangoApp(App):
    """An errands App whose jobs live in one of Django's databases."""

    def __init__(self, alias: str, options: Mapping[str, Any]) -> None:
        self.task_backend_alias = alias
        self.options = dict(options)
        self.database = str(self.options.get("DATABASE") or DEFAULT_DB_ALIAS)
        self._explicit_url: str | None = self.options.get("URL")
        self._url_params: Mapping[str, Any] = self.options.get("URL_PARAMS") or {}
        self._opened_url: str | None = None
        self._unresolvable: set[str] = set()
        self._register_lock = threading.RLock()
        self.failures = Failures()
        kwargs: dict[str, Any] = {}
        for option, argument in (
            ("LEASE", "lease"),
            ("RETENTION", "retention"),
            ("POISON_AFTER", "poison_after"),
            ("MAX_PAYLOAD_BYTES", "max_payload_bytes"),
            ("MAX_RESULT_BYTES", "max_result_bytes"),
        ):
            if self.options.get(option) is not None:
                kwargs[argument] = self.options[option]
        super().__init__(_PLACEHOLDER_URL, **kwargs)
        self.registry = _Registry(self._resolve)
        for queue, limits in (self.options.get("QUEUE_LIMITS") or {}).items():
            self.queue(queue, **{str(k).lower(): v for k, v in dict(limits).items()})
        self.events.subscribe(_Bridge(self._bridge_signals))

    # -- the store ------------------------------------------------------------------------
    @property  # type: ignore[override]
    def url(self) -> str:
        if self._explicit_url:
            return self._explicit_url
        return database_url(self.database, self._url_params)

    @url.setter
    def url(self, value: str) -> None:
        if value != _PLACEHOLDER_URL:
            self._explicit_url = value

    @property
    def vendor(self) -> str:
        return vendor_of(self.database)

    @property
    def backend(self) -> Backend:
        """errands' own connections to Django's database, for the worker and the admin API
        (enqueue and get_result run their statements on Django's connection). Opened
        without applying migrations: ``manage.py migrate`` does that. Reopened when the URL
        changes (the test runner switches to the test database)."""
        url = self.url
        backend = self._backend
        if backend is not None and self._opened_url == url:
            return backend
        with self._backend_lock:
            if self._backend is not None and self._opened_url != url:
                self._backend.close()
                self._backend = None
            if self._backend is None:
                self._backend = open_backend(url, auto_migrate=False)
                self._opened_url = url
            return self._backend

    def migrate(self) -> list[str]:
        return self.backend.migrate()

    # -- tasks ----------------------------------------------------------------------------
    def register_task(self, task: Task) -> TaskDefinition:
        """The job definition of ``task`` (registered on first use, by module path)."""
        name = task.module_path
        found = dict.get(self.registry, name)
        if isinstance(found, TaskDefinition) and found.task.func is task.func:
            return found
        with self._register_lock:
            found = dict.get(self.registry, name)
            if isinstance(found, TaskDefinition) and found.task.func is task.func:
                return found
            if found is not None and not isinstance(found, TaskDefinition):
                raise ConfigurationError(
                    f"an errands job is already registered as {name!r}; rename one of them"
                )
            definition = TaskDefinition(self, task, self.options)
            with self._registry_lock:
                self._registry_put(name, definition)
            self._unresolvable.discard(name)
            return definition

    def _resolve(self, name: str) -> JobDefinition[Any, Any] | None:
        if name in self._unresolvable or "." not in name:
            return None
        try:
            found = import_string(name)
        except Exception as exc:  # a module that does not import is a job we cannot run
            log.warning("no Django task at %r (%s: %s)", name, type(exc).__name__, exc)
            self._unresolvable.add(name)
            return None
        if not isinstance(found, Task):
            self._unresolvable.add(name)
            return None
        definition = dict.get(self.registry, name)  # importing it may have registered it
        return definition if definition is not None else self.register_task(found)

    def task_definition(self, name: str) -> TaskDefinition | None:
        found = self.registry.get(name)
        return found if isinstance(found, TaskDefinition) else None

    def autodiscover(self) -> list[str]:
        """Import every installed app's ``tasks`` module and OPTIONS['TASK_MODULES'] (what
        the worker does before it starts); returns the task names registered."""
        from django.utils.module_loading import autodiscover_modules

        autodiscover_modules("tasks")
        for module in self.options.get("TASK_MODULES") or ():
            importlib.import_module(module)
        return sorted(n for n, d in self.registry.items() if isinstance(d, TaskDefinition))

    # -- reading through Django's connection -------------------------------------------------
    def read_job(self, job_id: int) -> Job | None:
        """One job read through Django's connection, so inside ``transaction.atomic()`` it
        sees what this transaction enqueued (and in Django's ``TestCase`` too)."""
        from django.db import connections, transaction

        connection = connections[self.database]
        backend = self.backend

        def read() -> JobRow | None:
            with translate_missing_tables(self.database):
                connection.ensure_connection()
                return backend.job_get(job_id, conn=connection.connection)

        if connection.in_atomic_block:
            with transaction.atomic(using=self.database):  # a failure rolls back a savepoint only
                row = read()
        else:
            row = read()
        return None if row is None else row.to_job()

    # -- results ----------------------------------------------------------------------------
    def task_result(self, job: Job, backend_alias: str | None = None) -> TaskResult:
        """A job row as Django's ``TaskResult``."""
        from ._compat import TaskResultDoesNotExist

        definition = self.task_definition(job.name)
        if definition is None:
            raise TaskResultDoesNotExist(f"job {job.id} ({job.name}) is not a Django task")
        django_meta = job.meta.get("django") if isinstance(job.meta, dict) else None
        django_meta = django_meta if isinstance(django_meta, dict) else {}
        task = definition.task
        changes: dict[str, Any] = {}
        if job.queue != task.queue_name:
            changes["queue_name"] = job.queue
        if job.priority != task.priority and -100 <= job.priority <= 100:
            changes["priority"] = job.priority
        run_after = django_meta.get("run_after")
        if isinstance(run_after, int | float):
            changes["run_after"] = django_time(datetime.fromtimestamp(run_after, tz=UTC))
        if changes:
            # a queue no longer in QUEUES shows the task's own (the job row keeps the truth)
            with contextlib.suppress(InvalidTask):
                task = task.using(**changes)
        args = job.args if isinstance(job.args, dict) else {}
        status = STATUS_FOR_STATE[job.state]
        finished = job.state.is_terminal
        result = TaskResult(
            task=task,
            id=str(job.id),
            status=status,
            enqueued_at=django_time(job.inserted_at),
            started_at=django_time(job.attempted_at),
            finished_at=django_time(job.finished_at) if finished else None,
            last_attempted_at=django_time(job.attempted_at),
            args=list(args.get("args") or []),
            kwargs=dict(args.get("kwargs") or {}),
            backend=str(django_meta.get("backend") or backend_alias or self.task_backend_alias),
            errors=[task_error(e) for e in job.errors],
            worker_ids=worker_ids(job),
        )
        if status == SUCCESSFUL:
            object.__setattr__(result, "_return_value", job.result)
        return result

    def running_result(self, task: Task, ctx: Context) -> TaskResult:
        """The RUNNING result of the attempt ``ctx`` describes; sends ``task_started``."""
        from .backend import ErrandsBackend

        try:
            result = self.task_result(self.get_job(ctx.job_id))
        except Exception:
            log.exception("job %s: could not read it back for task_started", ctx.job_id)
            raise
        if result.status != TaskResultStatus.RUNNING:  # read after a cancel or a rescue
            object.__setattr__(result, "status", TaskResultStatus.RUNNING)
        ids = list(result.worker_ids)
        if len(ids) < ctx.attempt:
            ids += [ctx.worker_id] * (ctx.attempt - len(ids))
        object.__setattr__(result, "worker_ids", ids)
        send_signal(task_started, ErrandsBackend, result)
        return result

    # -- Django's signals from the worker ---------------------------------------------------
    def _bridge_signals(self, event: Any) -> None:
        name = event.name
        if name == "errands.job.rescued":
            # A rescue ends the task when it cancels it (it emits nothing else); its deaths
            # come as errands.job.dead too (task_finished was sent twice for them).
            if event.get("state") != "cancelled":
                return
        elif name not in ("errands.job.completed", "errands.job.dead", "errands.job.cancelled"):
            return
        if self.task_definition(event.get("job_name", "")) is None:
            return
        from .backend import ErrandsBackend

        job = self.get_job(event["job_id"])
        result = self.task_result(job)
        failure = self.failures.take(job)
        if result.status != TaskResultStatus.FAILED or failure is None:
            send_signal(task_finished, ErrandsBackend, result)
            return
        # Inside the handler of the task's own exception, as Django's backends send it:
        # Django's log_task_finished (and Sentry-style receivers) read sys.exc_info().
        try:
            raise failure
        except BaseException:
            send_signal(task_finished, ErrandsBackend, result)


@contextmanager
def translate_missing_tables(database: str) -> Iterator[None]:
    """errands' tables missing from Django's database: say which command creates them."""
    try:
        yield
    except Exception as exc:
        text = str(exc)
        if "errands_" in text and ("no such table" in text or "does not exist" in text):
            raise SchemaOutdated(
                f"errands' tables are missing in Django's database {database!r} ({text.strip()}"
                "); add 'errands.contrib.django' to INSTALLED_APPS and run: python manage.py "
                "migrate"
            ) from None
        raise


def django_time(value: datetime | None) -> datetime | None:
    """errands' aware UTC times as Django expects them (naive local when USE_TZ=False)."""
    if value is None or settings.USE_TZ:
        return value
    return timezone.make_naive(value)


_CAUSE_LINE = "The above exception was the direct cause of the following exception:"


def exception_class_path(error: JobError) -> str:
    """``module.QualName`` of a recorded error, read from its traceback's last line (what
    ``traceback.format_exception`` writes), so Django's ``TaskError.exception_class``
    imports it. For a :class:`ResultNotJSON`, the class of the error it was raised from."""
    if error.type == "WorkerLost" and not error.traceback:
        return f"{WorkerLost.__module__}.{WorkerLost.__qualname__}"
    lines = [line for line in (error.traceback or "").splitlines() if line.strip()]
    if error.type == ResultNotJSON.__name__ and _CAUSE_LINE in lines:
        cause = lines[: lines.index(_CAUSE_LINE)]
        head = cause[-1].split(":", 1)[0].strip() if cause else ""
        if _CLASS_PATH.match(head):
            return head if "." in head else f"builtins.{head}"
    if lines and not lines[-1].startswith(" "):
        head = lines[-1].split(":", 1)[0].strip()
        if _CLASS_PATH.match(head) and head.rsplit(".", 1)[-1] == error.type.rsplit(".", 1)[-1]:
            return head if "." in head else f"builtins.{head}"
    if "." not in error.type and isinstance(getattr(builtins, error.type, None), type):
        return f"builtins.{error.type}"
    return error.type


def task_error(error: JobError) -> TaskError:
    return TaskError(
        exception_class_path=exception_class_path(error),
        traceback=error.traceback or f"{error.type}: {error.message}",
    )


def worker_ids(job: Job) -> list[str]:
    """One worker id per attempt (Django counts attempts as ``len(worker_ids)``): the
    worker of each failed attempt, the lease owner of a running one; errands does not keep
    the id of the worker that completed a job, so that attempt shows ``"errands"``."""
    ids = [e.worker or "errands" for e in job.errors]
    if job.state is JobState.RUNNING and job.lease_owner:
        ids.append(job.lease_owner)
    return ids + ["errands"] * (job.attempt - len(ids))


def send_signal(signal: Any, sender: type, result: TaskResult) -> None:
    """Send a Django task signal; a failing receiver is logged, never fails the job."""
    for receiver, response in signal.send_robust(sender=sender, task_result=result):
        if isinstance(response, Exception):
            log.error(
                "a task signal receiver (%r) failed for task result %s",
                receiver,
                result.id,
                exc_info=response,
            )


# -- one App per backend alias ------------------------------------------------------------------
_apps: dict[str, tuple[str, DjangoApp]] = {}
_apps_lock = threading.Lock()
fresh_lock_at_fork(globals(), "_apps_lock")  # a new one in a forked child


def serving_queues(params: dict[str, Any], app: DjangoApp) -> list[str]:
    """The queues a worker of a task backend serves: its QUEUES; with ``QUEUES: []``
    (Django then takes any queue_name) every queue its discovered tasks name, and
    ``default``. ``[]`` read as ``["default"]`` left the tasks of every other queue
    stored and never run."""
    declared = params.get("QUEUES", ["default"])
    if declared:
        return sorted(set(declared))
    return sorted({d.queue for d in app.registry.values()} | {"default"})


def backend_params(alias: str) -> dict[str, Any]:
    try:
        params = task_backends.settings[alias]
    except KeyError:
        raise ImproperlyConfigured(f"no task backend {alias!r} in the TASKS setting") from None
    backend = str(params.get("BACKEND", ""))
    from .backend import ErrandsBackend

    try:
        backend_class = import_string(backend)
    except ImportError:
        backend_class = None
    if not (isinstance(backend_class, type) and issubclass(backend_class, ErrandsBackend)):
        raise ImproperlyConfigured(
            f"task backend {alias!r} is {backend!r}, not {BACKEND_PATH}; set "
            f"TASKS[{alias!r}]['BACKEND'] = {BACKEND_PATH!r}"
        )
    return params


def check_options(alias: str, options: Mapping[str, Any]) -> None:
    unknown = set(options) - OPTION_NAMES
    if unknown:
        raise ImproperlyConfigured(
            f"TASKS[{alias!r}]['OPTIONS'] has unknown key(s) {sorted(unknown)}; errands "
            f"understands {sorted(OPTION_NAMES)}"
        )


def app_for(alias: str, params: Mapping[str, Any] | None = None) -> DjangoApp:
    """The App of task backend ``alias`` (created on first use, shared by all threads)."""
    if params is None:
        params = backend_params(alias)
    options = dict(params.get("OPTIONS") or {})
    signature = repr(sorted(options.items(), key=lambda item: str(item[0])))
    current = _apps.get(alias)
    if current is not None and current[0] == signature:
        return current[1]
    with _apps_lock:
        current = _apps.get(alias)
        if current is not None and current[0] == signature:
            return current[1]
        check_options(alias, options)
        if current is not None:  # the settings changed (override_settings in a test)
            current[1].close()
        app = DjangoApp(alias, options)
        _apps[alias] = (signature, app)
        return app


def get_app(alias: str = "default") -> DjangoApp:
    """The ``errands.App`` behind task backend ``alias``: for the full errands API
    (``app.jobs(state="dead")``, ``app.replay``...) and for native ``@app.job``
    functions run by the same ``manage.py errands_worker``."""
    return app_for(alias)


def close_apps() -> None:
    """Close errands' own connections of every backend (they reopen on next use).

    Call it before a PostgreSQL test database is dropped (the DiscoverRunner in
    ``errands.contrib.django.test`` does), since PostgreSQL refuses to drop a database
    other sessions are connected to."""
    for _, app in list(_apps.values()):
        app.close()
