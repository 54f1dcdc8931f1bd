"""A sync and an async job run to completion on a real worker and a real SQLite file."""

import asyncio
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal

import errands
from errands import JobState


@dataclass
class Receipt:
    order_id: int
    total: Decimal
    issued: date


def test_sync_job_completes_and_result_is_decoded_through_the_return_type(
    app: errands.App, worker_factory
) -> None:
    @app.job(name="exec.receipt")
    def make_receipt(order_id: int, cents: int) -> Receipt:
        return Receipt(order_id=order_id, total=Decimal(cents) / 100, issued=date(2024, 5, 17))

    handle = make_receipt.enqueue(order_id=7, cents=1250)
    assert handle.status() is JobState.AVAILABLE
    assert not handle.deduplicated

    with worker_factory():
        receipt = handle.result(timeout=10)

    assert receipt == Receipt(order_id=7, total=Decimal("12.50"), issued=date(2024, 5, 17))
    assert isinstance(receipt.total, Decimal)
    assert handle.status() is JobState.COMPLETED
    job = handle.job()
    assert job.attempt == 1
    assert job.errors == []
    assert job.finished_at is not None and job.attempted_at is not None
    assert job.lease_owner is None


def test_async_job_completes_and_result_is_decoded_through_the_return_type(
    app: errands.App, worker_factory
) -> None:
    @app.job(name="exec.async_stamps")
    async def stamps(count: int) -> dict[str, datetime]:
        await asyncio.sleep(0.01)
        return {f"s{i}": datetime(2024, 1, 1 + i, tzinfo=UTC) for i in range(count)}

    handle = stamps.enqueue(count=2)
    assert handle.status() is JobState.AVAILABLE

    with worker_factory():
        value = handle.result(timeout=10)

    assert value == {
        "s0": datetime(2024, 1, 1, tzinfo=UTC),
        "s1": datetime(2024, 1, 2, tzinfo=UTC),
    }
    assert all(isinstance(v, datetime) for v in value.values())
    assert handle.status() is JobState.COMPLETED
    assert handle.job().attempt == 1


def test_sync_and_async_jobs_complete_side_by_side_on_one_worker(
    app: errands.App, worker_factory
) -> None:
    @app.job(name="exec.double")
    def double(n: int) -> int:
        return n * 2

    @app.job(name="exec.async_square")
    async def square(n: int) -> int:
        await asyncio.sleep(0)
        return n * n

    handles = [double.enqueue(n=i) for i in range(5)] + [square.enqueue(n=i) for i in range(5)]
    with worker_factory(concurrency=4):
        results = [h.result(timeout=10) for h in handles]

    assert results == [0, 2, 4, 6, 8, 0, 1, 4, 9, 16]
    assert {h.status() for h in handles} == {JobState.COMPLETED}
