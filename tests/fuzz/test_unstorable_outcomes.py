"""Outcomes a store cannot hold as given (DESIGN §5, §11). A handler that returns text
with a NUL character, stores it as a step, or raises an exception quoting one: PostgreSQL's
jsonb refuses \\u0000, and the worker's outcome write used to retry that batch forever,
wedging every job in it. Now the result and step are refused with a clear reason (dead,
like any result that is not JSON) and the error message is stored escaped; the worker
keeps serving the jobs around them. The same on SQLite, so payloads stay portable.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pydantic import BaseModel

import errands
from tests.conftest import running_worker

from .support import wait_until


@pytest.fixture(scope="module")
def app(store_url: str) -> Iterator[errands.App]:
    application = errands.App(store_url)

    @application.job(name="nul.result", retries=0)
    def returns_nul() -> dict[str, str]:
        return {"text": "before\x00after"}

    @application.job(name="nul.error", retries=0)
    def raises_nul() -> None:
        raise ValueError("bad byte \x00 in the input")

    @application.job(name="nul.step", retries=0)
    def steps_nul(ctx: errands.Context) -> str:
        return str(ctx.step("read", lambda: "a\x00b"))

    @application.job(name="nul.fine", retries=0)
    def fine(n: int) -> int:
        return n * 2

    application.migrate()
    yield application
    application.close()


def test_unstorable_results_steps_and_errors_end_dead_and_the_worker_keeps_serving(
    app: errands.App,
) -> None:
    registry = app.registry
    bad = {name: registry[name].enqueue().id for name in ("nul.result", "nul.error", "nul.step")}
    good = [registry["nul.fine"].enqueue(n=n).id for n in range(5)]

    def settled() -> bool:
        return all(
            app.get_job(i).state.value in ("dead", "completed") for i in [*bad.values(), *good]
        )

    with running_worker(app, concurrency=2, poll_interval=0.02):
        wait_until(settled, 30, "every job to settle (a wedged outcome write never does)")

    assert [app.get_job(i).result for i in good] == [0, 2, 4, 6, 8]
    result = app.get_job(bad["nul.result"])
    assert result.state.value == "dead"
    assert "NUL character" in result.errors[-1].message and "text" in result.errors[-1].message
    error = app.get_job(bad["nul.error"])
    assert error.state.value == "dead"
    assert error.errors[-1].message == "bad byte \\x00 in the input"
    step = app.get_job(bad["nul.step"])
    assert step.state.value == "dead" and step.errors[-1].type == "StepError"
    assert "step 'read'" in step.errors[-1].message and "NUL" in step.errors[-1].message
    assert app.job_steps(step.id) == []


class Reading(BaseModel):
    ratio: float


def test_a_result_holding_nan_or_infinity_ends_dead_naming_where_not_stored_as_null(
    store_url: str,
) -> None:
    """A handler whose result holds a NaN or an infinity (in a dict, a model, alone) was
    completed with that number stored as null: whoever read the result got None,
    silently. It ends dead (permanent) naming where the number is, as a ctx.step result,
    a signal payload or an argument is refused; a result with a real null completes."""
    application = errands.App(store_url)

    @application.job(name="nan.dict", retries=3)
    def in_a_dict() -> dict[str, list[float]]:
        return {"values": [1.0, float("nan")]}

    @application.job(name="nan.model", retries=3)
    def in_a_model() -> Reading:
        return Reading(ratio=float("inf"))

    @application.job(name="nan.alone", retries=3)
    def alone() -> float:
        return float("-inf")

    @application.job(name="nan.none")
    def real_null() -> dict[str, float | None]:
        return {"ratio": None}

    try:
        handles = {h.name: h for h in (in_a_dict.enqueue(), in_a_model.enqueue(), alone.enqueue())}
        fine = real_null.enqueue()
        with running_worker(application, concurrency=2, poll_interval=0.02):
            assert fine.result(timeout=30) == {"ratio": None}
            wait_until(
                lambda: all(h.status().value == "dead" for h in handles.values()),
                30,
                "every non-finite result to end dead",
            )
        for name, where in (
            ("nan.dict", "values.1"),
            ("nan.model", "ratio"),
            ("nan.alone", "(value)"),
        ):
            job = handles[name].job()
            assert job.attempt == 1  # permanent: never retried
            [error] = job.errors
            assert error.type == "InvalidPayload"
            assert (
                f"the handler's result: {where}: a number that is NaN or infinite" in error.message
            )
    finally:
        application.close()


def test_a_result_holding_an_int_of_more_than_4300_digits_ends_dead_naming_where(
    store_url: str,
) -> None:
    """pydantic writes such an int, and no JSON reader takes it back: the job completed,
    and its result was read back as the JSON text, a str. It ends dead (permanent, as a
    result holding a NaN) naming where; an int of 4,300 digits completes."""
    application = errands.App(store_url)

    @application.job(name="huge.result", retries=3)
    def huge() -> dict[str, list[int]]:
        return {"counts": [1, 10**4400]}

    @application.job(name="huge.fits")
    def fits() -> int:
        return 10**4299  # 4,300 digits

    try:
        handle, fine = huge.enqueue(), fits.enqueue()
        with running_worker(application, poll_interval=0.02):
            assert fine.result(timeout=30) == 10**4299
            wait_until(lambda: handle.status().value == "dead", 30, "the job to end dead")
        job = handle.job()
        [error] = job.errors
        assert (job.attempt, error.type) == (1, "InvalidPayload")
        assert error.message.startswith(
            "huge.result: the handler's result: counts.1: an int of more than 4,300 digits"
        ), error.message
    finally:
        application.close()
