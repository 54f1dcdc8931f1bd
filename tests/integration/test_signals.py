"""Durable signals with a real worker: ``ctx.wait_for_signal`` suspends the job (state
``waiting``, no lease, no slot, attempt not charged) and ``app.signal`` resumes it through
the step store; a signal sent before the wait is kept; a timeout is a classified failure
the maintenance leader records; sync and async handlers alike."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta
from typing import Any

import pytest

import errands
from tests.conftest import running_worker

from .helpers import wait_until


def _state(handle: errands.JobHandle) -> str:
    return handle.status().value


def test_a_waiting_job_holds_no_lease_and_resumes_with_the_payload(app: errands.App) -> None:
    """The job waits without a lease or a slot; the signal resumes it, the step before
    the wait is not run again, and the handler returns the payload."""
    charged: list[int] = []

    @app.job(name="sig.approve")
    def approve(ctx: errands.Context, order: int) -> Any:
        ctx.step("reserve", lambda: charged.append(order))
        decision = ctx.wait_for_signal("approved", timeout=timedelta(hours=1))
        return {"order": order, "decision": decision, "attempt": ctx.attempt}

    with running_worker(app, concurrency=2) as worker:
        handle = approve.enqueue(order=7)
        wait_until(lambda: _state(handle) == "waiting", what="the job to wait")
        job = handle.job()
        assert (job.lease_owner, job.waiting_for, job.attempt) == (None, "approved", 0)
        assert job.wait_until is not None
        wait_until(lambda: worker._free == worker.concurrency, what="its slot freed")
        result = app.signal(handle.id, "approved", {"by": "ops"})
        assert result.resumed and result.previous_state == "waiting"
        assert handle.result(timeout=10) == {
            "order": 7,
            "decision": {"by": "ops"},
            "attempt": 1,
        }
    assert charged == [7]
    assert [e.action for e in app.audit(job_id=handle.id)] == ["signal"]


def test_a_signal_sent_before_the_wait_is_kept(app: errands.App) -> None:
    """Signalled while still queued, the job never suspends: the wait returns at once."""

    @app.job(name="sig.early")
    def early(ctx: errands.Context) -> Any:
        return ctx.wait_for_signal("go")

    handle = early.enqueue()
    assert app.signal(handle.id, "go", [1, 2]).resumed is False
    with running_worker(app):
        assert handle.result(timeout=10) == [1, 2]
    assert not any(e.kind == "released" for e in handle.job().errors)


def test_a_suspended_job_holds_no_slot(app: errands.App) -> None:
    """With one slot, a waiting job leaves it to the next job, which completes."""

    @app.job(name="sig.hold")
    def hold(ctx: errands.Context) -> Any:
        return ctx.wait_for_signal("release")

    @app.job(name="sig.quick")
    def quick() -> str:
        return "done"

    with running_worker(app, concurrency=1):
        waiting = hold.enqueue()
        wait_until(lambda: _state(waiting) == "waiting", what="the first job to wait")
        assert quick.enqueue().result(timeout=10) == "done"
        app.signal(waiting.id, "release", "ok")
        assert waiting.result(timeout=10) == "ok"


def test_a_wait_past_its_timeout_is_a_classified_failure(app: errands.App) -> None:
    """The maintenance leader ends a wait past its timeout: retried with backoff (and
    waiting again), then dead with kind signal_timeout; the timeout event is emitted."""
    seen: list[str] = []
    app.events.subscribe(lambda e: seen.append(e.name))

    @app.job(name="sig.late", retries=1, backoff=0.01)
    def late(ctx: errands.Context) -> Any:
        return ctx.wait_for_signal("never", timeout=0.2)

    with running_worker(app, maintenance_tick=0.05):
        handle = late.enqueue()
        with pytest.raises(errands.JobFailed, match="SignalTimeout"):
            handle.result(timeout=20)
    job = handle.job()
    assert [e.kind for e in job.errors] == ["signal_timeout", "signal_timeout"]
    assert job.attempt == 2 and job.state is errands.JobState.DEAD
    assert seen.count("errands.job.wait_timed_out") == 2 and "errands.job.waiting" in seen


def test_async_handlers_await_signals(app: errands.App) -> None:
    """An async handler awaits ctx.wait_for_signal and is resumed the same way."""

    @app.job(name="sig.async")
    async def wait_async(ctx: errands.Context) -> Any:
        payload = await ctx.wait_for_signal("ready")
        return payload["n"] * 2

    with running_worker(app):
        handle = wait_async.enqueue()
        wait_until(lambda: _state(handle) == "waiting", what="the async job to wait")
        app.signal(handle.id, "ready", {"n": 21})
        assert handle.result(timeout=10) == 42


def test_an_async_handlers_sync_helper_on_a_thread_suspends_until_the_signal(
    each_store_url: str,
) -> None:
    """ctx.wait_for_signal called from a thread of an async handler (a sync helper run
    with asyncio.to_thread) waits as in a sync handler: the job suspends, and the
    signal resumes it with its payload. It returned an un-awaited coroutine there,
    truthy: the helper took it for the payload, and the job completed, its effect done,
    without any signal sent."""
    app = errands.App(each_store_url)
    shipped: list[Any] = []

    def ship_when_approved(ctx: errands.Context) -> str:
        approved = ctx.wait_for_signal("approved", timeout=3600)
        shipped.append(approved)
        return f"shipped by {approved['by']}"

    @app.job(name="sig.thread")
    async def ship(ctx: errands.Context) -> str:
        return await asyncio.to_thread(ship_when_approved, ctx)

    try:
        with running_worker(app):
            handle = ship.enqueue()
            wait_until(lambda: _state(handle) == "waiting", what="the job to wait")
            assert shipped == [] and handle.job().waiting_for == "approved"
            assert app.signal(handle.id, "approved", {"by": "ops"}).resumed
            assert handle.result(timeout=20) == "shipped by ops"
        assert shipped == [{"by": "ops"}]
    finally:
        app.close()


def test_signals_to_finished_or_unknown_jobs_are_refused(app: errands.App) -> None:
    """A completed job takes no signal (nothing would read it); an unknown id raises
    JobNotFound; a waiting job can be cancelled."""

    @app.job(name="sig.done")
    def done(ctx: errands.Context) -> Any:
        return ctx.wait_for_signal("x") if ctx.job_id % 2 == 0 else None

    with running_worker(app):
        finished = done.enqueue()
        if finished.id % 2 == 0:
            finished = done.enqueue()
        finished.result(timeout=10)
        with pytest.raises(errands.InvalidTransition, match="completed"):
            app.signal(finished.id, "x")
        with pytest.raises(errands.JobNotFound):
            app.signal(999_999, "x")
        waiting = done.enqueue()
        if waiting.id % 2 == 1:
            waiting = done.enqueue()
        wait_until(lambda: _state(waiting) == "waiting", what="a job to wait")
        assert app.cancel(waiting.id).state == "cancelled"
        with pytest.raises(errands.JobCancelled):
            waiting.result(timeout=5)


@pytest.mark.parametrize(
    ("payload", "where", "problem"),
    [
        (float("nan"), "(value)", "NaN or infinite"),
        ({"total": [1, float("inf")]}, "total.1", "NaN or infinite"),
        ({"low": -float("inf")}, "low", "NaN or infinite"),
        ({"note": "a\x00b"}, "note", "NUL character"),
        ({"a\x00": 1}, "a\x00", "NUL character"),
    ],
    ids=["nan", "nested-infinity", "minus-infinity", "nul", "nul-in-key"],
)
def test_a_signal_payload_json_cannot_hold_is_refused_naming_where_and_the_fix(
    app: errands.App, payload: Any, where: str, problem: str
) -> None:
    """A NaN or infinite number, or a NUL character, passed a serialiser that writes NaN,
    Infinity and \\u0000: SQLite kept JSON no standard reader takes, PostgreSQL's jsonb
    raised a raw driver error (a CLI traceback, a dashboard 500). Refused as job
    arguments are, with nothing kept or audited."""

    @app.job(name="sig.later")
    def later(ctx: errands.Context) -> Any:
        return ctx.wait_for_signal("go")

    handle = later.enqueue(delay=3600)
    with pytest.raises(errands.InvalidPayload) as refused:
        app.signal(handle.id, "go", payload)
    message = str(refused.value)
    assert message.startswith(f"signal 'go': the payload: {where}: "), message
    assert problem in message, message
    assert ("null" if "NaN" in problem else "base64") in message, message  # the fix
    assert app.audit(job_id=handle.id) == []
    app.signal(handle.id, "go", {"total": [1, 2.5], "note": "NaN Infinity \\u0000"})


def test_a_signal_payload_with_an_int_of_more_than_4300_digits_is_refused_naming_where(
    each_store_url: str,
) -> None:
    """pydantic writes such an int, and no JSON reader takes it back (Python's json,
    pydantic's): it was stored, and the job it resumed failed on every run and every
    replay. Refused with InvalidPayload naming where, nothing kept or audited; the job
    resumes with a payload that reads back."""
    app = errands.App(each_store_url)

    @app.job(name="sig.huge")
    def huge(ctx: errands.Context) -> Any:
        return ctx.wait_for_signal("go", timeout=3600)

    try:
        with running_worker(app):
            handle = huge.enqueue()
            wait_until(lambda: _state(handle) == "waiting", what="the job to wait")
            with pytest.raises(errands.InvalidPayload) as refused:
                app.signal(handle.id, "go", {"counts": [1, 10**4400]})
            assert str(refused.value).startswith(
                "signal 'go': the payload: counts.1: an int of more than 4,300 digits, "
                "which cannot be read back from JSON; store it elsewhere"
            ), refused.value
            assert app.audit(job_id=handle.id) == [] and _state(handle) == "waiting"
            assert app.signal(handle.id, "go", {"counts": [1, "9" * 4401]}).resumed
            assert handle.result(timeout=20) == {"counts": [1, "9" * 4401]}
    finally:
        app.close()


def test_a_wait_inside_a_transaction_is_refused(app: errands.App) -> None:
    """Waiting while ctx.transaction() is open fails the job permanently, saying why."""
    opened = threading.Event()

    @app.job(name="sig.tx")
    def in_tx(ctx: errands.Context) -> None:
        ctx.transaction()
        opened.set()
        ctx.wait_for_signal("x")

    with running_worker(app):
        handle = in_tx.enqueue()
        with pytest.raises(errands.JobFailed, match=r"inside ctx\.transaction"):
            handle.result(timeout=10)


@pytest.mark.parametrize("timeout", [1e12, float("inf"), float("nan"), -1.0, "2 days"])
def test_a_wait_with_a_timeout_no_date_can_hold_fails_permanently_saying_so(
    app: errands.App, timeout: Any
) -> None:
    """A wait's timeout is at most 100 years, as every duration is: 1e12 s was stored as
    year ~33,700 (NaN and infinity got through too), and every listing of the store then
    failed to read it back as a date. Refused, the job is dead at once, naming the fix."""

    @app.job(name="sig.forever", retries=3)
    def forever(ctx: errands.Context) -> Any:
        return ctx.wait_for_signal("never", timeout=timeout)

    with running_worker(app):
        handle = forever.enqueue()
        with pytest.raises(errands.JobFailed, match=r"wait_for_signal\('never'\): timeout="):
            handle.result(timeout=10)
    job = handle.job()
    assert job.state is errands.JobState.DEAD and job.attempt == 1
    assert "None to wait without a limit" in job.errors[0].message
    assert app.jobs(limit=10)  # every row still reads back


def test_the_cli_and_the_dashboard_send_signals(app: errands.App) -> None:
    """`errands jobs signal` resumes a waiting job; the dashboard's Send signal button
    (CSRF-protected, audited with the viewer) does too."""
    from click.testing import CliRunner
    from starlette.testclient import TestClient

    from errands.cli.main import cli
    from errands.dashboard import create_app

    @app.job(name="sig.ui")
    def ui(ctx: errands.Context) -> Any:
        return ctx.wait_for_signal("ok")

    with running_worker(app):
        by_cli, by_web = ui.enqueue(), ui.enqueue()
        wait_until(lambda: _state(by_cli) == _state(by_web) == "waiting", what="both jobs to wait")
        done = CliRunner().invoke(
            cli, ["jobs", "signal", str(by_cli.id), "ok", "--payload", '{"via": "cli"}',
                  "--url", app.url],
        )  # fmt: skip
        assert done.exit_code == 0 and "resumes" in done.output, done.output
        assert by_cli.result(timeout=10) == {"via": "cli"}
        with TestClient(
            create_app(app), base_url="http://127.0.0.1", client=("127.0.0.1", 50000)
        ) as client:
            page = client.get(f"/jobs/{by_web.id}")
            assert "Send signal" in page.text
            csrf = page.text.split('name="csrf_token" value="')[1].split('"')[0]
            client.post(
                f"/jobs/{by_web.id}/signal",
                data={"csrf_token": csrf, "signal": "ok", "payload": '"web"'},
            )
        assert by_web.result(timeout=10) == "web"
    assert app.audit(job_id=by_web.id)[0].actor.startswith("dashboard:")


def test_a_worker_on_postgresql_suspends_and_resumes_a_job(pg_url: str) -> None:
    """The same flow on PostgreSQL: wait, signal, resume with the payload; the waiting
    job is woken by the result listener when it completes."""
    app = errands.App(pg_url)

    @app.job(name="sig.pg")
    def pg_wait(ctx: errands.Context, n: int) -> Any:
        return {"n": n, "got": ctx.wait_for_signal("go", timeout=600)}

    try:
        with running_worker(app, concurrency=2):
            handle = pg_wait.enqueue(n=3)
            wait_until(lambda: _state(handle) == "waiting", what="the job to wait")
            assert handle.job().lease_owner is None
            assert app.signal(handle.id, "go", "yes").resumed
            assert handle.result(timeout=20) == {"n": 3, "got": "yes"}
    finally:
        app.close()


def test_a_workflow_settled_by_a_members_wait_timing_out_is_announced(app: errands.App) -> None:
    """A member dead by its signal wait's timeout settles its workflow: the settlement
    was recorded and then dropped by the next rescue, and errands.workflow.settled never
    came (the rescue path announced its own)."""
    settled: list[Any] = []
    app.events.subscribe(
        lambda e: settled.append(e) if e.name == "errands.workflow.settled" else None
    )

    @app.job(name="sig.member", retries=0)
    def member(ctx: errands.Context) -> Any:
        return ctx.wait_for_signal("never", timeout=0.2)

    batch = errands.Batch("sig.batch")
    batch.add(member.bind())
    with running_worker(app, maintenance_tick=0.05):
        flow = app.enqueue_workflow(batch)
        wait_until(lambda: settled, timeout=20, what="errands.workflow.settled")
    assert settled[0]["workflow_id"] == flow.id and settled[0]["state"] == "failed"
