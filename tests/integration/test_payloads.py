"""Payloads as a durable contract, and jobs no handler knows (DESIGN §4, §5, F11)."""

from typing import Any

import pytest

import errands
from errands import JobState

from .helpers import count_jobs, execute_sql


def test_malformed_payload_at_enqueue_raises_invalid_payload_naming_the_field(
    app: errands.App,
) -> None:
    @app.job(name="payload.welcome")
    def welcome(user_id: int, email: str) -> None:
        raise AssertionError("never runs")

    with pytest.raises(errands.InvalidPayload, match=r"user_id: .*integer") as bad_type:
        welcome.enqueue(user_id="forty-two", email="a@b.c")
    assert [e["loc"] for e in bad_type.value.errors] == [("user_id",)]

    with pytest.raises(errands.InvalidPayload, match=r"email: Field required"):
        welcome.enqueue(user_id=1)
    with pytest.raises(errands.InvalidPayload, match=r"colour: unexpected argument"):
        welcome.enqueue(user_id=1, email="a@b.c", colour="red")
    with pytest.raises(errands.InvalidPayload, match="user_id"):
        welcome.bind(user_id=[1], email="a@b.c")

    assert count_jobs(app) == 0


@pytest.mark.parametrize("kind", ["sync", "async"])  # async: decoded on the event loop
def test_payload_corrupted_to_invalid_json_is_dead_after_one_attempt_and_worker_keeps_serving(
    app: errands.App, worker_factory, kind: str
) -> None:
    calls: list[int] = []

    if kind == "async":

        @app.job(name="payload.add", retries=3, backoff=0.01)
        async def add_async(a: int, b: int) -> int:
            calls.append(a)
            return a + b

        add: errands.JobDefinition[..., int] = add_async
    else:

        @app.job(name="payload.add", retries=3, backoff=0.01)
        def add_sync(a: int, b: int) -> int:
            calls.append(a)
            return a + b

        add = add_sync

    corrupted = add.enqueue(a=1, b=2)
    execute_sql(app, "UPDATE errands_jobs SET args = ? WHERE id = ?", ('{"a": 1, "b', corrupted.id))
    healthy = [add.enqueue(a=10 * i, b=1) for i in range(1, 4)]

    with worker_factory(concurrency=1):
        with pytest.raises(errands.JobFailed, match="stored payload fails validation"):
            corrupted.result(timeout=10)
        assert [h.result(timeout=10) for h in healthy] == [11, 21, 31]

    job = corrupted.job()
    assert job.state is JobState.DEAD
    assert job.attempt == 1
    [error] = job.errors
    assert error.type == "InvalidPayload"
    assert 1 not in calls  # the handler never saw the corrupted payload


def test_payload_corrupted_to_a_wrong_type_is_dead_after_one_attempt_and_worker_keeps_serving(
    app: errands.App, worker_factory
) -> None:
    calls: list[int] = []

    @app.job(name="payload.ship", retries=3, backoff=0.01)
    def ship(order_id: int) -> int:
        calls.append(order_id)
        return order_id

    corrupted = ship.enqueue(order_id=1)
    execute_sql(
        app,
        "UPDATE errands_jobs SET args = ? WHERE id = ?",
        ('{"order_id": "not-a-number"}', corrupted.id),
    )
    before = ship.enqueue(order_id=2)
    after = ship.enqueue(order_id=3)

    with worker_factory(concurrency=1):
        with pytest.raises(errands.JobFailed, match="order_id"):
            corrupted.result(timeout=10)
        assert before.result(timeout=10) == 2
        assert after.result(timeout=10) == 3

    job = corrupted.job()
    assert job.state is JobState.DEAD
    assert job.attempt == 1
    [error] = job.errors
    assert error.type == "InvalidPayload"
    assert "order_id" in error.message
    assert sorted(calls) == [2, 3]


def test_job_with_no_registered_handler_is_never_claimed_by_a_worker_that_lacks_it(
    app: errands.App, db_url: str, worker_factory: Any, errands_testing: Any
) -> None:
    """A job type a newer deployment enqueued and this worker's code does not define is
    never claimed here: it waits, uncharged, for a worker that defines it. Run anyway (the
    test tools claim whatever is due), it fails with UnknownJob, listing the known names,
    and stays retryable for a worker that knows it."""

    @app.job(name="payload.known_one")
    def known_one() -> str:
        return "one"

    @app.job(name="payload.known_two")
    def known_two() -> str:
        return "two"

    # a newer deployment enqueues a job this worker's code does not define
    newer = errands.App(db_url)
    try:

        @newer.job(name="payload.from_the_future", retries=2, backoff=60)
        def from_the_future() -> None:
            raise AssertionError("never runs here")

        ghost = from_the_future.enqueue()
    finally:
        newer.close()

    with worker_factory():
        assert known_one.enqueue().result(timeout=10) == "one"
        assert known_two.enqueue().result(timeout=10) == "two"
    job = ghost.job()
    assert (job.state, job.attempt, job.errors) == (JobState.AVAILABLE, 0, [])

    tester = errands_testing(app)
    tester.drain(with_retries=False)
    job = ghost.job()
    assert job.attempt == 1
    [error] = job.errors
    assert error.type == "UnknownJob"
    assert "payload.from_the_future" in error.message
    assert "payload.known_one" in error.message
    assert "payload.known_two" in error.message
    assert ghost.status() is JobState.RETRYABLE  # kept for a worker that knows it
