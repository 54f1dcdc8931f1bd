"""A graceful stop whose grace period ends while a durable step runs, on SQLite and
PostgreSQL, with real workers in threads: the job is given back only once the step is
over (its result stored, so the next run does not call its fn again), or once it has
been waited for ``abandon_after`` after the worker asked it to stop (then abandoned,
logged), as the ordinary path holds an attempt whose steps still run. Meanwhile the
attempt keeps its lease, so no other worker runs the step beside it (I4).

The stop used to release the job at the end of the grace period with the step still
running: another worker took the job, found no stored result, and ran the step's effect
again, beside the first.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import errands
from errands import JobState
from tests.integration.helpers import WorkerThread, wait_until

Make = Callable[..., Any]

WAITING = "waiting for them to end"  # the stop's line while it holds the job for its step


def _waiting_logged(caplog: pytest.LogCaptureFixture) -> bool:
    return any(WAITING in r.getMessage() for r in caplog.records)


def _held_or_released(caplog: pytest.LogCaptureFixture, handle: errands.JobHandle) -> bool:
    """The stop is waiting for the step (the fix), or the job left ``running`` (released
    with its step still running: the defect)."""
    return _waiting_logged(caplog) or handle.status() is not JobState.RUNNING


def test_an_async_step_running_at_the_end_of_the_grace_period_ends_before_the_job_is_released(
    make_app: Make, caplog: pytest.LogCaptureFixture
) -> None:
    """The step's fn goes on through the cancel (a payment call that must not be cut in
    half): the job stays leased to the stopping worker until the step has stored its
    result, and the next worker's run reuses it: one charge."""
    app = make_app()
    charges: list[int] = []  # the attempt of each charge begun
    finish = threading.Event()

    @app.job(name="stop.charge", retries=0)
    async def charge_order(ctx: errands.Context) -> str:
        async def charge() -> str:
            charges.append(ctx.attempt)
            while not finish.is_set():  # the provider's answer; a cancel does not stop it
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(0.01)
            return f"ch_{len(charges)}"

        return str(await ctx.astep("charge", charge))

    caplog.set_level(logging.INFO, logger="errands.worker")
    first = WorkerThread(app, grace=0.2, abandon_after=300).start()
    workers = [first]
    try:
        handle = charge_order.enqueue()
        wait_until(lambda: charges == [1], timeout=30, what="the first charge begun")
        first.worker.stop()  # like SIGTERM; the grace period ends with the charge running
        wait_until(lambda: _held_or_released(caplog, handle), timeout=30, what="held or not")
        assert handle.status() is JobState.RUNNING, "released while its step still ran"

        workers.append(WorkerThread(app).start())  # would take the job if given back now
        finish.set()
        assert handle.result(timeout=60) == "ch_1"
    finally:
        finish.set()
        for worker in workers:
            worker.stop()

    assert charges == [1]  # once: the step's stored result served the next run
    job = handle.job()
    assert [(e.kind, e.attempt) for e in job.errors] == [("released", 1)]
    assert job.attempt == 1  # the release was not charged
    assert {s.name: s.attempt for s in app.job_steps(handle.id)} == {"charge": 1}


@pytest.mark.parametrize("goes_on", ["shield", "to_thread", "run_in_executor"])
def test_an_async_step_whose_effect_outlives_its_cancel_holds_its_job_until_the_effect_ends(
    make_app: Make, caplog: pytest.LogCaptureFixture, goes_on: str
) -> None:
    """The step's fn runs its effect where the stop's cancel does not reach it: under
    ``asyncio.shield(...)`` (the cancel ends the step's frame, the shielded task goes on),
    or in a thread (``asyncio.to_thread``, ``loop.run_in_executor`` on an executor of its
    own: a thread cannot be stopped, only the waiting for it). The step is running for as
    long as that effect is: the job stays leased to the stopping worker until it is over,
    and the next run (which calls fn again: the step was cut short, nothing stored)
    begins after it, never beside it. The step counted as over once its frame was
    cancelled: the job was given back at once, and the next worker ran the effect again
    while the first one still ran."""
    app = make_app()
    began: list[float] = []
    ended: list[float] = []
    finish = threading.Event()
    own_pool = ThreadPoolExecutor(1, thread_name_prefix="test-own-pool")

    def provider_call() -> str:  # in a thread: blocking, uninterruptible
        began.append(time.monotonic())
        try:
            if len(began) == 1:
                finish.wait(120)
            return f"ch_{len(began)}"
        finally:
            ended.append(time.monotonic())

    async def provider_call_async() -> str:  # a coroutine the cancel never reaches
        began.append(time.monotonic())
        try:
            while len(began) == 1 and not finish.is_set():
                await asyncio.sleep(0.01)
            return f"ch_{len(began)}"
        finally:
            ended.append(time.monotonic())

    @app.job(name=f"stop.goes_on_{goes_on}", retries=0)
    async def charge_order(ctx: errands.Context) -> str:
        async def charge() -> str:
            if goes_on == "shield":
                return await asyncio.shield(provider_call_async())
            if goes_on == "to_thread":
                return await asyncio.to_thread(provider_call)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(own_pool, provider_call)

        return str(await ctx.astep("charge", charge))

    caplog.set_level(logging.INFO, logger="errands.worker")
    first = WorkerThread(app, grace=0.2, abandon_after=300).start()
    workers = [first]
    try:
        handle = charge_order.enqueue()
        wait_until(lambda: len(began) == 1, timeout=30, what="the first charge begun")
        first.worker.stop()  # like SIGTERM; the grace period ends with the charge running
        wait_until(lambda: _held_or_released(caplog, handle), timeout=30, what="held or not")
        assert handle.status() is JobState.RUNNING, "released while its effect still ran"

        workers.append(WorkerThread(app).start())  # would take the job if given back now
        time.sleep(0.3)  # (a second charge would begin meanwhile)
        assert len(began) == 1, "the job ran again while its first charge still ran"
        finish.set()
        assert handle.result(timeout=60) == "ch_2"
    finally:
        finish.set()
        for worker in workers:
            worker.stop()
        own_pool.shutdown(wait=False)

    # Cut short (its frame cancelled, nothing stored), the step ran again on the next
    # run: after the first charge had ended, never beside it
    assert len(began) == 2 and len(ended) == 2
    assert began[1] >= ended[0]
    job = handle.job()
    assert [(e.kind, e.attempt) for e in job.errors] == [("released", 1)]
    assert job.attempt == 1


def test_a_step_cut_short_runs_until_the_work_it_started_ends_or_is_held_where_unseen(
    make_app: Make,
) -> None:
    """The accounting under the test above: an async step whose fn is cancelled while a
    shielded task it started goes on is in flight until that task is over, on the
    worker's loop (which counts each step's tasks and threads). On a loop that does not
    count them (not the worker's), the work may go on unseen: the step cut short by a
    cancel stays in flight for good (a graceful stop then keeps its job until
    ``abandon_after``, as a hung step's)."""
    from errands.backends.base import ClaimParams, QueueClaim
    from errands.worker.execution import Attempt
    from errands.worker.runners import LoopRunner
    from errands.worker.runtime import AttemptRuntime

    app = make_app()

    @app.job(name="stop.counted")
    async def counted() -> None: ...

    counted.enqueue()
    counted.enqueue()
    claim = ClaimParams([QueueClaim("default", 2)], 2, "w-test", 30.0)
    runtimes = []
    for row in app.backend.job_claim(claim):
        attempt = Attempt(row=row, definition=counted, lease_seconds=30.0)
        attempt.runtime = AttemptRuntime(app, attempt)
        runtimes.append(attempt.runtime)
    on_workers_loop, elsewhere = runtimes

    async def cut_short(runtime: Any, finish: threading.Event) -> list[str]:
        """The step cancelled while its shielded effect runs: the steps in flight then,
        and once the effect is over."""
        began = asyncio.Event()

        async def effect() -> None:
            began.set()
            while not finish.is_set():
                await asyncio.sleep(0.01)

        async def charge() -> None:
            await asyncio.shield(effect())

        step = asyncio.ensure_future(runtime.astep("charge", charge))
        await began.wait()
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
        return list(runtime.steps_in_flight())

    runner = LoopRunner(name="test-loop")
    finish = threading.Event()
    try:
        cut = runner.submit(lambda: cut_short(on_workers_loop, finish)).result(30)
        assert cut == ["charge"]  # its frame is gone, its shielded effect runs on
        finish.set()
        wait_until(lambda: not on_workers_loop.steps_in_flight(), timeout=30, what="over")
    finally:
        finish.set()
        runner.shutdown()

    async def unseen() -> list[str]:
        done = threading.Event()
        cut = await cut_short(elsewhere, done)
        assert cut == ["charge"]
        done.set()
        await asyncio.sleep(0.1)  # the effect is over, but this loop never said so
        return list(elsewhere.steps_in_flight())

    assert asyncio.run(unseen()) == ["charge"]


def test_a_sync_step_blocked_past_the_interrupt_ends_before_the_job_is_released(
    make_app: Make, caplog: pytest.LogCaptureFixture
) -> None:
    """A sync handler's step blocked where HandlerInterrupt cannot reach it (a C call; here
    a shielded wait, so that the interrupt lands only once the wait is over, whenever the
    thread gets there): the job is not given back while the call runs. Cut short by the
    interrupt once the call returns, the step runs again on the next run, after the
    first, never beside it (or, stored before the interrupt lands, it is reused)."""
    app = make_app()
    began: list[tuple[int, float]] = []
    ended: list[tuple[int, float]] = []
    answer = threading.Event()

    @app.job(name="stop.sync_charge", retries=0)
    def sync_charge(ctx: errands.Context) -> str:
        def charge() -> str:
            began.append((ctx.attempt, time.monotonic()))
            try:
                if ctx.attempt == 1 and len(began) == 1:
                    with errands.shielded():  # the interrupt lands when the wait is over
                        answer.wait(120)
                return "ch"
            finally:
                ended.append((ctx.attempt, time.monotonic()))

        return str(ctx.step("charge", charge))

    caplog.set_level(logging.INFO, logger="errands.worker")
    first = WorkerThread(app, grace=0.2, abandon_after=300).start()
    workers = [first]
    try:
        handle = sync_charge.enqueue()
        wait_until(lambda: len(began) == 1, timeout=30, what="the first charge begun")
        first.worker.stop()
        workers.append(WorkerThread(app).start())  # would take the job if given back now
        wait_until(
            lambda: _waiting_logged(caplog) or len(began) > 1,
            timeout=30,
            what="the stop waiting for the step, or a second charge",
        )
        assert len(began) == 1, "the job ran again while its first charge still ran"
        answer.set()
        assert handle.result(timeout=60) == "ch"
    finally:
        answer.set()
        for worker in workers:
            worker.stop()

    # Either the interrupt cut it short (after the shield; it runs again on the next run,
    # after the first), or it landed once the result was stored (the next run reuses it)
    assert 1 <= len(began) <= 2
    if len(began) == 2:
        assert began[1][1] >= ended[0][1]  # after the first, never beside it
    job = handle.job()
    assert [(e.kind, e.attempt) for e in job.errors] == [("released", 1)]
    assert job.attempt == 1


def test_a_step_still_running_abandon_after_past_the_stop_is_abandoned_and_its_job_released(
    make_app: Make, caplog: pytest.LogCaptureFixture
) -> None:
    """Not waited for without end: a step that ignores its cancel is abandoned
    ``abandon_after`` after the worker asked it to stop (logged at ERROR, naming it), and
    its job given back uncharged, as the ordinary path abandons it."""
    app = make_app()
    release = threading.Event()
    began = threading.Event()

    @app.job(name="stop.stubborn", retries=0)
    async def stubborn(ctx: errands.Context) -> None:
        async def hold() -> None:
            began.set()
            while not release.is_set():
                with contextlib.suppress(asyncio.CancelledError):  # ignores it
                    await asyncio.sleep(0.01)

        await ctx.astep("hold", hold)

    caplog.set_level(logging.INFO, logger="errands.worker")
    worker = WorkerThread(app, grace=0.2, abandon_after=0.5).start()
    handle = stubborn.enqueue()
    try:
        assert began.wait(30)
        worker.stop()
    finally:
        release.set()

    job = handle.job()
    assert (job.state, job.attempt) == (JobState.AVAILABLE, 0)
    assert [(e.kind, e.attempt) for e in job.errors] == [("released", 1)]
    assert _waiting_logged(caplog)
    assert any(
        r.levelno == logging.ERROR and "'hold'" in r.getMessage() and "abandoned" in r.getMessage()
        for r in caplog.records
    )


def test_a_job_past_its_timeout_at_the_stop_has_it_recorded_only_once_its_step_is_over(
    make_app: Make, caplog: pytest.LogCaptureFixture
) -> None:
    """A job past its timeout when the grace period ends is recorded as its timeout, never
    released; one whose step still runs is recorded only once the step is over (at its
    timeout's ``abandon_after`` at the latest, as without the stop), so its retry never
    runs the step beside it. It was recorded at once: the retry ran after its backoff
    while the first call still ran."""
    app = make_app()
    began: list[tuple[int, float]] = []
    ended: list[tuple[int, float]] = []
    answer = threading.Event()

    @app.job(name="stop.timed_charge", retries=1, backoff=0.01, timeout=0.5)
    def timed_charge(ctx: errands.Context) -> str:
        def charge() -> str:
            began.append((ctx.attempt, time.monotonic()))
            try:
                if len(began) == 1:
                    with errands.shielded():  # the interrupt lands when the wait is over
                        answer.wait(120)
                return "ch"
            finally:
                ended.append((ctx.attempt, time.monotonic()))

        return str(ctx.step("charge", charge))

    caplog.set_level(logging.INFO, logger="errands.worker")
    first = WorkerThread(app, grace=0.2, abandon_after=300).start()
    workers = [first]
    try:
        handle = timed_charge.enqueue()
        wait_until(lambda: len(began) == 1, timeout=30, what="the first charge begun")
        wait_until(
            lambda: any(a.timed_out for a in first.worker.attempts()),
            timeout=30,
            what="the job past its timeout",
        )
        first.worker.stop()
        workers.append(WorkerThread(app).start())  # would run the retry once it is due
        wait_until(
            lambda: _waiting_logged(caplog) or len(began) > 1,
            timeout=30,
            what="the stop waiting for the step, or a second charge",
        )
        assert len(began) == 1, "the job ran again while its first charge still ran"
        assert handle.status() is JobState.RUNNING
        answer.set()
        assert handle.result(timeout=60) == "ch"
    finally:
        answer.set()
        for worker in workers:
            worker.stop()

    assert 1 <= len(began) <= 2
    if len(began) == 2:
        assert began[1][1] >= ended[0][1]  # after the first, never beside it
    [error] = handle.job().errors
    assert (error.kind, error.attempt) == ("timeout", 1)


def test_a_handler_that_stops_when_asked_is_given_back_uncharged_while_another_jobs_step_runs(
    make_app: Make, caplog: pytest.LogCaptureFixture
) -> None:
    """Two jobs run as the grace period ends: one stops at once when asked (it returns on
    ctx.cancelled), the other is inside a durable step that goes on. The first is given
    back (released, uncharged) as soon as it is over, not held for the other's step; and
    never charged a timeout that comes after it stopped. It was held, undecided with its
    deadline armed, until the other's step ended: its timeout came meanwhile, the lease
    keeper fired it, and the stop recorded it (here its last attempt: dead)."""
    app = make_app()
    stopped_early = threading.Event()
    in_step = threading.Event()
    finish = threading.Event()

    @app.job(name="stop.coop", retries=0, timeout=30)
    def coop(ctx: errands.Context) -> str:
        while not ctx.cancelled:
            time.sleep(0.01)
        stopped_early.set()
        return "stopped early"

    @app.job(name="stop.stepper", retries=3)
    def stepper(ctx: errands.Context) -> str:
        def charge() -> str:
            in_step.set()
            with errands.shielded():  # a provider call across the stop
                finish.wait(120)
            return "ch"

        return str(ctx.step("charge", charge))

    caplog.set_level(logging.INFO, logger="errands.worker")
    worker = WorkerThread(app, grace=0.2, abandon_after=300, concurrency=2, prefetch=0).start()
    stopper = threading.Thread(target=worker.stop, kwargs={"timeout": 120})
    try:
        handle = coop.enqueue()
        other = stepper.enqueue()
        wait_until(lambda: handle.status() is JobState.RUNNING, timeout=30, what="coop began")
        assert in_step.wait(30)
        stopper.start()  # like SIGTERM

        def coop_timed_out() -> bool:
            return any(a.timed_out for a in worker.worker.attempts() if a.id == handle.id)

        wait_until(
            lambda: handle.status() is not JobState.RUNNING or coop_timed_out(),
            timeout=90,
            what="the stopped job given back (or its timeout fired while it was held)",
        )
        assert stopped_early.is_set()
        assert other.status() is JobState.RUNNING  # its step still runs: held
    finally:
        finish.set()
        if stopper.ident is not None:
            stopper.join(120)
        else:
            worker.stop()

    job = handle.job()
    assert (job.state, job.attempt) == (JobState.AVAILABLE, 0), job.errors
    assert [e.kind for e in job.errors] == ["released"]
    other_job = other.job()
    assert (other_job.state, other_job.attempt) == (JobState.AVAILABLE, 0)


# -- a step's fn that ended on its own: its leftovers are its own background work -------
ABANDONED = "abandoned"  # the ERROR of a step given up on (settle_steps, the stop)


def _abandoned_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.ERROR and ABANDONED in r.getMessage()
    ]


async def _refresher(ticks: list[float]) -> None:
    """A client library's background task (a token refresher, a keepalive): lives on."""
    while True:
        ticks.append(time.monotonic())
        await asyncio.sleep(0.05)


def test_a_handler_that_catches_a_failed_step_whose_fn_left_a_task_running_ends_at_once(
    make_app: Make, caplog: pytest.LogCaptureFixture
) -> None:
    """A step's fn lazily starts a long-lived task (a client's token refresher) and then
    raises its own error; the handler catches it and succeeds through a fallback step.
    The step ended on its own (not cut short by a cancel): what it left running is its
    background work, not its effect still going on, so the job completes at once. The
    step was held while the refresher lived: the successful job waited 2 x abandon_after
    (here 40 s) and an ERROR said the step was abandoned."""
    app = make_app()
    ticks: list[float] = []
    background: list[asyncio.Task[None]] = []

    @app.job(name="steps.caught", retries=0)
    async def caught(ctx: errands.Context) -> str:
        async def primary() -> str:
            if not background:  # the client starts its refresher on first use
                background.append(asyncio.get_running_loop().create_task(_refresher(ticks)))
            raise ConnectionError("primary down")

        async def fallback() -> str:
            return "fallback-ok"

        try:
            return str(await ctx.astep("primary", primary))
        except ConnectionError:
            return str(await ctx.astep("fallback", fallback))

    caplog.set_level(logging.INFO, logger="errands.worker")
    worker = WorkerThread(app, abandon_after=20).start()
    try:
        handle = caught.enqueue()
        # well under abandon_after (20 s): not held for the refresher
        assert handle.result(timeout=10) == "fallback-ok"
        assert not background[0].done()  # the refresher lives on, as the client meant
    finally:
        worker.stop(timeout=120)
    assert _abandoned_logged(caplog) == []


def test_a_step_that_raised_is_retried_at_once_though_its_fn_left_a_task_running(
    make_app: Make, caplog: pytest.LogCaptureFixture
) -> None:
    """The step's fn starts a long-lived task and raises; the handler lets the error
    through: the attempt fails at once and its retry runs after its backoff, not
    2 x abandon_after later (with an ERROR saying the step was abandoned)."""
    app = make_app()
    ticks: list[float] = []
    background: list[asyncio.Task[None]] = []

    @app.job(name="steps.retried", retries=1, backoff=0.01)
    async def retried(ctx: errands.Context) -> str:
        async def call_api() -> str:
            if not background:
                background.append(asyncio.get_running_loop().create_task(_refresher(ticks)))
            if ctx.attempt == 1:
                raise ConnectionError("api blip")
            return "ok"

        return str(await ctx.astep("api", call_api))

    caplog.set_level(logging.INFO, logger="errands.worker")
    worker = WorkerThread(app, abandon_after=20).start()
    try:
        handle = retried.enqueue()
        assert handle.result(timeout=10) == "ok"  # well under abandon_after (20 s)
    finally:
        worker.stop(timeout=120)
    assert [e.type for e in handle.job().errors] == ["ConnectionError"]
    assert _abandoned_logged(caplog) == []


def test_a_long_lived_task_a_steps_fn_started_keeps_no_attempt_alive(make_app: Make) -> None:
    """The task a step's fn started (a refresher living as long as the process) inherits
    the step's context variable: it referred to the step, which referred to its attempt's
    runtime, and every such attempt stayed in memory for as long as its task lived."""
    app = make_app()
    ticks: list[float] = []
    background: list[asyncio.Task[None]] = []
    runtimes: list[weakref.ref[Any]] = []

    @app.job(name="steps.leaves_a_task", retries=0)
    async def leaves_a_task(ctx: errands.Context) -> str:
        runtimes.append(weakref.ref(ctx._runtime))

        async def connect() -> str:
            background.append(asyncio.get_running_loop().create_task(_refresher(ticks)))
            return "connected"

        return str(await ctx.astep("connect", connect))

    worker = WorkerThread(app).start()
    try:
        for _ in range(2):  # (the worker may hold on to its latest attempt a while)
            assert leaves_a_task.enqueue().result(timeout=30) == "connected"

        def first_runtime_gone() -> bool:
            gc.collect()
            return runtimes[0]() is None

        wait_until(first_runtime_gone, timeout=10, what="the first attempt's runtime freed")
        assert not any(task.done() for task in background)  # while the tasks live on
    finally:
        worker.stop(timeout=120)


def test_a_step_cut_short_has_the_tasks_its_fn_left_running_cancelled_at_abandon_after(
    make_app: Make, caplog: pytest.LogCaptureFixture
) -> None:
    """The handler gives up on a step (asyncio.wait_for around it) whose fn runs its
    effect under asyncio.shield: the step is held while that task runs, and at the cancel
    point (abandon_after after the handler ended) that task is cancelled too, and waited
    for: the job completes without abandoning anything. Only the step's own task was
    cancelled there (long over): the second wait waited for nothing, and the step was
    abandoned (logged at ERROR) with its task still running."""
    app = make_app()
    began = threading.Event()
    stopped: list[str] = []

    async def effect() -> None:
        began.set()
        try:
            while True:
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            stopped.append("cancelled")
            raise

    @app.job(name="steps.gave_up_on", retries=0)
    async def gave_up_on(ctx: errands.Context) -> str:
        async def charge() -> None:
            await asyncio.shield(effect())

        try:
            await asyncio.wait_for(ctx.astep("charge", charge), 0.1)
        except TimeoutError:
            return "gave up"
        return "charged"

    caplog.set_level(logging.INFO, logger="errands.worker")
    worker = WorkerThread(app, abandon_after=0.5).start()
    try:
        handle = gave_up_on.enqueue()
        assert handle.result(timeout=30) == "gave up"
    finally:
        worker.stop(timeout=120)
    assert began.is_set()
    assert stopped == ["cancelled"]
    assert _abandoned_logged(caplog) == []


def test_a_step_cut_short_after_the_loops_task_factory_was_replaced_is_held_as_running(
    make_app: Make,
) -> None:
    """A handler or a library replaced the worker loop's task factory
    (``loop.set_task_factory``): the tasks a step's fn starts are not counted from then
    on. A step cut short by a cancel on that loop is held as possibly running, as on a
    loop errands does not run. It counted as over as soon as its frame was: its shielded
    effect went on unseen, and a graceful stop gave its job back beside it."""
    from errands.backends.base import ClaimParams, QueueClaim
    from errands.worker.execution import Attempt
    from errands.worker.runners import LoopRunner
    from errands.worker.runtime import AttemptRuntime

    app = make_app()

    @app.job(name="steps.factory_replaced")
    async def factory_replaced() -> None: ...

    factory_replaced.enqueue()
    claim = ClaimParams([QueueClaim("default", 1)], 1, "w-test", 30.0)
    [row] = app.backend.job_claim(claim)
    attempt = Attempt(row=row, definition=factory_replaced, lease_seconds=30.0)
    runtime = attempt.runtime = AttemptRuntime(app, attempt)

    async def cut_short(finish: threading.Event) -> list[str]:
        asyncio.get_running_loop().set_task_factory(None)  # a library's doing
        began = asyncio.Event()

        async def effect() -> None:
            began.set()
            while not finish.is_set():
                await asyncio.sleep(0.01)

        async def charge() -> None:
            await asyncio.shield(effect())

        step = asyncio.ensure_future(runtime.astep("charge", charge))
        await began.wait()
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
        finish.set()
        await asyncio.sleep(0.1)  # the effect is over, but this loop counted nothing
        return list(runtime.steps_in_flight())

    runner = LoopRunner(name="test-loop")
    finish = threading.Event()
    try:
        assert runner.submit(lambda: cut_short(finish)).result(30) == ["charge"]
    finally:
        finish.set()
        runner.shutdown()
