from __future__ import annotations

import time
from typing import Any

import pytest
from fastapi.testclient import TestClient
from shop.db import Order, SessionLocal
from shop.jobs import DECLINED, charge_order, jobs
from sqlalchemy import func, select


def wait_for(
    client: TestClient, order_id: int, status: str, payment: str, timeout: float = 60
) -> dict[str, Any]:
    """The order once it has ``status`` and its payment job ``payment`` (the job's outcome
    is written by the worker's completer a moment after the handler returns)."""
    deadline = time.monotonic() + timeout
    while True:
        body = client.get(f"/orders/{order_id}").json()
        if body["status"] == status and body["payment"]["state"] == payment:
            return body
        assert time.monotonic() < deadline, body
        time.sleep(0.02)


def order(client: TestClient, card: str = "tok_visa") -> dict[str, Any]:
    response = client.post(
        "/orders", json={"email": "ann@example.com", "amount_cents": 1250, "card": card}
    )
    assert response.status_code == 201, response.text
    return response.json()


def test_the_order_waits_for_a_worker(client: TestClient) -> None:
    created = order(client)
    body = client.get(f"/orders/{created['order']}").json()
    assert body["status"] == "pending"
    assert body["payment"] == {
        "job": created["payment_job"],
        "state": "available",
        "attempts": 0,
        "errors": [],
    }


def test_the_embedded_worker_pays_the_order(client_with_worker: TestClient) -> None:
    created = order(client_with_worker)
    wait_for(client_with_worker, created["order"], "paid", payment="completed")
    assert jobs.get_job(created["payment_job"]).result.startswith("ch_")


def test_a_declined_card_goes_to_the_dead_letter_queue(client_with_worker: TestClient) -> None:
    created = order(client_with_worker, card=DECLINED)
    body = wait_for(client_with_worker, created["order"], "failed", payment="dead")
    assert body["payment"]["attempts"] == 1
    assert body["payment"]["errors"] == [f"CardDeclined: card of order {created['order']} declined"]


def test_a_rolled_back_transaction_keeps_neither_order_nor_job(client: TestClient) -> None:
    before = len(jobs.jobs(name=charge_order.name, limit=1000))
    with pytest.raises(RuntimeError), SessionLocal() as session, session.begin():
        new = Order(email="bob@example.com", amount_cents=5, card="tok_visa")
        session.add(new)
        session.flush()
        charge_order.enqueue(order_id=new.id, conn=session)
        raise RuntimeError("stock check failed")
    with SessionLocal() as session:
        assert session.scalar(select(func.count()).where(Order.email == "bob@example.com")) == 0
    assert len(jobs.jobs(name=charge_order.name, limit=1000)) == before


def test_bad_input_stores_nothing(client: TestClient) -> None:
    before = len(jobs.jobs(limit=1000))
    assert client.post("/orders", json={"email": "x", "amount_cents": 0}).status_code == 422
    assert len(jobs.jobs(limit=1000)) == before


def test_unknown_orders_are_404(client: TestClient) -> None:
    assert client.get("/orders/999999").status_code == 404


def test_the_dashboard_is_mounted_for_admins(client: TestClient) -> None:
    assert client.get("/admin/jobs/").status_code != 200
    page = client.get("/admin/jobs/", headers={"x-admin-token": "test-admin-token"})
    assert page.status_code == 200
    assert "errands" in page.text


def test_a_rolled_back_async_session_keeps_neither_order_nor_job(client: TestClient) -> None:
    """The endpoints' way: aenqueue inside an AsyncSession transaction that rolls back."""
    import asyncio

    from shop.db import AsyncSessionLocal

    before = len(jobs.jobs(name=charge_order.name, limit=1000))

    async def scenario() -> None:
        async with AsyncSessionLocal() as session:
            with pytest.raises(RuntimeError):
                async with session.begin():
                    new = Order(email="eve@example.com", amount_cents=5, card="tok_visa")
                    session.add(new)
                    await session.flush()
                    await charge_order.aenqueue(order_id=new.id, conn=session)
                    raise RuntimeError("stock check failed")

    asyncio.run(scenario())
    with SessionLocal() as session:
        assert session.scalar(select(func.count()).where(Order.email == "eve@example.com")) == 0
    assert len(jobs.jobs(name=charge_order.name, limit=1000)) == before
