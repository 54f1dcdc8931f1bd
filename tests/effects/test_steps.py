"""``ctx.step``: a step's result is stored once and comes back on every later run.

On SQLite and PostgreSQL, through ``errands.testing`` (the real worker code, the clock
moved instead of sleeping): retries, rescues after a crash and DLQ replays get the stored
result without calling fn again; ``fresh`` replays forget it (audited); misuse is a
permanent, clearly named StepError; steps show in ``errands jobs show``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

import errands
from errands.errors import StepError
from errands.testing import Tester
from tests.conftest import needs_boottime, running_worker, suspend_host

Make = Callable[..., Any]


def _charging_app(
    make_app: Make, fail_on: set[int] | None = None, permanent: bool = False
) -> tuple[errands.App, Any, list[int]]:
    """An app whose job charges through a step, then fails on the attempts in ``fail_on``
    (with Permanent, straight to the DLQ, when ``permanent``) while ``fail`` is set."""
    app = make_app()
    calls: list[int] = []
    fail = {"on": set(fail_on or ())}

    def charge(order_id: int) -> dict[str, Any]:
        calls.append(order_id)
        return {"charge": f"ch_{order_id}_{len(calls)}"}

    @app.job(name="charge_order", retries=3, backoff=5.0)
    def charge_order(ctx: errands.Context, order_id: int) -> dict[str, Any]:
        charged = ctx.step("charge", charge, order_id)
        if ctx.attempt in fail["on"]:
            if permanent:
                raise errands.Permanent("the receipt service refused")
            raise RuntimeError("failed after the charge")
        return dict(charged)

    charge_order.fail = fail  # type: ignore[attr-defined]
    return app, charge_order, calls


def test_stored_step_is_returned_on_retry_without_running_fn_again(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    app, job, calls = _charging_app(make_app, fail_on={1, 2})
    tester = errands_testing(app)
    handle = job.enqueue(order_id=7)

    drained = tester.drain()

    assert drained.outcomes == {"retryable": 2, "completed": 1}
    assert drained.advanced > 9  # two backoffs of 5 s, passed on the test clock
    assert calls == [7]
    assert handle.result(timeout=1) == {"charge": "ch_7_1"}
    [step] = app.job_steps(handle.id)
    assert (step.name, step.result, step.attempt) == ("charge", {"charge": "ch_7_1"}, 1)


def test_stored_step_is_returned_after_a_crash_and_rescue(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    app, job, calls = _charging_app(make_app)
    tester = errands_testing(app)
    tester.crash_after_step(job, "charge")
    handle = job.enqueue(order_id=8)

    drained = tester.drain()

    assert [r.outcome for r in drained.runs] == ["crashed", "completed"]
    assert drained.rescued == 1
    assert calls == [8]
    done = handle.job()
    assert done.state is errands.JobState.COMPLETED
    assert done.result == {"charge": "ch_8_1"}
    assert [(e.attempt, e.kind) for e in done.errors] == [(1, "worker_lost")]


def test_replay_keeps_stored_steps_and_fresh_replay_runs_them_again_audited(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    app, job, calls = _charging_app(make_app, fail_on={1}, permanent=True)
    tester = errands_testing(app)
    handle = job.enqueue(order_id=9)
    assert tester.drain().dead == 1
    assert calls == [9]

    app.replay([handle.id], actor="test")  # keeps the step: the charge is not made again
    assert tester.drain().dead == 1  # attempt 1 again, so it fails again after the step
    assert calls == [9]

    job.fail["on"].clear()
    app.replay([handle.id], fresh=True, actor="test")  # forgets the step
    assert tester.drain().completed == 1
    assert calls == [9, 9]
    assert handle.result(timeout=1) == {"charge": "ch_9_2"}
    replays = [e for e in reversed(app.audit(job_id=handle.id)) if e.action == "replay"]
    assert [e.detail for e in replays] == [{}, {"fresh": True}]


def test_fresh_replay_from_the_cli_is_audited(
    make_app: Make, errands_testing: Callable[..., Tester], store_url: str
) -> None:
    app, job, calls = _charging_app(make_app, fail_on={1}, permanent=True)
    tester = errands_testing(app)
    handle = job.enqueue(order_id=10)
    tester.drain()
    job.fail["on"].clear()

    done = _cli(store_url, "dlq", "replay", str(handle.id), "--fresh", "--actor", "ops")
    assert done.returncode == 0, done.stderr

    assert tester.drain().completed == 1
    assert calls == [10, 10]
    [event] = [e for e in app.audit(job_id=handle.id) if e.action == "replay"]
    assert (event.actor, event.detail) == ("ops", {"fresh": True})


def test_step_result_that_is_not_json_fails_the_job_permanently_with_a_step_error(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    app = make_app()

    @app.job(name="bad_result", retries=3)
    def bad_result(ctx: errands.Context) -> None:
        ctx.step("socket", object)

    _, message = _dead_with_a_step_error(app, errands_testing(app), bad_result)
    assert "step 'socket'" in message
    assert "cannot be stored as JSON" in message


def _dead_with_a_step_error(app: errands.App, tester: Tester, job: Any) -> tuple[int, str]:
    """Enqueue ``job`` and drain: it is dead at once (no retry: the step's effect would
    run again) with a StepError, and no step stored. Its id and the error's message."""
    handle = job.enqueue()
    drained = tester.drain()
    assert drained.outcomes == {"dead": 1}
    assert isinstance(drained.errors[0], StepError)
    error = handle.job().last_error
    assert error is not None and error.type == "StepError"
    assert app.job_steps(handle.id) == []
    return handle.id, error.message


def test_a_step_returning_nan_or_infinity_fails_the_job_permanently_naming_the_step(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    """A step's result holding NaN or infinity, which JSON cannot hold, is refused on
    both backends as a signal's payload is: a permanent StepError naming the step and
    where in its result, nothing stored, the effect run once. SQLite stored it as JSON
    no standard reader takes, and PostgreSQL's jsonb refused it with a raw driver error
    taken for a transient failure: each retry ran the step's effect again."""
    app = make_app()
    measured: list[int] = []

    def measure() -> dict[str, Any]:
        measured.append(1)
        return {"sensor": "t1", "readings": [20.5, float("nan")]}

    @app.job(name="nan_step", retries=3)
    def nan_step(ctx: errands.Context) -> None:
        ctx.step("measure", measure)

    job_id, message = _dead_with_a_step_error(app, errands_testing(app), nan_step)
    assert measured == [1]
    assert message == (
        f"step 'measure' of job {job_id}: its result: readings.1: a number that is NaN "
        "or infinite, which JSON cannot hold; use a finite number, null, or a string such "
        'as "inf"'
    )


@pytest.mark.parametrize("raised_limit", [False, True], ids=["default", "int_limit_raised"])
def test_a_step_returning_an_int_of_more_than_4300_digits_fails_permanently_naming_where(
    make_app: Make,
    errands_testing: Callable[..., Tester],
    raised_limit: bool,
) -> None:
    """pydantic writes such an int, no JSON reader takes it back (pydantic's, or Python's
    json by default): stored, it failed every later run of the job on PostgreSQL (each
    read of its steps), and SQLite handed the retry a string. Refused before it is
    stored, as a StepError naming the step and where, the effect run once; also when
    this process raised its own int limit (the store's other readers did not)."""
    previous = sys.get_int_max_str_digits()
    app = make_app()
    counted: list[int] = []

    def count() -> dict[str, Any]:
        counted.append(1)
        return {"ok": 10**4300 - 1, "rows": [1, -(10**4400)]}  # 4,300 digits pass

    @app.job(name="huge_step", retries=3)
    def huge_step(ctx: errands.Context) -> None:
        ctx.step("count", count)

    if raised_limit:
        sys.set_int_max_str_digits(0)  # no limit in this process
    try:
        job_id, message = _dead_with_a_step_error(app, errands_testing(app), huge_step)
    finally:
        sys.set_int_max_str_digits(previous)
    assert counted == [1]
    assert message.startswith(
        f"step 'count' of job {job_id}: its result: rows.1: an int of more than 4,300 "
        "digits, which cannot be read back from JSON; store it elsewhere"
    ), message


def test_step_name_used_twice_in_one_run_fails_the_job_with_a_step_error(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    app = make_app()
    sent: list[str] = []

    @app.job(name="two_mails", retries=3)
    def two_mails(ctx: errands.Context) -> None:
        ctx.step("send", sent.append, "first")
        ctx.step("send", sent.append, "second")

    tester = errands_testing(app)
    handle = two_mails.enqueue()
    assert tester.drain().dead == 1

    assert sent == ["first"]
    job = handle.job()
    assert job.last_error is not None
    assert job.last_error.type == "StepError"
    assert "used twice" in job.last_error.message
    assert [s.name for s in app.job_steps(handle.id)] == ["send"]


def test_a_step_named_like_a_signals_step_is_refused_with_a_configuration_error(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    """ctx.wait_for_signal(x) stores its payload as step 'signal:x': a step of that name
    was stored in its place, and every later wait for x returned the step's result, no
    signal sent (or the step returned a payload instead of calling fn). ctx.step and
    ctx.astep refuse such names, naming the reserved prefix; fn is not called."""
    app = make_app()
    called: list[str] = []
    refused: list[str] = []

    @app.job(name="reserved_sync", retries=3)
    def reserved_sync(ctx: errands.Context) -> Any:
        ctx.step("signal:approved", called.append, "sync")
        return ctx.wait_for_signal("approved")

    @app.job(name="reserved_async", retries=3)
    async def reserved_async(ctx: errands.Context) -> None:
        try:
            await ctx.astep("signal:approved", called.append, "async")
        except errands.ConfigurationError as exc:
            refused.append(str(exc))

    sync_handle = reserved_sync.enqueue()
    async_handle = reserved_async.enqueue()
    drained = errands_testing(app).drain()
    assert drained.outcomes == {"dead": 1, "completed": 1}
    assert called == []
    error = sync_handle.job().last_error
    assert error is not None and error.type == "ConfigurationError"
    [message] = refused
    for text in (error.message, message):
        assert text.startswith("ctx.step('signal:approved'): step names starting with 'signal:'")
        assert "give the step another name" in text
    assert app.job_steps(sync_handle.id) == app.job_steps(async_handle.id) == []


def test_async_handler_steps_are_stored_and_not_run_again(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    app = make_app()
    calls: list[int] = []

    async def lookup(n: int) -> int:
        calls.append(n)
        return n * 2

    @app.job(name="async_steps", retries=2, backoff=1.0)
    async def async_steps(ctx: errands.Context, n: int) -> int:
        doubled = await ctx.astep("lookup", lookup, n)
        tripled = await ctx.astep("sync_fn", lambda: n * 3)
        if ctx.attempt == 1:
            raise RuntimeError("after both steps")
        return int(doubled) + int(tripled)

    tester = errands_testing(app)
    handle = async_steps.enqueue(n=5)
    assert tester.drain().outcomes == {"retryable": 1, "completed": 1}
    assert calls == [5]
    assert handle.result(timeout=1) == 25
    assert {s.name: s.result for s in app.job_steps(handle.id)} == {"lookup": 10, "sync_fn": 15}


def test_a_plain_step_fn_of_an_async_handler_runs_off_the_event_loop(make_app: Make) -> None:
    """ctx.astep(name, fn) with a plain fn called it on the worker's event loop: a
    blocking one held every async job of the worker for as long as it ran. It runs in a
    thread now: here fn waits for another async job of the same worker, which runs
    meanwhile; its result is stored as a coroutine's is, and the retry gets it back
    without calling fn again."""
    app = make_app()
    in_fn, other_ran = threading.Event(), threading.Event()
    calls: list[int] = []

    def blocking(n: int) -> bool:
        calls.append(n)
        in_fn.set()
        return other_ran.wait(20)

    @app.job(name="plain_step", retries=1, backoff=0.01)
    async def plain_step(ctx: errands.Context, n: int) -> bool:
        saw = await ctx.astep("wait", blocking, n)
        if ctx.attempt == 1:
            raise RuntimeError("after the step")
        return bool(saw)

    @app.job(name="other_async")
    async def other_async() -> str:
        other_ran.set()
        return "ran"

    with running_worker(app, concurrency=4):
        handle = plain_step.enqueue(n=3)
        assert in_fn.wait(30)
        assert other_async.enqueue().result(timeout=30) == "ran"
        assert handle.result(timeout=60) is True
    assert calls == [3]
    assert {s.name: s.result for s in app.job_steps(handle.id)} == {"wait": True}


def test_a_plain_step_fn_cut_by_the_jobs_timeout_is_stored_when_it_returns_and_not_run_again(
    make_app: Make,
) -> None:
    """The job's timeout cancels the handler while its plain step fn runs in a thread,
    which cannot be stopped: its effect happens. Its result is stored when it returns
    (the attempt waits for it, as for a coroutine step's store), so the retry gets it
    back and never calls fn again."""
    app = make_app()
    in_fn, cut, release = threading.Event(), threading.Event(), threading.Event()
    calls: list[int] = []

    def charge() -> str:
        calls.append(1)
        in_fn.set()
        release.wait(30)
        return "ch_1"

    @app.job(name="cut_step", timeout=1, retries=1, backoff=0.01)
    async def cut_step(ctx: errands.Context) -> str:
        try:
            return str(await ctx.astep("charge", charge))
        except asyncio.CancelledError:
            cut.set()
            raise

    with running_worker(app, concurrency=2, abandon_after=30):
        handle = cut_step.enqueue()
        assert in_fn.wait(30)
        assert cut.wait(30)  # its timeout fired while fn ran in its thread
        release.set()
        assert handle.result(timeout=60) == "ch_1"
    assert calls == [1]
    [error] = handle.job().errors
    assert error.kind == "timeout"


def test_a_step_fn_returning_a_coroutine_is_awaited_on_the_loop_then_stored(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    """A plain callable that returns a coroutine (a lambda around an async call) runs in
    its thread, and what it returns is awaited back on the loop, then stored."""
    app = make_app()
    calls: list[int] = []

    async def fetch(n: int) -> int:
        calls.append(n)
        await asyncio.sleep(0)
        return n + 1

    @app.job(name="lambda_step", retries=1, backoff=0.01)
    async def lambda_step(ctx: errands.Context, n: int) -> int:
        got = await ctx.astep("fetch", lambda: fetch(n))
        if ctx.attempt == 1:
            raise RuntimeError("after the step")
        return int(got)

    handle = lambda_step.enqueue(n=4)
    assert errands_testing(app).drain().outcomes == {"retryable": 1, "completed": 1}
    assert handle.result(timeout=1) == 5 and calls == [4]


def test_ctx_step_in_an_async_handler_raises_naming_await_ctx_astep(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    """The sync ctx.step reads and writes the store: on the event loop of an async def
    handler it stalled every async job of the worker while it waited (a locked row, a
    pool with no connection free). It raises ConfigurationError naming ctx.astep there;
    nothing ran and nothing was stored."""
    app = make_app()
    ran: list[int] = []
    refused: list[str] = []

    @app.job(name="async_sync_step", retries=0)
    async def async_sync_step(ctx: errands.Context) -> None:
        try:
            ctx.step("charge", lambda: ran.append(1))
        except errands.ConfigurationError as exc:
            refused.append(str(exc))

    handle = async_sync_step.enqueue()
    assert errands_testing(app).drain().outcomes == {"completed": 1}
    assert ran == [] and app.job_steps(handle.id) == []
    [message] = refused
    assert "use await ctx.astep() instead" in message and "async def handler" in message


def test_steps_are_shown_by_errands_jobs_show_and_its_json(
    make_app: Make, errands_testing: Callable[..., Tester], store_url: str
) -> None:
    app, job, _ = _charging_app(make_app)
    tester = errands_testing(app)
    handle = job.enqueue(order_id=11)
    tester.drain()

    text = _cli(store_url, "jobs", "show", str(handle.id))
    assert text.returncode == 0, text.stderr
    assert "steps (1)" in text.stdout
    assert "charge:" in text.stdout and "ch_11_1" in text.stdout

    as_json = _cli(store_url, "jobs", "show", str(handle.id), "--json")
    assert as_json.returncode == 0, as_json.stderr
    [step] = json.loads(as_json.stdout)["steps"]
    assert step["name"] == "charge"
    assert step["result"] == {"charge": "ch_11_1"}
    assert step["attempt"] == 1


def _cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ERRANDS_")}
    env.update(COLUMNS="200", NO_COLOR="1")
    return subprocess.run(
        [sys.executable, "-m", "errands", *args, "--url", url],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def _stale_runtime(app: errands.App, job: Any) -> Any:
    """A claimed attempt of ``job``'s one enqueued job, as its worker holds it."""
    from errands.backends.base import ClaimParams, QueueClaim
    from errands.worker.execution import Attempt
    from errands.worker.runtime import AttemptRuntime

    [row] = app.backend.job_claim(ClaimParams([QueueClaim("default", 1)], 1, "w-stale", 30.0))
    attempt = Attempt(row=row, definition=job, lease_seconds=30.0)
    attempt.runtime = AttemptRuntime(app, attempt)
    return attempt


def test_an_attempt_past_its_lease_or_asked_to_stop_starts_no_step_effect(
    make_app: Make,
) -> None:
    """A step's effect is never started by an attempt whose lease is past due by its
    worker's clock (a process paused past its lease: another worker may have run the job
    and stored the step meanwhile) or that was asked to stop (cancelled, lease lost or
    unrenewable, timed out): Interrupted instead. A stale attempt resumed with the steps
    it had read before its pause and ran a charge the newer attempt had already made."""
    from errands import clock
    from errands.worker.execution import CANCELLED, LEASE_LOST, Interrupted

    app = make_app()
    effects: list[str] = []

    @app.job(name="stale.steps")
    def stale_steps() -> None: ...

    stale_steps.enqueue()
    attempt = _stale_runtime(app, stale_steps)
    runtime = attempt.runtime
    assert runtime.step("read", lambda: effects.append("read") or 1) == 1  # steps cached

    attempt.lease_valid_until = clock.now() - 1  # paused past its lease
    with pytest.raises(Interrupted, match="could not be renewed") as stopped:
        runtime.step("charge", lambda: effects.append("charge"))
    assert "step 'charge' of job" in stopped.value.__notes__[0]
    attempt.lease_valid_until = clock.now() + 30
    attempt.stop_reason = LEASE_LOST
    with pytest.raises(Interrupted, match="lease lost"):
        runtime.step("email", lambda: effects.append("email"))
    attempt.stop_reason = CANCELLED  # an operator's cancel ends the job cancelled
    with pytest.raises(Interrupted) as cancelled:
        runtime.step("sms", lambda: effects.append("sms"))
    assert cancelled.value.kind == "cancelled"
    assert effects == ["read"]


@needs_boottime
def test_a_step_after_the_host_was_suspended_past_the_lease_is_not_started(
    make_app: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given an attempt whose lease holds for 30 s more, when the host sleeps for a minute
    (a laptop's lid closed, a VM paused by its hypervisor), then its next step's effect is
    not started (Interrupted, as for a process paused past its lease): the store's clock
    went on, so the lease has run out there and another worker may have the job. The
    worker's clock stopped with the host (CLOCK_MONOTONIC), and the step ran."""
    from errands.worker.execution import Interrupted

    app = make_app()
    effects: list[str] = []

    @app.job(name="suspended.steps")
    def suspended_steps() -> None: ...

    suspended_steps.enqueue()
    attempt = _stale_runtime(app, suspended_steps)  # claimed now, with a 30 s lease
    runtime = attempt.runtime
    assert runtime.step("read", lambda: effects.append("read") or 1) == 1

    suspend_host(monkeypatch, 60)
    with pytest.raises(Interrupted, match="could not be renewed"):
        runtime.step("charge", lambda: effects.append("charge"))
    assert effects == ["read"]
