"""A small shop: orders paid by a background job that Django's Tasks framework enqueues
and errands runs (python manage.py errands_worker)."""

from __future__ import annotations

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
STATE_DIR = Path(os.environ.get("SHOP_STATE_DIR", BASE_DIR / "var"))
STATE_DIR.mkdir(parents=True, exist_ok=True)

SECRET_KEY = os.environ.get("SHOP_SECRET_KEY", "django-shop-example-not-secret")
DEBUG = os.environ.get("SHOP_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "testserver"]
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
ROOT_URLCONF = "shop.urls"
ASGI_APPLICATION = "shop.asgi.application"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "errands.contrib.django",  # manage.py migrate creates errands' tables
    "orders",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

if os.environ.get("SHOP_DB") == "postgres":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": os.environ.get("SHOP_DB_NAME", "django_shop"),
            "USER": os.environ.get("SHOP_DB_USER", "postgres"),
            "HOST": os.environ.get("SHOP_DB_HOST", "127.0.0.1"),
            "PORT": os.environ.get("SHOP_DB_PORT", "5432"),
        }
    }
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": STATE_DIR / "shop.sqlite3",
            # errands' worker opens the same file, so tests need a file database too
            "TEST": {"NAME": STATE_DIR / "test-shop.sqlite3"},
            # BEGIN IMMEDIATE: a transaction takes the write lock up front (Django >= 5.1)
            "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 20},
        }
    }

TASKS = {
    "default": {
        "BACKEND": "errands.contrib.django.ErrandsBackend",
        "QUEUES": ["default", "payments"],
        "OPTIONS": {
            "RETRIES": 3,
            # at most 4 payments at once across every worker, at most 50 a second
            "QUEUE_LIMITS": {"payments": {"limit": 4, "rate": "50/s"}},
        },
    }
}

# closes errands' connections before the test database is dropped (PostgreSQL needs it)
TEST_RUNNER = "errands.contrib.django.test.DiscoverRunner"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {
        "errands": {"handlers": ["console"], "level": os.environ.get("SHOP_JOB_LOG", "INFO")},
        "orders": {"handlers": ["console"], "level": "INFO"},
    },
}
