"""Settings of the Django backend test suite (integration/django/runtests.py).

``ERRANDS_DJANGO_DB`` picks the database: ``sqlite`` (default) or ``postgres``
(``ERRANDS_TEST_PG_HOST`` / ``_PORT`` / ``_USER``, default postgres@127.0.0.1:5432).
``ERRANDS_DJANGO_DB_NAME`` overrides the database name: the worker subprocess of the
management-command test uses it to open the test database.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import django

ENGINE = os.environ.get("ERRANDS_DJANGO_DB", "sqlite")
STATE = Path(os.environ.get("ERRANDS_DJANGO_STATE", tempfile.gettempdir())) / (
    f"errands-django{django.VERSION[0]}"
)

SECRET_KEY = "errands-integration-tests"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ALLOWED_HOSTS = ["testserver", "localhost", "127.0.0.1"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "errands.contrib.django",
    "backend_tests",
]

if ENGINE == "postgres":
    name = f"errands_django{django.VERSION[0]}"
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": os.environ.get("ERRANDS_DJANGO_DB_NAME", name),
            "USER": os.environ.get("ERRANDS_TEST_PG_USER", "postgres"),
            "HOST": os.environ.get("ERRANDS_TEST_PG_HOST", "127.0.0.1"),
            "PORT": os.environ.get("ERRANDS_TEST_PG_PORT", "5432"),
            "TEST": {"NAME": f"test_{name}"},
        }
    }
else:
    STATE.mkdir(parents=True, exist_ok=True)
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": os.environ.get("ERRANDS_DJANGO_DB_NAME", str(STATE / "dev.sqlite3")),
            # errands' worker opens the same file: the test database must be a file too
            "TEST": {"NAME": str(STATE / "test.sqlite3")},
            # take the write lock at BEGIN, so a transaction never fails to upgrade it
            "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 20},
        }
    }

TASKS = {
    "default": {
        "BACKEND": "errands.contrib.django.ErrandsBackend",
        "QUEUES": ["default", "payments", "slow"],
        "OPTIONS": {"RETRIES": 2, "BACKOFF": 0.2, "LEASE": 5},
    }
}

TEST_RUNNER = "errands.contrib.django.test.DiscoverRunner"

# Failing tasks are the point of several tests: keep their logs out of the test output
# (ERRANDS_TEST_LOGS=1 keeps them, for the worker subprocess).
LOGGING = (
    {}
    if os.environ.get("ERRANDS_TEST_LOGS")
    else {
        "version": 1,
        "disable_existing_loggers": False,
        "handlers": {"null": {"class": "logging.NullHandler"}},
        "loggers": {
            name: {"handlers": ["null"], "propagate": False}
            for name in ("errands", "django.tasks", "django_tasks")
        },
    }
)

# A local-memory cache that counts its close() calls (test_each_job_closes_the_caches_it_used)
CACHES = {"default": {"BACKEND": "backend_tests.caching.CountingCache", "LOCATION": "errands"}}
