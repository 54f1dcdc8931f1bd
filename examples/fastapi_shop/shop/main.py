"""The FastAPI shop: async endpoints; an order and its payment job in one SQLAlchemy
``AsyncSession`` transaction (``await job.aenqueue(..., conn=session)``), a status
endpoint through the job's handle, errands' dashboard at /admin/jobs.

    uvicorn shop.main:api                            # then: errands worker shop.jobs:jobs
    ERRANDS_EMBEDDED_WORKER=1 uvicorn shop.main:api  # development: the worker in-process
"""

from __future__ import annotations

import hmac
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException
from pydantic import BaseModel, Field
from sqlalchemy.ext.asyncio import AsyncSession

import errands
from errands.contrib.fastapi import ErrandsApp, lifespan, mount_dashboard

from .db import Base, Order, async_engine, get_session
from .jobs import charge_order, jobs

ADMIN_TOKEN = os.environ.get("SHOP_ADMIN_TOKEN", "")


@asynccontextmanager
async def create_tables(api: FastAPI) -> AsyncIterator[None]:
    """The shop's own tables (a real project uses Alembic); errands' come from migrate."""
    async with async_engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    yield
    await async_engine.dispose()


api = FastAPI(title="fastapi_shop", lifespan=lifespan(jobs, migrate=True, inner=create_tables))


def admin_user(request: Any) -> str | None:
    """Who may see the dashboard: a request carrying the admin token (use your real login)."""
    given = request.headers.get("x-admin-token", "")
    return "admin" if ADMIN_TOKEN and hmac.compare_digest(given, ADMIN_TOKEN) else None


with suppress(ImportError, errands.ConfigurationError):  # errands[dashboard] not installed
    mount_dashboard(api, jobs, path="/admin/jobs", user=admin_user)

SessionDep = Annotated[AsyncSession, Depends(get_session)]


class OrderIn(BaseModel):
    email: str = Field(min_length=3)
    amount_cents: int = Field(gt=0)
    card: str


@api.post("/orders", status_code=201)
async def create_order(body: OrderIn, session: SessionDep) -> dict[str, Any]:
    async with session.begin():  # the order and its payment job: both or neither
        order = Order(email=body.email, amount_cents=body.amount_cents, card=body.card)
        session.add(order)
        await session.flush()
        handle = await charge_order.aenqueue(
            order_id=order.id, key=f"order:{order.id}", conn=session
        )
        order.payment_job_id = handle.id
    return {"order": order.id, "payment_job": handle.id}


@api.get("/orders/{order_id}")
async def order_status(order_id: int, session: SessionDep, app: ErrandsApp) -> dict[str, Any]:
    order = await session.get(Order, order_id)
    if order is None or order.payment_job_id is None:
        raise HTTPException(404, "no such order")
    handle = errands.JobHandle(app, order.payment_job_id, charge_order.name)
    job = await handle.ajob()
    return {
        "order": order.id,
        "status": order.status,
        "payment": {
            "job": handle.id,
            "state": str(job.state),
            "attempts": job.attempt,
            "errors": [f"{e.type}: {e.message}" for e in job.errors],
        },
    }
