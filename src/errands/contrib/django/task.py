"""``ErrandsTask``: Django's ``Task`` with errands' options.

``ErrandsBackend.task_class`` is this class, so Django's own ``@task`` decorator accepts
the options below whenever the task's backend is an ``ErrandsBackend``::

    from django.tasks import task          # django_tasks on Django 5.2

    @task(queue_name="payments", retries=5, timeout=30, permanent=(CardDeclined,),
          key="charge:{order_id}", concurrency_key="customer:{customer_id}")
    def charge_order(order_id: int, customer_id: int) -> str: ...

    charge_order.using(key=f"charge:{order.id}:retry").enqueue(order.id, order.customer_id)

Options left unset take the backend's ``OPTIONS`` (``RETRIES``, ``TIMEOUT``, ``BACKOFF``),
then errands' defaults. ``key``, ``concurrency_key`` are ``str.format`` templates over the
task's arguments by parameter name (write ``{{`` and ``}}`` for literal braces).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from ._compat import Task


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrandsTask(Task):  # type: ignore[misc]
    # How many times a failed run is retried (errands' default: 3, then the dead-letter queue).
    retries: int | None = None
    # Seconds (or a timedelta) one run may take; past it the run fails and is retried.
    timeout: float | timedelta | None = None
    # Seconds a worker's claim lasts between heartbeats (default: the backend's LEASE).
    lease: float | timedelta | None = None
    # Delay policy between retries: an errands.ExponentialBackoff, a callable or seconds.
    backoff: Any = None
    # Exceptions that send the job to the dead-letter queue at once, without a retry.
    permanent: tuple[type[BaseException], ...] = ()
    # Idempotency key template: a second enqueue with the same key returns the first job.
    key: str | None = None
    # With key: how long the key stays unique (seconds); default while the job's row exists.
    unique_for: float | timedelta | None = None
    # At most concurrency_limit (default 1) jobs with the same key run at once, cluster-wide.
    concurrency_key: str | None = None
    concurrency_limit: int | None = None
    # At most this many starts of this task per period, cluster-wide: "20/s", "100/m".
    rate: str | None = None

    def __post_init__(self) -> None:
        permanent = self.permanent
        if isinstance(permanent, type):
            permanent = (permanent,)
        object.__setattr__(self, "permanent", tuple(permanent or ()))
        # zero-argument super() does not work in a slots dataclass (the class is rebuilt)
        Task.__post_init__(self)

    def using(  # type: ignore[override]
        self,
        *,
        priority: int | None = None,
        queue_name: str | None = None,
        run_after: datetime | None = None,
        backend: str | None = None,
        key: str | None = None,
    ) -> ErrandsTask:
        """Django's ``using()``, plus ``key=``: this enqueue's idempotency key."""
        task = Task.using(
            self, priority=priority, queue_name=queue_name, run_after=run_after, backend=backend
        )
        return replace(task, key=key) if key is not None else task
