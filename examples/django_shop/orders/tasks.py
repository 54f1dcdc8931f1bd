"""The payment job: Django's own @task, run by errands with retries, a dead-letter queue
and an idempotency key (python manage.py errands_worker)."""

from __future__ import annotations

try:
    from django.tasks import task  # Django >= 6.0
except ImportError:  # Django 5.2 with the django-tasks backport
    from django_tasks import task

from . import payments
from .models import Order


@task(
    queue_name="payments",
    retries=3,
    backoff=0.2,  # seconds between attempts: short for the example, keep the default in real life
    permanent=(payments.CardDeclined,),  # a decline goes to the dead-letter queue at once
    key="charge-order:{order_id}",  # enqueueing the same order twice charges once
    concurrency_key="customer:{email}",  # one payment per customer at a time, cluster-wide
)
def charge_order(order_id: int, email: str) -> str:
    order = Order.objects.get(pk=order_id)
    if order.status == Order.Status.PAID:
        return order.charge_id
    charge_id = payments.charge(
        order.card_token, order.amount_cents, idempotency_key=f"order-{order.pk}"
    )
    Order.objects.filter(pk=order.pk).update(status=Order.Status.PAID, charge_id=charge_id)
    return charge_id
