"""The shop's database: SQLAlchemy for the shop's rows, and errands' jobs in the same
database, so an order and its payment job commit in one transaction.

The web endpoints are async and use an ``AsyncSession`` (aiosqlite on SQLite, psycopg's
async driver on PostgreSQL); the payment job runs in a worker thread and uses a plain
``Session`` on the same database."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

from sqlalchemy import ForeignKey, String, create_engine
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

DEFAULT_URL = f"sqlite:///{Path(__file__).resolve().parent.parent / 'var' / 'shop.db'}"
DATABASE_URL = os.environ.get("SHOP_DATABASE_URL", DEFAULT_URL)


def errands_url(sqlalchemy_url: str) -> str:
    """The same database as errands names it: ``postgresql+psycopg://`` -> ``postgresql://``."""
    scheme, rest = sqlalchemy_url.split("://", 1)
    return f"{scheme.split('+', 1)[0]}://{rest}"


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(String(254))
    amount_cents: Mapped[int]
    card: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), default="pending")
    payment_job_id: Mapped[int | None]
    charge_id: Mapped[str | None] = mapped_column(String(64))


class Charge(Base):
    """The payment provider's ledger (a stand-in): one charge per idempotency key."""

    __tablename__ = "charges"

    id: Mapped[int] = mapped_column(primary_key=True)
    idempotency_key: Mapped[str] = mapped_column(String(200), unique=True)
    order_id: Mapped[int] = mapped_column(ForeignKey("orders.id"))
    amount_cents: Mapped[int]


def async_url(url: str) -> str:
    """The async driver's name for the same database: aiosqlite, or psycopg (async)."""
    scheme, rest = url.split("://", 1)
    base = scheme.split("+", 1)[0]
    return f"{'sqlite+aiosqlite' if base == 'sqlite' else 'postgresql+psycopg'}://{rest}"


def make_engine(url: str = DATABASE_URL):  # type: ignore[no-untyped-def]
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return create_engine(url)


engine = make_engine()  # the payment job's (sync, in a worker thread)
SessionLocal = sessionmaker(engine, expire_on_commit=False)
async_engine = create_async_engine(async_url(DATABASE_URL))  # the endpoints'
AsyncSessionLocal = async_sessionmaker(async_engine, expire_on_commit=False)


async def get_session() -> AsyncIterator[AsyncSession]:
    """FastAPI dependency: one async session per request."""
    async with AsyncSessionLocal() as session:
        yield session
