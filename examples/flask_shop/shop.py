"""A Flask shop in one file: an order and its payment job in one SQLAlchemy transaction.

flask --app shop run                 # the web app (Flask finds create_app)
flask --app shop errands-worker      # the worker, in another terminal
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from flask import Flask, abort, request
from sqlalchemy import String, create_engine, update
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import errands
from errands.contrib.flask import Errands, current_jobs

DATABASE = Path(os.environ.get("SHOP_DB", Path(__file__).resolve().parent / "var" / "shop.db"))
DATABASE.parent.mkdir(parents=True, exist_ok=True)

engine = create_engine(f"sqlite:///{DATABASE}")
jobs = errands.App(f"sqlite:///{DATABASE}")  # the same file: one transaction for both


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(String(254))
    amount_cents: Mapped[int]
    status: Mapped[str] = mapped_column(String(16), default="pending")
    payment_job_id: Mapped[int | None]


@jobs.job(queue="payments", retries=3)
def charge_order(ctx: errands.Context, order_id: int) -> str:
    charge_id = f"ch_{order_id}"  # call the payment provider with ctx.idempotency_key here
    with Session(engine) as session, session.begin():
        session.execute(update(Order).where(Order.id == order_id).values(status="paid"))
    return charge_id


def create_app() -> Flask:
    web = Flask(__name__)
    Base.metadata.create_all(engine)
    jobs.migrate()
    Errands(web, jobs)  # current_jobs() and `flask errands-worker`

    @web.post("/orders")
    def create_order() -> tuple[dict[str, Any], int]:
        data = request.get_json(silent=True) or {}
        if not isinstance(data.get("amount_cents"), int) or data["amount_cents"] <= 0:
            abort(400, "send email and a positive amount_cents")
        with Session(engine, expire_on_commit=False) as session, session.begin():
            order = Order(email=str(data.get("email", "")), amount_cents=data["amount_cents"])
            session.add(order)
            session.flush()
            handle = charge_order.enqueue(order_id=order.id, conn=session)  # same transaction
            order.payment_job_id = handle.id
        return {"order": order.id, "payment_job": handle.id}, 201

    @web.get("/orders/<int:order_id>")
    def order_status(order_id: int) -> dict[str, Any]:
        with Session(engine) as session:
            order = session.get(Order, order_id)
            if order is None or order.payment_job_id is None:
                abort(404)
            job = current_jobs().get_job(order.payment_job_id)
            return {"order": order.id, "status": order.status, "payment": str(job.state)}

    return web
