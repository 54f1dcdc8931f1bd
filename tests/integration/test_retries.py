"""Failure classification and retries (DESIGN §5) on a real worker."""

from datetime import timedelta

import pytest

import errands
from errands import JobState

from .helpers import time_warp, wait_until


class CardDeclined(Exception):
    pass


def seconds_between(later, earlier) -> float:
    return (later - earlier).total_seconds()


def test_retryable_failure_then_success_completes_on_second_attempt(
    app: errands.App, worker_factory
) -> None:
    attempts: list[int] = []

    @app.job(name="retry.flaky", retries=3, backoff=0.05)
    def flaky(ctx: errands.Context, order_id: int) -> str:
        attempts.append(ctx.attempt)
        if ctx.attempt == 1:
            raise ConnectionError("payment gateway unreachable")
        return f"order {order_id} ok on attempt {ctx.attempt}"

    handle = flaky.enqueue(order_id=5)
    with worker_factory() as worker:
        assert handle.result(timeout=10) == "order 5 ok on attempt 2"

    assert attempts == [1, 2]
    job = handle.job()
    assert job.state is JobState.COMPLETED
    assert job.attempt == 2
    assert len(job.errors) == 1
    error = job.errors[0]
    assert (error.attempt, error.type, error.message) == (
        1,
        "ConnectionError",
        "payment gateway unreachable",
    )
    assert error.worker == worker.id


def test_retry_request_reschedules_after_its_delay_and_counts_an_attempt(
    app: errands.App, worker_factory
) -> None:
    @app.job(name="retry.rate_limited", retries=3, backoff=60)
    def rate_limited(ctx: errands.Context) -> int:
        if ctx.attempt == 1:
            raise errands.Retry("rate limited by the API", after=timedelta(milliseconds=500))
        return ctx.attempt

    handle = rate_limited.enqueue()
    with worker_factory():
        # the job's own backoff is 60 s: finishing in time proves Retry(after=) was used
        assert handle.result(timeout=10) == 2

    job = handle.job()
    assert job.attempt == 2
    [error] = job.errors
    assert (error.attempt, error.type, error.message) == (1, "Retry", "rate limited by the API")
    # run_at was set by the retry, in the same statement that stamped the error
    assert seconds_between(job.run_at, error.at) == pytest.approx(0.5, abs=0.01)
    assert job.attempted_at is not None and job.attempted_at >= job.run_at


def test_a_retry_asked_for_past_a_year_waits_a_year(app: errands.App, worker_factory) -> None:
    """Retry(after=1e12) is clamped to a year, as a backoff is: it was stored as year
    ~33,700, and every listing of the store then failed to read it back as a date."""

    @app.job(name="retry.much_later", retries=3)
    def much_later() -> None:
        raise errands.Retry("come back in 30,000 years", after=1e12)

    handle = much_later.enqueue()
    with worker_factory():
        wait_until(lambda: handle.status() is JobState.RETRYABLE, what="retryable")
    job = handle.job()
    [error] = job.errors
    assert seconds_between(job.run_at, error.at) == pytest.approx(365 * 86400, abs=1)
    assert [j.id for j in app.jobs(limit=10)] == [job.id]  # reads back as a date


@pytest.mark.parametrize("after", [float("nan"), float("inf"), -1.0])
def test_a_retry_with_a_delay_that_is_not_a_finite_number_is_refused(after: float) -> None:
    with pytest.raises(ValueError, match="finite number >= 0"):
        errands.Retry("later", after=after)


def test_retry_request_on_the_last_attempt_goes_dead(app: errands.App, worker_factory) -> None:
    @app.job(name="retry.always_later", retries=1)
    def always_later() -> None:
        raise errands.Retry("not yet", after=0.05)

    handle = always_later.enqueue()
    with worker_factory(), pytest.raises(errands.JobFailed, match="not yet"):
        handle.result(timeout=10)

    job = handle.job()
    assert job.state is JobState.DEAD
    assert job.attempt == 2
    assert [e.attempt for e in job.errors] == [1, 2]


def test_permanent_outcome_is_dead_after_exactly_one_attempt(
    app: errands.App, worker_factory
) -> None:
    calls: list[int] = []

    @app.job(name="retry.permanent", retries=5, backoff=0.01)
    def doomed(ctx: errands.Context) -> None:
        calls.append(ctx.attempt)
        raise errands.Permanent("the account was closed")

    handle = doomed.enqueue()
    with worker_factory(), pytest.raises(errands.JobFailed, match="account was closed"):
        handle.result(timeout=10)

    assert calls == [1]
    job = handle.job()
    assert job.state is JobState.DEAD
    assert job.attempt == 1
    assert [(e.type, e.message) for e in job.errors] == [("Permanent", "the account was closed")]


def test_exception_listed_as_permanent_is_dead_after_exactly_one_attempt(
    app: errands.App, worker_factory
) -> None:
    calls: list[int] = []

    @app.job(name="retry.charge", retries=5, backoff=0.01, permanent=(CardDeclined,))
    def charge(ctx: errands.Context, order_id: int) -> None:
        calls.append(ctx.attempt)
        raise CardDeclined(f"card declined for order {order_id}")

    handle = charge.enqueue(order_id=3)
    with worker_factory(), pytest.raises(errands.JobFailed) as failed:
        handle.result(timeout=10)

    assert calls == [1]
    assert failed.value.job_id == handle.id
    assert failed.value.last_error is not None
    assert failed.value.last_error["type"] == "CardDeclined"
    job = handle.job()
    assert job.state is JobState.DEAD
    assert job.attempt == 1
    assert len(job.errors) == 1


def test_exhausted_retries_go_dead_keeping_every_attempts_error(
    app: errands.App, worker_factory
) -> None:
    @app.job(name="retry.always_fails", retries=2, backoff=0.05)
    def always_fails(ctx: errands.Context) -> None:
        raise ValueError(f"bad input on attempt {ctx.attempt}")

    handle = always_fails.enqueue()
    with worker_factory() as worker, pytest.raises(errands.JobFailed, match="attempt 3"):
        handle.result(timeout=10)

    job = handle.job()
    assert job.state is JobState.DEAD
    assert job.attempt == job.max_attempts == 3
    assert len(job.errors) == 3
    for number, error in enumerate(job.errors, start=1):
        assert error.attempt == number
        assert error.type == "ValueError"
        assert error.message == f"bad input on attempt {number}"
        assert error.traceback is not None
        assert error.traceback.startswith("Traceback (most recent call last)")
        assert "in always_fails" in error.traceback
        assert f"ValueError: bad input on attempt {number}" in error.traceback
        assert error.worker == worker.id
    stamps = [e.at for e in job.errors]
    assert stamps == sorted(stamps)
    assert job.finished_at is not None


def test_default_backoff_records_delays_of_2_4_and_8_seconds_with_jitter(
    app: errands.App, worker_factory
) -> None:
    """The default policy (retries=3): 2 s, 4 s, 8 s ±25 %, then dead.

    The delays are read from the row (run_at minus the error's time, both written by the
    same statement); instead of waiting 14 s, a test-only time warp makes the job due.
    """

    @app.job(name="retry.default_policy")
    def broken() -> None:
        raise RuntimeError("still broken")

    handle = broken.enqueue()
    expected = [(1.5, 2.5), (3.0, 5.0), (6.0, 10.0)]
    with worker_factory():
        for failures, (low, high) in enumerate(expected, start=1):
            job = wait_until(
                lambda n=failures: (
                    (j := handle.job()).state is JobState.RETRYABLE and len(j.errors) == n and j
                ),
                what=f"failure number {failures}",
            )
            delay = seconds_between(job.run_at, job.errors[-1].at)
            assert low <= delay <= high, f"retry {failures}: delay {delay:.3f} s"
            assert job.attempt == failures
            time_warp(app, handle.id)
        with pytest.raises(errands.JobFailed):
            handle.result(timeout=10)

    job = handle.job()
    assert job.state is JobState.DEAD
    assert job.attempt == job.max_attempts == 4
    assert [e.attempt for e in job.errors] == [1, 2, 3, 4]
