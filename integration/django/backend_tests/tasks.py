"""Django tasks the backend tests enqueue (Django's own @task, on the errands backend)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

try:
    from django.tasks import task  # Django >= 6.0
except ImportError:  # Django 5.2 and the django-tasks backport
    from django_tasks import task

from .models import Order

# Gates the blocking task: a test sees it RUNNING, then lets it finish.
entered = threading.Event()
release = threading.Event()
calls: list[str] = []


class CardDeclined(Exception):
    pass


@task
def add(a: int, b: int) -> int:
    return a + b


@task(queue_name="slow")
def blocking(token: str) -> str:
    entered.set()
    if not release.wait(15):
        raise TimeoutError("the test never released the blocking task")
    return token


@task(retries=1, backoff=0.75)
def always_fails(message: str) -> None:
    raise ValueError(message)


@task(queue_name="payments", retries=3, permanent=(CardDeclined,))
def charge(order_id: int) -> str:
    raise CardDeclined(f"card declined for order {order_id}")


@task
def record(label: str) -> str:
    calls.append(label)
    return label


@task(key="pay:{order_id}")
def pay_once(order_id: int, note: str = "") -> int:
    return order_id


@task(unique_for=60)
def once_a_minute(n: int) -> int:
    return n


@task
async def async_double(x: int) -> int:
    await asyncio.sleep(0)
    return 2 * x


@task(takes_context=True)
def with_context(context: Any, n: int) -> dict[str, Any]:
    return {"attempt": context.attempt, "id": context.task_result.id, "n": n}


@task
def mark_paid(order_id: int) -> bool:
    return Order.objects.filter(pk=order_id).update(paid=True) == 1


@task
def returns_object() -> Any:
    return object()


@task(concurrency_key="order:{order_id}", rate="100/s")
def limited(order_id: int) -> int:
    return order_id


@task(concurrency_key="account:{account}")
def per_account(account: str) -> str:
    return account


@task
async def orm_async_probe(n: int) -> bool:
    """Whether the ORM's connection (on asgiref's thread for thread-sensitive code) was
    closed when this async task began, as a request's is: then it uses it."""
    from asgiref.sync import sync_to_async
    from django.db import connection

    def probe() -> bool:
        was_closed = connection.connection is None
        list(Order.objects.all()[:1])  # opens it
        return was_closed

    return await sync_to_async(probe, thread_sensitive=True)()


@task
def uses_the_cache(n: int) -> int:
    """Reads and writes Django's default cache: the instance this job opened."""
    from django.core.cache import caches

    cache = caches["default"]
    cache.set(f"n:{n}", n)
    return int(cache.get(f"n:{n}"))
