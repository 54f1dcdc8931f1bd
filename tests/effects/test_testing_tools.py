"""``errands.testing`` itself: the modes, the assertions, the clock, faults, the plugin.

Most of it is store-independent and runs on SQLite; what writes store-specific SQL (the
clock, inline's "due now", idleness) also runs on PostgreSQL.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pydantic
import pytest

import errands
from errands.testing import InjectedFailure, SimulatedCrash, Tester, faults

Make = Callable[..., Any]


class Address(pydantic.BaseModel):
    street: str
    zip_code: str


# -- manual mode: what is pending -------------------------------------------------------------
def test_assert_enqueued_matches_a_subset_of_decoded_arguments(
    app: errands.App, errands_testing: Callable[..., Tester]
) -> None:
    @app.job(name="ship", queue="shipping")
    def ship(order_id: int, when: datetime, address: Address, express: bool = False) -> None: ...

    tester = errands_testing(app)
    when = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    handle = ship.enqueue(order_id=1, when=when, address=Address(street="Main", zip_code="1"))
    ship.enqueue(order_id=2, when=when, address={"street": "Side", "zip_code": "2"})

    job = tester.assert_enqueued(ship, order_id=1)
    assert job.id == handle.id
    assert tester.assert_enqueued(ship, when=when, address=Address(street="Side", zip_code="2"))
    assert tester.assert_enqueued(ship, express=False, order_id=2)  # a default, not stored
    assert tester.assert_enqueued(handle, queue="shipping").id == handle.id
    assert tester.assert_enqueued("ship", args={"order_id": 2}).args["order_id"] == 2
    assert [j.args["order_id"] for j in tester.all_enqueued(ship)] == [1, 2]
    assert len(tester.all_enqueued()) == 2
    tester.refute_enqueued(ship, order_id=3)
    tester.refute_enqueued(ship, queue="default")

    with pytest.raises(AssertionError) as missing:
        tester.assert_enqueued(ship, order_id=3)
    assert "expected a pending ship job with args ⊇ {'order_id': 3}" in str(missing.value)
    assert f"job {handle.id} args=" in str(missing.value)
    with pytest.raises(AssertionError, match="expected no pending ship job"):
        tester.refute_enqueued(ship, order_id=1)


def test_args_option_reaches_arguments_named_like_the_options(
    app: errands.App, errands_testing: Callable[..., Tester]
) -> None:
    @app.job(name="thread_reply")
    def thread_reply(parent_id: int, args: list[str]) -> None: ...

    tester = errands_testing(app)
    thread_reply.enqueue(parent_id=12, args=["-v"])
    tester.assert_enqueued(thread_reply, args={"parent_id": 12, "args": ["-v"]})
    tester.refute_enqueued(thread_reply, args={"parent_id": 13})


def test_sensitive_arguments_stay_masked_in_assertion_messages(
    app: errands.App, errands_testing: Callable[..., Tester]
) -> None:
    @app.job(name="login_mail", sensitive={"token"})
    def login_mail(user_id: int, token: str) -> None: ...

    tester = errands_testing(app)
    login_mail.enqueue(user_id=1, token="s3cr3t-token")
    tester.assert_enqueued(login_mail, token="s3cr3t-token")
    with pytest.raises(AssertionError) as failed:
        tester.refute_enqueued(login_mail, user_id=1)
    assert "s3cr3t-token" not in str(failed.value)
    assert "***" in str(failed.value)


# -- manual mode: drain -------------------------------------------------------------------------
def test_drain_options_retries_queues_schedules_and_the_runaway_guard(
    app: errands.App, errands_testing: Callable[..., Tester]
) -> None:
    seen: list[str] = []

    @app.job(name="flaky", retries=2, backoff=30.0)
    def flaky(ctx: errands.Context) -> None:
        seen.append(f"flaky#{ctx.attempt}")
        if ctx.attempt < 3:
            raise RuntimeError("not yet")

    @app.job(name="other", queue="other")
    def other() -> None:
        seen.append("other")

    @app.job(name="later")
    def later() -> None:
        seen.append("later")

    @app.job(name="forever", retries=0)
    def forever() -> None:
        forever.enqueue()

    tester = errands_testing(app)
    flaky.enqueue()
    other.enqueue()
    later.enqueue(delay=timedelta(hours=1))

    assert tester.drain("other").completed == 1
    assert seen == ["other"]
    first = tester.drain(with_retries=False)
    assert (first.retried, first.advanced) == (1, 0.0)
    rest = tester.drain()
    assert rest.outcomes == {"retryable": 1, "completed": 1}
    assert 55 < rest.advanced < 120  # two backoffs of ~30 s on the test clock, no sleeping
    assert seen == ["other", "flaky#1", "flaky#2", "flaky#3"]
    tester.assert_enqueued(later)  # scheduled in an hour: not run by default
    assert tester.drain(with_scheduled=True).completed == 1
    assert seen[-1] == "later"

    flaky.enqueue()
    assert tester.drain(with_retries=False).retried == 1
    app.pause("default")  # a due retry that no claim takes: drain returns, it does not spin
    assert len(tester.drain()) == 0
    app.resume("default")
    assert tester.drain().completed == 1

    forever.enqueue()
    with pytest.raises(RuntimeError, match="enqueue itself forever"):
        tester.drain(max_runs=20)
    [left] = tester.all_enqueued(forever)  # the one it stopped at is given back, uncharged
    assert (left.state, left.attempt) == (errands.JobState.AVAILABLE, 0)


def test_the_job_a_drain_stopped_at_max_runs_is_given_back_with_nothing_recorded(
    app: errands.App, errands_testing: Callable[..., Tester]
) -> None:
    """The job claimed when max_runs was reached never ran: it goes back as a worker gives
    back a prefetched job, in its place and with no history entry (a "released" error
    was appended, as if an attempt of it had been stopped)."""

    @app.job(name="forever", retries=0)
    def forever() -> None:
        forever.enqueue()

    tester = errands_testing(app)
    forever.enqueue()
    with pytest.raises(RuntimeError, match="enqueue itself forever"):
        tester.drain(max_runs=3)
    [left] = tester.all_enqueued(forever)
    assert (left.state, left.attempt, left.errors) == (errands.JobState.AVAILABLE, 0, [])
    assert [j.errors for j in app.jobs(state="completed")] == [[], [], []]


def test_drain_and_inline_run_jobs_with_a_concurrency_key_or_a_rate(
    store_url: str, make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    """Jobs with a concurrency key, a rate or in a fair queue are left out of the plain
    claim: drain() never ran them and reported nothing left (inline mode returned without
    running them). They run one at a time, limits not applied, as the docs say."""
    app = make_app()
    app.queue("tenants", fair=True)
    ran: list[str] = []

    @app.job(name="keyed", concurrency_key="user:{user_id}", concurrency_limit=1)
    def keyed(user_id: int) -> None:
        ran.append(f"keyed{user_id}")

    @app.job(name="rated", rate="1/h")
    def rated(n: int) -> None:
        ran.append(f"rated{n}")

    @app.job(name="fair", queue="tenants", fair_key="{tenant}")
    def fair(tenant: str) -> None:
        ran.append(f"fair:{tenant}")

    tester = errands_testing(app)
    keyed.enqueue(user_id=1)
    keyed.enqueue(user_id=1)
    rated.enqueue(n=1)
    rated.enqueue(n=2)  # past its rate of 1 an hour: drain applies no rate
    fair.enqueue(tenant="a")
    assert tester.drain().completed == 5
    assert sorted(ran) == ["fair:a", "keyed1", "keyed1", "rated1", "rated2"]

    errands_testing(app, "inline")
    assert keyed.enqueue(user_id=2).status() is errands.JobState.COMPLETED
    assert rated.enqueue(n=3).status() is errands.JobState.COMPLETED


def test_clock_moves_schedules_and_only_forward(
    store_url: str, make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    app = make_app()

    @app.job(name="reminder")
    def reminder() -> None: ...

    tester = errands_testing(app)
    handle = reminder.enqueue(delay=timedelta(minutes=5))
    assert tester.drain().completed == 0  # not due, and not a retry: left alone
    tester.clock.advance(timedelta(minutes=4))
    assert tester.drain(with_retries=False).completed == 0
    assert tester.clock.advance(61) == pytest.approx(301)
    assert tester.drain(with_retries=False).completed == 1
    assert handle.status() is errands.JobState.COMPLETED
    with pytest.raises(errands.ConfigurationError, match="only goes forward"):
        tester.clock.advance(-1)


def test_the_clock_runs_out_a_signals_wait_and_drain_records_its_timeout(
    store_url: str, make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    """ctx.wait_for_signal(timeout=60), then clock.advance(120) and drain(): the wait's
    deadline did not move with the clock and drain never ran the wait-expiry sweep, so
    the wait never timed out, unlike every other time errands compares."""
    app = make_app()

    @app.job(name="approval", retries=0)
    def approval(ctx: errands.Context) -> Any:
        return ctx.wait_for_signal("approved", timeout=60)

    tester = errands_testing(app)
    handle = approval.enqueue()
    tester.drain(with_retries=False)
    assert handle.status() is errands.JobState.WAITING
    tester.clock.advance(120)
    tester.drain()
    job = handle.job()
    assert job.state is errands.JobState.DEAD
    assert job.errors[-1].kind == "signal_timeout"


# -- inline mode --------------------------------------------------------------------------------
def test_inline_runs_at_enqueue_through_the_stored_payload(
    store_url: str, make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    app = make_app()
    received: list[Any] = []

    @app.job(name="notify_user")
    def notify_user(user_id: int) -> None:
        received.append(("notify", user_id))

    @app.job(name="register")
    def register(ctx: errands.Context, user_id: int, address: Address, at: datetime) -> str:
        received.append((type(address).__name__, address.zip_code, type(at).__name__))
        stored = ctx.step("create", lambda: {"account": user_id})
        ctx.enqueue(notify_user, user_id=user_id)
        return f"account {stored['account']}"

    errands_testing(app, "inline")
    handle = register.enqueue(
        user_id="7",  # validated and coerced at enqueue, decoded again at execution
        address={"street": "Main", "zip_code": "123"},
        at=datetime(2030, 1, 1, tzinfo=UTC),
        delay=timedelta(hours=1),  # inline mode runs it now anyway
    )
    assert handle.status() is errands.JobState.COMPLETED
    assert handle.result(timeout=0) == "account 7"
    assert received == [("Address", "123", "datetime"), ("notify", 7)]
    [child] = app.jobs(parent_id=handle.id)
    assert child.state is errands.JobState.COMPLETED

    with pytest.raises(errands.InvalidPayload):  # still validated at enqueue
        register.enqueue(user_id="x", address={}, at="never")


def test_inline_reraises_what_a_dead_job_raised_and_refuses_open_transactions(
    app: errands.App, errands_testing: Callable[..., Tester], tmp_path: Path
) -> None:
    attempts: list[int] = []

    @app.job(name="broken", retries=2, backoff=600.0)
    def broken(ctx: errands.Context) -> None:
        attempts.append(ctx.attempt)
        raise KeyError("missing config")

    @app.job(name="spawner", retries=0)
    def spawner() -> None:
        broken.enqueue()  # enqueued from inside a handler: run by the same inline drain

    tester = errands_testing(app, "inline")
    with pytest.raises(KeyError, match="missing config"):
        broken.enqueue()
    assert attempts == [1, 2, 3]  # retried on the test clock, not in real time
    assert tester.clock.advanced > 1190

    with pytest.raises(KeyError):
        spawner.enqueue()

    import sqlite3

    conn = sqlite3.connect(str(tmp_path / "errands.db"))
    try:
        with pytest.raises(errands.ConfigurationError, match="inline mode cannot run"):
            broken.enqueue(conn=conn)
    finally:
        conn.close()

    tester.close()
    quiet = Tester(app, "inline", raise_errors=False)
    try:
        handle = broken.enqueue()
        assert handle.status() is errands.JobState.DEAD
    finally:
        quiet.close()


# -- faults -------------------------------------------------------------------------------------
def test_fail_attempt_before_or_after_the_handler_once_per_job(
    app: errands.App, errands_testing: Callable[..., Tester]
) -> None:
    ran: list[tuple[int, int]] = []

    @app.job(name="work", retries=3, backoff=1.0)
    def work(ctx: errands.Context, n: int) -> int:
        ran.append((n, ctx.attempt))
        return n

    tester = errands_testing(app)
    tester.fail_attempt(work, 1)
    tester.fail_attempt(work, 2, TimeoutError("upstream slow"), after_handler=True)
    one = work.enqueue(n=1)
    drained = tester.drain()

    assert [r.outcome for r in drained.runs] == ["retryable", "retryable", "completed"]
    assert isinstance(drained.runs[0].error, InjectedFailure)
    assert isinstance(drained.runs[1].error, TimeoutError)
    assert ran == [(1, 2), (1, 3)]  # attempt 1 never ran the handler; attempt 2 did
    assert [(e.attempt, e.type) for e in one.job().errors] == [
        (1, "InjectedFailure"),
        (2, "TimeoutError"),
    ]

    two = work.enqueue(n=2)
    tester.fail_attempt(two, 1, errands.Permanent)  # this job only
    assert tester.drain().dead == 1
    assert two.status() is errands.JobState.DEAD
    three = work.enqueue(n=3)
    assert tester.drain().outcomes == {"retryable": 2, "completed": 1}  # the type-wide rules
    assert three.status() is errands.JobState.COMPLETED


def test_crash_before_completion_and_after_step_leave_nothing_written(
    app: errands.App, errands_testing: Callable[..., Tester]
) -> None:
    effects: list[str] = []

    @app.job(name="crashy", retries=3, backoff=1.0)
    def crashy(ctx: errands.Context, n: int) -> int:
        ctx.step("one", effects.append, f"one:{n}")
        ctx.step("two", effects.append, f"two:{n}")
        return n

    tester = errands_testing(app)
    tester.crash_after_step(crashy, "two")
    tester.crash_before_completion(crashy, attempt=2)
    handle = crashy.enqueue(n=1)
    drained = tester.drain()

    assert [r.outcome for r in drained.runs] == ["crashed", "crashed", "completed"]
    assert isinstance(drained.runs[0].error, SimulatedCrash)
    assert drained.rescued == 2
    assert effects == ["one:1", "two:1"]  # steps stored before the crashes are kept
    job = handle.job()
    assert (job.state, job.attempt, job.rescues) == (errands.JobState.COMPLETED, 3, 2)


# -- the real in-process worker ------------------------------------------------------------------
def test_worker_mode_runs_jobs_in_a_real_worker_thread(
    store_url: str, make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    app = make_app(lease=1.0)
    done: list[int] = []

    @app.job(name="task", retries=2, backoff=0.05)
    def task(ctx: errands.Context, n: int) -> int:
        ctx.step("mark", done.append, n)
        return n

    tester = errands_testing(app)
    tester.crash_after_step(task, "mark", attempt=1)
    with tester.worker(concurrency=2) as worker:
        handles = [task.enqueue(n=n) for n in range(3)]
        assert [h.result(timeout=30) for h in handles] == [0, 1, 2]
        tester.wait_idle(timeout=10)
        assert worker.id.startswith("w-")
    assert sorted(done) == [0, 1, 2]
    assert {h.job().rescues for h in handles} == {1}  # each crashed once, rescued by lease
    assert [r.outcome for r in tester.history].count("crashed") == 3


# -- lifecycle and the plugin ---------------------------------------------------------------------
def test_closing_a_tester_restores_the_app(app: errands.App, tmp_path: Path) -> None:
    @app.job(name="plain")
    def plain() -> None: ...

    original_fn, original_url = plain.fn, app.url
    other = f"sqlite:///{tmp_path}/other.db"
    with Tester(app, "inline", url=other) as tester:
        tester.fail_attempt(plain, 5)
        tester.crash_after_step(plain, "x")
        assert plain.fn is not original_fn
        assert app.url == other
        assert faults.armed("after_step")
        plain.enqueue()
    assert plain.fn is original_fn
    assert app.url == original_url
    assert "enqueue_many" not in vars(app)
    assert not faults.armed("after_step")
    assert app.jobs(name="plain") == []  # that job went to the other store
    with pytest.raises(errands.ConfigurationError, match="closed"):
        tester.drain()
    with pytest.raises(errands.ConfigurationError, match="choose 'manual'"):
        Tester(app, "eager")  # type: ignore[arg-type]


PLUGIN_CONFTEST = """
import pytest
import errands

app = errands.App()
sent = []

@app.job(name="welcome", retries=1, backoff=1.0)
def welcome(ctx: errands.Context, user_id: int) -> str:
    ctx.step("send", sent.append, user_id)
    return f"sent {user_id}"

@pytest.fixture
def errands_app(tmp_path):
    app.url = f"sqlite:///{tmp_path}/errands.db"
    yield app
    app.close()
"""

PLUGIN_TESTS = """
import errands
from conftest import sent, welcome

def test_manual(errands_manual):
    welcome.enqueue(user_id=1)
    errands_manual.assert_enqueued(welcome, user_id=1)
    assert errands_manual.drain().completed == 1
    errands_manual.refute_enqueued(welcome)

def test_inline(errands_inline):
    assert welcome.enqueue(user_id=2).result(timeout=0) == "sent 2"

def test_worker(errands_worker):
    assert welcome.enqueue(user_id=3).result(timeout=30) == "sent 3"

def test_factory_with_a_fresh_store(errands_testing):
    tester = errands_testing(welcome.app, fresh_store=True)
    welcome.enqueue(user_id=4)
    assert len(tester.all_enqueued(welcome)) == 1
"""


def test_pytest_plugin_fixtures_work_in_a_users_project(tmp_path: Path) -> None:
    """The fixtures come from the installed entry point, in a project that imports nothing
    from errands.testing; without an ``errands_app`` fixture they say what to define."""
    project, bare = tmp_path / "project", tmp_path / "bare"
    project.mkdir()
    bare.mkdir()
    (project / "conftest.py").write_text(textwrap.dedent(PLUGIN_CONFTEST))
    (project / "test_jobs.py").write_text(textwrap.dedent(PLUGIN_TESTS))
    (bare / "test_missing.py").write_text("def test_needs_an_app(errands_manual):\n    pass\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ERRANDS_", "PYTEST_"))}
    command = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "error", "project", "bare"]
    done = subprocess.run(
        [sys.executable, *command],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        check=False,
    )
    assert "4 passed, 1 error" in done.stdout, done.stdout + done.stderr
    assert "define one in your conftest.py" in done.stdout


def test_inline_runs_async_enqueues_and_workflows_too(
    app: errands.App, errands_testing: Callable[..., Tester]
) -> None:
    """Only enqueue_many was run at once: an `await job.aenqueue()` or a workflow was
    stored and left pending, unlike the sync path."""
    import asyncio

    ran: list[str] = []

    @app.job(name="inline.step")
    def step(name: str) -> str:
        ran.append(name)
        return name

    errands_testing(app, "inline")
    handle = asyncio.run(step.aenqueue(name="async"))
    assert handle.status() is errands.JobState.COMPLETED
    chain = errands.Workflow("inline.flow")
    first = chain.add(step.bind(name="first"))
    chain.add(step.bind(name="second"), after=[first])
    flow = app.enqueue_workflow(chain)
    assert flow.status().state == "succeeded"
    assert ran == ["async", "first", "second"]


def test_two_testers_crash_their_own_jobs_after_a_step(tmp_path: Path) -> None:
    """The after_step fault point is one per process: a second Tester's crash rules
    replaced the first's (whose jobs then never crashed, and a test of its recovery
    passed without one) and closing either disarmed the other's. Ids and names repeat
    across stores: each Tester crashes its own app's jobs only."""
    apps = [errands.App(f"sqlite:///{tmp_path}/{name}.db") for name in ("first", "second")]
    effects: list[str] = []
    jobs = []
    for app in apps:

        @app.job(name="charge", retries=3, backoff=1.0)
        def charge(ctx: errands.Context, n: int) -> int:
            ctx.step("pay", effects.append, f"pay:{n}")
            return n

        jobs.append(charge)
    first, second = Tester(apps[0]), Tester(apps[1])
    try:
        first.crash_after_step(jobs[0], "pay")
        second.crash_after_step(jobs[1], "pay", attempt=2)  # never reached: it completes
        jobs[0].enqueue(n=1)
        jobs[1].enqueue(n=2)  # the same id in the other store: not the first Tester's
        assert [r.outcome for r in second.drain().runs] == ["completed"]
        assert [r.outcome for r in first.drain().runs] == ["crashed", "completed"]
        second.close()  # the first Tester's rules stay armed
        assert faults.armed("after_step")
        jobs[0].enqueue(n=3)
        assert [r.outcome for r in first.drain().runs] == ["crashed", "completed"]
    finally:
        first.close()
        second.close()
        for app in apps:
            app.close()
    assert not faults.armed("after_step")
    assert effects == ["pay:2", "pay:1", "pay:3"]
