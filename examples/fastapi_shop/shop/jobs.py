"""The payment job, an ordinary errands job: retries, a dead-letter queue for declined
cards, and an idempotency key the payment provider sees, so a retry never charges twice."""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

import errands

from .db import DATABASE_URL, Charge, Order, SessionLocal, errands_url

jobs = errands.App(errands_url(DATABASE_URL))

DECLINED = "tok_declined"


class CardDeclined(Exception):
    pass


def provider_charge(order_id: int, card: str, amount_cents: int, idempotency_key: str) -> str:
    """A stand-in for the payment provider's API: one charge per idempotency key."""
    if card == DECLINED:
        raise CardDeclined(f"card of order {order_id} declined")
    with SessionLocal() as session:
        try:
            with session.begin():
                charge = Charge(
                    idempotency_key=idempotency_key, order_id=order_id, amount_cents=amount_cents
                )
                session.add(charge)
        except IntegrityError:  # the same key again: the provider returns the first charge
            charge = session.scalars(
                select(Charge).where(Charge.idempotency_key == idempotency_key)
            ).one()
        return f"ch_{charge.id}"


@jobs.job(queue="payments", retries=3, backoff=0.2, permanent=(CardDeclined,))
def charge_order(ctx: errands.Context, order_id: int) -> str:
    with SessionLocal() as session:
        order = session.get_one(Order, order_id)
        card, amount = order.card, order.amount_cents
    # a durable step: a retry after the charge went through gets the stored charge id back
    charge_id = ctx.step("charge", provider_charge, order_id, card, amount, ctx.idempotency_key)
    with SessionLocal.begin() as session:
        session.execute(
            update(Order).where(Order.id == order_id).values(status="paid", charge_id=charge_id)
        )
    return charge_id


@jobs.on_dead
def mark_failed(job: errands.Job) -> None:
    """A payment in the dead-letter queue (declined, or out of retries) fails its order."""
    if job.name == charge_order.name:
        with SessionLocal.begin() as session:
            session.execute(
                update(Order)
                .where(Order.id == job.args["order_id"], Order.status != "paid")
                .values(status="failed")
            )
