"""errands as the engine of Django's Tasks framework (``django.tasks``, or the
``django-tasks`` backport on Django 5.2).

Settings::

    INSTALLED_APPS = [..., "errands.contrib.django"]     # manage.py migrate creates the tables
    TASKS = {"default": {"BACKEND": "errands.contrib.django.ErrandsBackend"}}

Then Django's own ``@task`` functions run on errands: ``python manage.py errands_worker``.
See docs/integrations.md.
"""

from __future__ import annotations

from .app import DjangoApp, WorkerLost, close_apps, get_app
from .backend import ErrandsBackend
from .task import ErrandsTask

__all__ = ["DjangoApp", "ErrandsBackend", "ErrandsTask", "WorkerLost", "close_apps", "get_app"]
