from __future__ import annotations

import time

import pytest
from shop import Order, charge_order, create_app, engine, jobs
from sqlalchemy.orm import Session

from errands.contrib._embedded import EmbeddedWorker


@pytest.fixture
def client():  # type: ignore[no-untyped-def]
    web = create_app()
    web.testing = True
    return web.test_client()


def test_an_order_is_paid_once_a_worker_runs(client) -> None:  # type: ignore[no-untyped-def]
    created = client.post("/orders", json={"email": "ann@example.com", "amount_cents": 900})
    assert created.status_code == 201
    order_id = created.json["order"]
    assert client.get(f"/orders/{order_id}").json["payment"] == "available"
    with EmbeddedWorker(jobs, poll_interval=0.05, grace=5).start():
        deadline = time.monotonic() + 20
        while client.get(f"/orders/{order_id}").json["status"] != "paid":
            assert time.monotonic() < deadline
            time.sleep(0.02)
    assert client.get(f"/orders/{order_id}").json["payment"] == "completed"


def test_a_rolled_back_transaction_keeps_neither_order_nor_job(client) -> None:  # type: ignore[no-untyped-def]
    before = len(jobs.jobs(limit=1000))
    with pytest.raises(RuntimeError), Session(engine) as session, session.begin():
        order = Order(email="bob@example.com", amount_cents=5)
        session.add(order)
        session.flush()
        charge_order.enqueue(order_id=order.id, conn=session)
        raise RuntimeError("stock check failed")
    with Session(engine) as session:
        assert session.query(Order).filter_by(email="bob@example.com").count() == 0
    assert len(jobs.jobs(limit=1000)) == before


def test_bad_input_is_refused(client) -> None:  # type: ignore[no-untyped-def]
    assert client.post("/orders", json={"email": "x"}).status_code == 400


def test_the_worker_command_is_registered(client) -> None:  # type: ignore[no-untyped-def]
    result = client.application.test_cli_runner().invoke(args=["errands-worker", "--help"])
    assert result.exit_code == 0
    assert "Run an errands worker" in result.output
