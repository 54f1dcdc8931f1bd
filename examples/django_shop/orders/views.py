from __future__ import annotations

import json

from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.shortcuts import get_object_or_404
from django.views.decorators.http import require_GET, require_POST

from .models import Order
from .tasks import charge_order


@require_POST
def checkout(request: HttpRequest) -> JsonResponse:
    """Save the order and enqueue its payment in one transaction: both or neither."""
    data = json.loads(request.body or b"{}")
    try:
        email, amount, card = str(data["email"]), int(data["amount_cents"]), str(data["card"])
    except (KeyError, TypeError, ValueError):
        return JsonResponse({"error": "send email, amount_cents and card"}, status=400)
    if amount <= 0:
        return JsonResponse({"error": "amount_cents must be positive"}, status=400)
    with transaction.atomic():
        order = Order.objects.create(email=email, amount_cents=amount, card_token=card)
        result = charge_order.enqueue(order.pk, email)
        order.payment_task_id = result.id
        order.save(update_fields=["payment_task_id"])
    return JsonResponse({"order": order.pk, "payment": result.id}, status=201)


@require_GET
def order_status(request: HttpRequest, order_id: int) -> JsonResponse:
    order = get_object_or_404(Order, pk=order_id)
    payment = charge_order.get_result(order.payment_task_id)
    return JsonResponse(
        {
            "order": order.pk,
            "status": order.status,
            "payment": {
                "id": payment.id,
                "status": str(payment.status),
                "attempts": payment.attempts,
                "errors": [e.traceback.strip().splitlines()[-1] for e in payment.errors],
            },
        }
    )
