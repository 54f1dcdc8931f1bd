"""One import surface for Django's Tasks framework.

Django >= 6.0 ships it as ``django.tasks``; on Django 5.2 the ``django-tasks`` backport
provides the same API as ``django_tasks``. The built-in framework wins when both are
importable. Names that differ between releases are resolved here, once:

- the status of a task that succeeded: ``SUCCESSFUL`` (Django 6, django-tasks >= 0.12),
  ``SUCCEEDED`` (django-tasks 0.11, refused below: it differs in more than names);
- the invalid-task error: ``InvalidTask`` (Django 6, and the backport's rename of it),
  ``InvalidTaskError`` (django-tasks <= 0.12).

The supported range is the ``errands[django]`` extra's (pyproject.toml).
"""

from __future__ import annotations

from importlib import metadata

# The django-tasks releases errands supports on Django 5.2: the bounds of the
# errands[django] extra (pyproject.toml), checked by tests/contrib/test_django_extra.py.
# 0.11 and older differ in more than names (TaskResult.metadata, an abstract
# save_metadata): refused at import with this range, rather than failing later.
DJANGO_TASKS_RANGE = ">=0.12,<0.14"
DJANGO_TASKS_OLDEST = (0, 12)


def backport_too_old() -> Exception | None:
    """The ImproperlyConfigured for an installed django-tasks older than supported."""
    from django.core.exceptions import ImproperlyConfigured

    version = metadata.version("django-tasks")
    try:
        release = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return None  # a development build: let it try
    if release >= DJANGO_TASKS_OLDEST:
        return None
    return ImproperlyConfigured(
        f"errands.contrib.django cannot use django-tasks {version}; it supports "
        f"django-tasks{DJANGO_TASKS_RANGE}: pip install 'errands[django]'"
    )


def framework_missing(error: ImportError) -> Exception:
    """The ImproperlyConfigured for a Tasks framework that cannot be imported: none at
    all, or a django-tasks release outside the supported range (a renamed name)."""
    from django.core.exceptions import ImproperlyConfigured

    try:
        version = metadata.version("django-tasks")
    except metadata.PackageNotFoundError:
        return ImproperlyConfigured(
            "errands.contrib.django needs Django's Tasks framework: Django >= 6.0, or on "
            "Django 5.2 the backport: pip install 'errands[django]'"
        )
    return ImproperlyConfigured(
        f"errands.contrib.django cannot use django-tasks {version} ({error}); it supports "
        f"django-tasks{DJANGO_TASKS_RANGE}: pip install 'errands[django]'"
    )


try:
    from django.tasks import Task, TaskContext, TaskResult, TaskResultStatus, task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import TaskError
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started
    from django.utils.json import normalize_json

    FRAMEWORK = "django.tasks"
except ImportError:  # Django < 6.0: the django-tasks backport
    try:
        from django_tasks import (  # type: ignore[no-redef]
            TaskContext,
            TaskResult,
            TaskResultStatus,
            task_backends,
        )
        from django_tasks.backends.base import BaseTaskBackend  # type: ignore[no-redef]
        from django_tasks.base import Task, TaskError  # type: ignore[no-redef]
        from django_tasks.exceptions import TaskResultDoesNotExist  # type: ignore[no-redef]

        try:  # the backport's next name for it, as Django's own
            from django_tasks.exceptions import InvalidTask  # type: ignore[no-redef]
        except ImportError:
            from django_tasks.exceptions import (  # type: ignore[no-redef]
                InvalidTaskError as InvalidTask,
            )
        from django_tasks.signals import (  # type: ignore[no-redef]
            task_enqueued,
            task_finished,
            task_started,
        )
        from django_tasks.utils import normalize_json  # type: ignore[no-redef]
    except ImportError as exc:
        raise framework_missing(exc) from exc

    FRAMEWORK = "django_tasks"
    if (too_old := backport_too_old()) is not None:
        raise too_old from None

# A task that returned: SUCCEEDED in django-tasks 0.11, SUCCESSFUL since (as in Django 6).
SUCCESSFUL: TaskResultStatus = (
    TaskResultStatus.__members__.get("SUCCESSFUL") or TaskResultStatus["SUCCEEDED"]
)


def register_checks() -> None:
    """The backport registers its system checks in its own AppConfig; make sure they run
    (so ``ErrandsBackend.check()`` is called) even when ``django_tasks`` is not installed
    as an app."""
    if FRAMEWORK == "django_tasks":
        import django_tasks.checks  # noqa: F401


__all__ = [
    "DJANGO_TASKS_RANGE",
    "FRAMEWORK",
    "SUCCESSFUL",
    "BaseTaskBackend",
    "InvalidTask",
    "Task",
    "TaskContext",
    "TaskError",
    "TaskResult",
    "TaskResultDoesNotExist",
    "TaskResultStatus",
    "normalize_json",
    "register_checks",
    "task_backends",
    "task_enqueued",
    "task_finished",
    "task_started",
]
