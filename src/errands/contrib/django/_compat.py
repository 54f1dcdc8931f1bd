"""One import surface for Django's Tasks framework.

Django >= 6.0 ships it as ``django.tasks``; on Django 5.2 the ``django-tasks`` backport
provides the same API as ``django_tasks`` (a few names differ: ``InvalidTaskError``).
The built-in framework wins when both are importable.
"""

from __future__ import annotations

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
        from django_tasks.exceptions import (  # type: ignore[no-redef]
            InvalidTaskError as InvalidTask,
        )
        from django_tasks.exceptions import TaskResultDoesNotExist  # type: ignore[no-redef]
        from django_tasks.signals import (  # type: ignore[no-redef]
            task_enqueued,
            task_finished,
            task_started,
        )
        from django_tasks.utils import normalize_json  # type: ignore[no-redef]
    except ImportError as exc:
        from django.core.exceptions import ImproperlyConfigured

        raise ImproperlyConfigured(
            "errands.contrib.django needs Django's Tasks framework: Django >= 6.0, or on "
            "Django 5.2 the backport (pip install django-tasks)"
        ) from exc

    FRAMEWORK = "django_tasks"


def register_checks() -> None:
    """The backport registers its system checks in its own AppConfig; make sure they run
    (so ``ErrandsBackend.check()`` is called) even when ``django_tasks`` is not installed
    as an app."""
    if FRAMEWORK == "django_tasks":
        import django_tasks.checks  # noqa: F401


__all__ = [
    "FRAMEWORK",
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
