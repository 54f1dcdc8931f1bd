from django.db import models


class Order(models.Model):
    class Status(models.TextChoices):
        PENDING = "pending"
        PAID = "paid"
        FAILED = "failed"

    email = models.EmailField()
    amount_cents = models.PositiveIntegerField()
    card_token = models.CharField(max_length=64)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    payment_task_id = models.CharField(max_length=64, blank=True)
    charge_id = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"order {self.pk} ({self.status})"


class Charge(models.Model):
    """The payment provider's ledger (a stand-in for Stripe and the like): one row per
    idempotency key, so a retried job can never charge twice."""

    idempotency_key = models.CharField(max_length=128, unique=True)
    card_token = models.CharField(max_length=64)
    amount_cents = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)
