"""Django's task signals, sent by errands' worker: a payment that ends FAILED (declined, or
out of retries and in the dead-letter queue) marks its order failed."""

from __future__ import annotations

import logging
from typing import Any

from django.dispatch import receiver

try:
    from django.tasks import TaskResultStatus
    from django.tasks.signals import task_finished
except ImportError:  # Django 5.2 with the django-tasks backport
    from django_tasks import TaskResultStatus
    from django_tasks.signals import task_finished

from .models import Order

log = logging.getLogger("orders")


@receiver(task_finished)
def payment_failed(sender: Any, task_result: Any, **kwargs: Any) -> None:
    from .tasks import charge_order

    if task_result.task.func is not charge_order.func:
        return
    if task_result.status == TaskResultStatus.FAILED:
        order_id = task_result.args[0] if task_result.args else task_result.kwargs["order_id"]
        Order.objects.filter(pk=order_id).exclude(status=Order.Status.PAID).update(
            status=Order.Status.FAILED
        )
        log.warning(
            "payment of order %s failed: %s",
            order_id,
            task_result.errors[-1].traceback.splitlines()[-1],
        )
