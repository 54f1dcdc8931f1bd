"""The shop's tests: checkout, the payment job run by an errands worker, the signal that
marks failed payments, the all-or-nothing transaction, and the dashboard in the ASGI app.

``TransactionTestCase``: the worker (a thread here, ``manage.py errands_worker`` in
production) only sees committed jobs.
"""

from __future__ import annotations

import time
from typing import Any

from django.contrib.auth import get_user_model
from django.db import transaction

from errands.contrib.django.test import TransactionTestCase, run_worker

from .models import Charge, Order
from .payments import DECLINED, FLAKY
from .tasks import charge_order

try:
    from django.tasks.exceptions import TaskResultDoesNotExist
except ImportError:
    from django_tasks.exceptions import TaskResultDoesNotExist


def wait_until(check: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"still false after {timeout} s: {check}")
        time.sleep(0.02)
    return value


class Checkout(TransactionTestCase):
    def checkout(self, card: str = "tok_visa", email: str = "ann@example.com") -> dict[str, Any]:
        response = self.client.post(
            "/orders/",
            {"email": email, "amount_cents": 1250, "card": card},
            content_type="application/json",
        )
        self.assertEqual(response.status_code, 201, response.content)
        return response.json()

    def status(self, order_id: int) -> dict[str, Any]:
        return self.client.get(f"/orders/{order_id}/").json()

    def test_an_order_is_paid_by_the_payment_job(self) -> None:
        created = self.checkout()
        self.assertEqual(self.status(created["order"])["payment"]["status"], "READY")
        with run_worker():
            wait_until(lambda: self.status(created["order"])["status"] == "paid")
        body = self.status(created["order"])
        self.assertEqual(body["payment"]["status"], "SUCCESSFUL")
        self.assertEqual(body["payment"]["attempts"], 1)
        self.assertEqual(Charge.objects.count(), 1)

    def test_a_provider_outage_is_retried_and_charges_once(self) -> None:
        created = self.checkout(card=FLAKY)
        with run_worker():
            wait_until(lambda: self.status(created["order"])["status"] == "paid")
        body = self.status(created["order"])
        self.assertEqual(body["payment"]["attempts"], 2)
        self.assertIn("ProviderUnavailable", body["payment"]["errors"][0])
        self.assertEqual(Charge.objects.count(), 1)

    def test_a_declined_card_fails_at_once_and_marks_the_order(self) -> None:
        created = self.checkout(card=DECLINED)
        with run_worker():
            wait_until(lambda: self.status(created["order"])["status"] == "failed")
        body = self.status(created["order"])
        self.assertEqual(body["payment"]["status"], "FAILED")
        self.assertEqual(body["payment"]["attempts"], 1)  # permanent: no retry
        self.assertIn("CardDeclined", body["payment"]["errors"][0])
        self.assertFalse(Charge.objects.exists())

    def test_enqueueing_an_order_twice_charges_once(self) -> None:
        created = self.checkout()
        order = Order.objects.get(pk=created["order"])
        again = charge_order.enqueue(order.pk, order.email)  # same key: the same job
        self.assertEqual(again.id, created["payment"])

    def test_a_rolled_back_checkout_leaves_neither_order_nor_payment(self) -> None:
        with self.assertRaises(RuntimeError), transaction.atomic():
            order = Order.objects.create(
                email="bob@example.com", amount_cents=500, card_token="tok"
            )
            result = charge_order.enqueue(order.pk, order.email)
            raise RuntimeError("stock check failed after the order was saved")
        self.assertFalse(Order.objects.exists())
        with self.assertRaises(TaskResultDoesNotExist):
            charge_order.get_result(result.id)

    def test_bad_input_is_refused(self) -> None:
        response = self.client.post("/orders/", {"email": "x"}, content_type="application/json")
        self.assertEqual(response.status_code, 400)
        self.assertFalse(Order.objects.exists())


class Dashboard(TransactionTestCase):
    """errands' dashboard, mounted in Django's ASGI application for staff users."""

    def test_staff_users_see_the_dashboard_and_others_do_not(self) -> None:
        from shop.asgi import application
        from starlette.testclient import TestClient

        get_user_model().objects.create_user("staff", password="pw-1234", is_staff=True)
        get_user_model().objects.create_user("customer", password="pw-1234")
        with TestClient(application) as client:
            self.assertNotEqual(client.get("/admin/jobs/").status_code, 200)
            self.assertEqual(client.get("/orders/1/").status_code, 404)  # Django answers

            self.assertTrue(self.client.login(username="customer", password="pw-1234"))
            client.cookies.set("sessionid", self.client.cookies["sessionid"].value)
            self.assertNotEqual(client.get("/admin/jobs/").status_code, 200)

            self.assertTrue(self.client.login(username="staff", password="pw-1234"))
            client.cookies.set("sessionid", self.client.cookies["sessionid"].value)
            page = client.get("/admin/jobs/")
            self.assertEqual(page.status_code, 200)
            self.assertIn("errands", page.text)
