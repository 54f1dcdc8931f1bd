"""Steps an ``async def`` handler leaves running (``asyncio.gather`` does not cancel the
siblings of a step that raised, a task it never awaited) end before its attempt is
decided, on SQLite and PostgreSQL, with a real worker: the attempt keeps its slot and
lease meanwhile, as a sync handler does until its thread returns, so the retry never
runs a step beside the one still going (I4: executions <= 1 + lease losses).

The attempt's failed outcome used to be recorded at once: the retry read the steps
before the first charge stored its result, and charged again beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import errands
from tests.conftest import running_worker

Make = Callable[..., Any]


def _gather_app(make_app: Make, first_charge_seconds: float) -> tuple[errands.App, Any, list[Any]]:
    """A job that charges and reserves at once with asyncio.gather; the reservation fails
    on the first attempt while the charge (``first_charge_seconds`` long on the first
    attempt, 0.1 s on a later one) is still running."""
    app = make_app()
    marks: list[Any] = []  # (what, attempt, time.monotonic())

    @app.job(name="gathered", retries=2, backoff=0.01)
    async def gathered(ctx: errands.Context) -> str:
        marks.append(("handler", ctx.attempt, time.monotonic()))

        async def charge() -> str:
            marks.append(("charge started", ctx.attempt, time.monotonic()))
            try:
                await asyncio.sleep(first_charge_seconds if ctx.attempt == 1 else 0.1)
            finally:
                marks.append(("charge ended", ctx.attempt, time.monotonic()))
            return "ch_1"

        async def reserve() -> str:
            await asyncio.sleep(0.05)
            if ctx.attempt == 1:
                raise ConnectionError("inventory service blip")
            return "ok"

        charged, _ = await asyncio.gather(
            ctx.astep("charge", charge), ctx.astep("reserve", reserve)
        )
        return str(charged)

    return app, gathered, marks


def _when(marks: list[Any], what: str, attempt: int) -> float:
    [at] = [t for w, a, t in marks if (w, a) == (what, attempt)]
    return float(at)


def test_a_step_left_running_by_gather_ends_and_is_stored_before_the_retry_runs(
    make_app: Make,
) -> None:
    app, job, marks = _gather_app(make_app, first_charge_seconds=1.0)
    with running_worker(app):
        handle = job.enqueue()
        assert handle.result(timeout=60) == "ch_1"

    charges = [(w, a) for w, a, _ in marks if w.startswith("charge")]
    assert charges == [("charge started", 1), ("charge ended", 1)]  # once: stored, reused
    assert _when(marks, "handler", 2) > _when(marks, "charge ended", 1)
    steps = {s.name: s.attempt for s in app.job_steps(handle.id)}
    assert steps == {"charge": 1, "reserve": 2}
    [error] = handle.job().errors
    assert (error.attempt, error.type) == (1, "ConnectionError")


def test_a_step_left_running_past_abandon_after_is_cancelled_before_the_retry_runs(
    make_app: Make,
) -> None:
    """Not let run for ever: ``abandon_after`` after the handler ended, the step's task is
    cancelled and waited for; cut short, it runs again on the retry (as after a crash),
    never beside it."""
    app, job, marks = _gather_app(make_app, first_charge_seconds=600.0)
    with running_worker(app, abandon_after=0.5):
        handle = job.enqueue()
        assert handle.result(timeout=60) == "ch_1"

    charges = [(w, a) for w, a, _ in marks if w.startswith("charge")]
    assert charges == [
        ("charge started", 1), ("charge ended", 1), ("charge started", 2), ("charge ended", 2)
    ]  # fmt: skip
    assert _when(marks, "charge started", 2) > _when(marks, "charge ended", 1)
    assert _when(marks, "handler", 2) > _when(marks, "charge ended", 1)
    assert {s.name: s.attempt for s in app.job_steps(handle.id)} == {"charge": 2, "reserve": 2}


def test_a_step_called_by_a_task_after_its_handler_returned_is_refused_with_step_error(
    make_app: Make,
) -> None:
    """A task the handler never awaited calls a step after the handler returned: the job
    may run again by then (replayed, say), so the step's fn is not called, and the task
    gets a StepError saying why."""
    app = make_app()
    called: list[int] = []
    refused: list[BaseException] = []
    late_done = threading.Event()
    tasks: set[asyncio.Task[Any]] = set()

    @app.job(name="fire_and_forget", retries=0)
    async def fire_and_forget(ctx: errands.Context) -> str:
        async def late() -> None:
            await asyncio.sleep(0.3)
            # Kept, not raised: a task's exception never retrieved is logged with its
            # traceback when the task is collected, which on Python 3.11 (its ast.parse)
            # could break a parse under way in the main thread (a SystemError in pytest)
            try:
                await ctx.astep("late", lambda: called.append(1))
            except BaseException as exc:
                refused.append(exc)
            finally:
                late_done.set()

        tasks.add(asyncio.create_task(late()))  # (held: the loop keeps a weak reference)
        return "returned"

    with running_worker(app):
        handle = fire_and_forget.enqueue()
        assert handle.result(timeout=60) == "returned"
        assert late_done.wait(30)

    assert called == []
    [exc] = refused
    assert isinstance(exc, errands.errors.StepError)
    assert "step 'late'" in str(exc) and "has ended" in str(exc) and "TaskGroup" in str(exc)
    assert app.job_steps(handle.id) == []


def test_a_step_that_ignores_its_cancel_is_abandoned_and_logged(
    make_app: Make, caplog: pytest.LogCaptureFixture
) -> None:
    """A step's task that catches the cancel and goes on is waited for no longer than
    ``abandon_after`` more: the attempt is then decided (logged at ERROR, naming the
    step), as a thread past its timeout is abandoned."""
    app = make_app()
    release = threading.Event()

    @app.job(name="stubborn", retries=0)
    async def stubborn(ctx: errands.Context) -> None:
        async def hold() -> None:
            while not release.is_set():
                with contextlib.suppress(asyncio.CancelledError):  # ignores it
                    await asyncio.sleep(0.05)

        async def fail() -> None:
            raise ValueError("sibling failed")

        await asyncio.gather(ctx.astep("hold", hold), ctx.astep("fail", fail))

    caplog.set_level(logging.ERROR, logger="errands.worker")
    try:
        with running_worker(app, abandon_after=0.3):
            handle = stubborn.enqueue()
            with pytest.raises(errands.JobFailed):
                handle.result(timeout=60)
    finally:
        release.set()
    assert handle.job().last_error.type == "ValueError"
    assert any("'hold'" in r.getMessage() and "abandoned" in r.getMessage() for r in caplog.records)


def test_a_step_left_running_is_cancelled_at_the_jobs_timeout_and_the_attempt_times_out(
    make_app: Make,
) -> None:
    """The wait for a step left running stops at the job's timeout (the worker cancels the
    step then, as it cancels a handler), however long ``abandon_after`` is: the attempt
    is a timeout, and the retry runs after the cut-short step ended."""
    app = make_app()
    marks: list[Any] = []

    @app.job(name="timed_gather", retries=1, backoff=0.01, timeout=1.0)
    async def timed_gather(ctx: errands.Context) -> str:
        marks.append(("handler", ctx.attempt, time.monotonic()))

        async def charge() -> str:
            marks.append(("charge started", ctx.attempt, time.monotonic()))
            try:
                await asyncio.sleep(600 if ctx.attempt == 1 else 0.01)
            finally:
                marks.append(("charge ended", ctx.attempt, time.monotonic()))
            return "ch_1"

        async def fail_first() -> None:
            if ctx.attempt == 1:
                raise ConnectionError("blip")

        charged, _ = await asyncio.gather(ctx.astep("charge", charge), ctx.astep("f", fail_first))
        return str(charged)

    with running_worker(app, abandon_after=300):
        handle = timed_gather.enqueue()
        assert handle.result(timeout=120) == "ch_1"  # not 300 s: cut at the timeout

    [error] = handle.job().errors
    assert (error.attempt, error.kind) == (1, "timeout")
    assert _when(marks, "charge started", 2) > _when(marks, "charge ended", 1)


def test_a_transaction_asked_for_by_a_task_after_its_handler_returned_is_refused(
    make_app: Make,
) -> None:
    """ctx.atransaction() from a task the handler never awaited, once the handler has
    returned: the transaction it opened was never committed nor rolled back (on SQLite
    its write lock stalled every later job of the file for good). Refused with
    TransactionEnded; the next job runs."""
    app = make_app()
    refused: list[BaseException] = []
    late_done = threading.Event()
    tasks: set[asyncio.Task[Any]] = set()

    @app.job(name="late_tx", retries=0)
    async def late_tx(ctx: errands.Context) -> str:
        async def late() -> None:
            await asyncio.sleep(0.3)
            try:
                await (await ctx.atransaction()).execute("SELECT 1")
            except BaseException as exc:
                refused.append(exc)
            finally:
                late_done.set()

        tasks.add(asyncio.create_task(late()))
        return "returned"

    @app.job(name="next_job")
    def next_job() -> str:
        return "ran"

    with running_worker(app):
        assert late_tx.enqueue().result(timeout=60) == "returned"
        assert late_done.wait(30)
        assert next_job.enqueue().result(timeout=60) == "ran"

    [exc] = refused
    assert isinstance(exc, errands.errors.TransactionEnded)
    assert "the attempt has ended" in str(exc) and "before the handler returns" in str(exc)


def test_a_step_called_by_a_thread_a_sync_handler_left_running_is_refused(
    make_app: Make,
) -> None:
    """The same for a sync handler: a thread it started and never joined calls ctx.step
    once the handler has returned and its outcome is recorded: refused with StepError,
    fn not called."""
    app = make_app()
    called: list[int] = []
    refused: list[BaseException] = []
    returned = threading.Event()
    late_done = threading.Event()

    @app.job(name="stray_thread", retries=0)
    def stray_thread(ctx: errands.Context) -> str:
        def late() -> None:
            returned.wait(30)
            try:
                ctx.step("late", lambda: called.append(1))
            except BaseException as exc:
                refused.append(exc)
            finally:
                late_done.set()

        threading.Thread(target=late, daemon=True).start()
        return "returned"

    with running_worker(app):
        handle = stray_thread.enqueue()
        assert handle.result(timeout=60) == "returned"
        returned.set()
        assert late_done.wait(30)

    assert called == []
    [exc] = refused
    assert isinstance(exc, errands.errors.StepError) and "has ended" in str(exc)
