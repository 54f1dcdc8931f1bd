"""Every user callable is treated as hostile (issue 16, A1, A7 and B): a backoff policy,
an on_dead hook, an event subscriber, a payload validator or serializer, a periodic job's
arguments, raising, slow or hanging, never wedges a job, an outcome write or a
maintenance tick. Each test runs on both backends, with a real in-process worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import BaseModel, field_validator, model_serializer

import errands
from errands.jobs import JobState
from errands.maintenance.scheduler import Scheduler
from errands.maintenance.service import Maintenance

from .helpers import claim_as_dead_worker, expire_lease, wait_until

Worker = Callable[..., Any]


def _state(app: errands.App, job_id: int) -> JobState:
    return app.get_job(job_id).state


# -- backoff policies (A1) --------------------------------------------------------------
def test_a_raising_backoff_falls_back_to_the_default_and_frees_the_slot(
    store: errands.App, worker: Worker, caplog: pytest.LogCaptureFixture
) -> None:
    """Given a job whose backoff callable raises, when its handler fails, then the job is
    retryable after the default delay (2 s ± 25 %), the failure is logged, and its slot is
    free: a second job runs on the worker's only slot."""

    def broken_backoff(attempt: int) -> float:
        raise RuntimeError("backoff bug")

    @store.job(name="hostile.backoff", retries=2, backoff=broken_backoff)
    def flaky() -> None:
        raise ValueError("flaky")

    @store.job(name="hostile.next")
    def next_one() -> str:
        return "ran"

    handle = flaky.enqueue()
    with worker(concurrency=1), caplog.at_level(logging.WARNING, "errands.worker"):
        wait_until(lambda: handle.job().errors, what="the first failure recorded")
        assert next_one.enqueue().result(timeout=30) == "ran"
    job = handle.job()
    first = job.errors[0]
    assert (first.type, first.attempt) == ("ValueError", 1)
    wait = (job.run_at - first.at).total_seconds()
    if job.attempt == 1:  # not yet retried: its run_at is the first retry's
        assert 1.4 <= wait <= 2.6, wait
    assert "backoff of job type 'hostile.backoff' failed" in caplog.text


def test_a_hanging_backoff_delays_one_decision_by_its_deadline_only(
    store: errands.App, worker: Worker
) -> None:
    """Given a backoff callable that never returns, when the handler fails, then the
    attempt is still recorded (with the default delay) and the worker goes on."""
    hang = threading.Event()

    @store.job(name="hostile.hanging_backoff", retries=1, backoff=lambda attempt: hang.wait(60))
    def flaky() -> None:
        raise ValueError("flaky")

    @store.job(name="hostile.beside")
    def beside() -> str:
        return "ran"

    handle = flaky.enqueue()
    try:
        with worker(concurrency=2):
            wait_until(lambda: handle.job().errors, timeout=30, what="the failure recorded")
            assert beside.enqueue().result(timeout=30) == "ran"
    finally:
        hang.set()
    assert handle.job().errors[0].type == "ValueError"


def test_a_rescue_with_a_raising_backoff_rescues_every_expired_lease(store: errands.App) -> None:
    """Given two expired leases, one of a job whose backoff raises, when the leader runs
    one tick, then both jobs are rescued (the failing one with the default backoff) and
    the other duties of the tick still run."""

    @store.job(name="hostile.rescue_bad", backoff=lambda attempt: 1 / 0)
    def bad() -> None: ...

    @store.job(name="hostile.rescue_ok")
    def ok() -> None: ...

    ids = {bad.enqueue().id, ok.enqueue().id}
    rows = claim_as_dead_worker(store)
    assert {r.id for r in rows} == ids
    for job_id in ids:
        assert expire_lease(store, job_id) == 1
    later = ok.enqueue(delay=0.2)
    leader = Maintenance(store, "leader")
    leader.run_once()
    for job_id in ids:
        job = store.get_job(job_id)
        assert (job.state, job.rescues) == (JobState.RETRYABLE, 1), job
        assert job.errors[-1].type == "WorkerLost"
    wait_until(
        lambda: store.backend.db_now() > later.job().run_at.timestamp(), timeout=5, what="run_at"
    )
    leader.run_once()  # the next tick promotes: maintenance goes on
    assert later.status() is JobState.AVAILABLE
    leader.stop()


# -- on_dead hooks and event subscribers (A7) ----------------------------------------------
def test_a_slow_on_dead_hook_holds_up_no_other_outcome(store: errands.App, worker: Worker) -> None:
    """Given an on_dead hook that blocks, when a job dies and ten more are enqueued, then
    all ten complete while the hook is still blocked: hooks never run on the completer."""
    entered, release = threading.Event(), threading.Event()

    @store.on_dead
    def blocking_hook(job: errands.Job) -> None:
        entered.set()
        release.wait(30)

    @store.job(name="hostile.doomed")
    def doomed() -> None:
        raise errands.Permanent("no")

    @store.job(name="hostile.quick")
    def quick(n: int) -> int:
        return n

    try:
        with worker(concurrency=4):
            doomed.enqueue()
            assert entered.wait(30), "the hook never ran"
            handles = [quick.enqueue(n=i) for i in range(10)]
            assert [h.result(timeout=30) for h in handles] == list(range(10))
            assert not release.is_set()  # the hook was blocked the whole time
    finally:
        release.set()


def test_a_hung_on_dead_hook_is_stopped_at_its_time_limit_and_the_next_runs(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Given hook_timeout=0.5 and an on_dead hook that loops for ever on the first job,
    when two jobs die, then the hook is interrupted after its limit (logged), the second
    job's hook still runs, and the hung hook's death is marked done: the leader does not
    run a hook that hangs again and again (no record is left for either death)."""
    app = errands.App(store_url, hook_timeout=0.5)
    seen: list[int] = []

    @app.on_dead
    def hook(job: errands.Job) -> None:
        if job.args["n"] == 0:
            while True:
                time.sleep(0.01)
        seen.append(job.args["n"])

    @app.job(name="hostile.dies")
    def dies(n: int) -> None:
        raise errands.Permanent("no")

    from tests.conftest import running_worker

    try:
        with caplog.at_level(logging.ERROR, "errands.hooks"), running_worker(app):
            hung = dies.enqueue(n=0)
            wait_until(
                lambda: "ran longer than its 0.5 s limit" in caplog.text,
                timeout=30,
                what="the limit",
            )
            dies.enqueue(n=1)
            wait_until(lambda: seen == [1], timeout=30, what="the second hook")
            wait_until(
                lambda: app.backend.dead_hooks_due(older_than=0, limit=10) == [],
                timeout=30,
                what="both deaths' hook records marked done",
            )
        assert hung.job().state == "dead"
    finally:
        app.close()


def test_a_slow_event_subscriber_holds_up_no_outcome(store: errands.App, worker: Worker) -> None:
    """Given an event subscriber that blocks on the first completion it sees, when ten
    jobs run, then all ten complete: subscribers run off the worker's own threads."""
    release = threading.Event()
    got: list[str] = []

    @store.events.subscribe
    def slow(event: Any) -> None:
        if event.name == "errands.job.completed":
            got.append(event.name)
            release.wait(30)

    @store.job(name="hostile.sub")
    def work(n: int) -> int:
        return n

    try:
        with worker(concurrency=4):
            handles = [work.enqueue(n=i) for i in range(10)]
            assert [h.result(timeout=30) for h in handles] == list(range(10))
            wait_until(lambda: got, timeout=10, what="the subscriber called")
    finally:
        release.set()


# -- payload validators and serializers (B) -------------------------------------------------
_VALIDATOR = {"mode": "ok"}
_GATE = threading.Event()


class Order(BaseModel):
    n: int

    @field_validator("n")
    @classmethod
    def hostile(cls, value: int) -> int:
        if _VALIDATOR["mode"] == "raise":
            raise RuntimeError("validator bug")
        if _VALIDATOR["mode"] == "hang":
            _GATE.wait(60)
        return value


class Receipt(BaseModel):
    n: int

    @model_serializer
    def hostile(self) -> dict[str, int]:
        raise RuntimeError("serializer bug")


@pytest.fixture
def validator_mode() -> Any:
    _VALIDATOR["mode"] = "ok"
    _GATE.clear()
    yield _VALIDATOR
    _VALIDATOR["mode"] = "ok"
    _GATE.set()


def test_a_payload_validator_that_raises_at_execution_fails_the_job_for_good(
    store: errands.App, worker: Worker, validator_mode: dict[str, str]
) -> None:
    """Given a payload whose validator raises (not a ValueError) when the job runs, then
    the job is dead after its first attempt as an invalid payload, never retried."""

    @store.job(name="hostile.validator", retries=3)
    def takes(order: Order) -> None: ...

    handle = takes.enqueue(order=Order(n=1))
    validator_mode["mode"] = "raise"
    with worker():
        wait_until(lambda: handle.status() is JobState.DEAD, timeout=30, what="dead")
    job = handle.job()
    assert (job.attempt, job.last_error.type) == (1, "InvalidPayload")  # type: ignore[union-attr]
    assert "validator bug" in job.last_error.message  # type: ignore[union-attr]


def test_a_result_serializer_that_raises_fails_the_job_for_good(
    store: errands.App, worker: Worker
) -> None:
    """Given a handler whose result's serializer raises, then the job is dead after one
    attempt (its work is done; a retry would repeat it)."""

    @store.job(name="hostile.serializer", retries=3)
    def makes() -> Receipt:
        return Receipt(n=1)

    handle = makes.enqueue()
    with worker():
        wait_until(lambda: handle.status() is JobState.DEAD, timeout=30, what="dead")
    assert handle.job().attempt == 1


@pytest.mark.parametrize("beside_kind", ["sync", "async"])
def test_a_hanging_payload_validator_of_an_async_job_holds_up_no_other_job(
    store: errands.App, worker: Worker, validator_mode: dict[str, str], beside_kind: str
) -> None:
    """Given an async job whose payload validator hangs when it runs, then other jobs are
    claimed and complete meanwhile: the claim loop never decodes a payload, and a payload
    whose decoding runs the application's code is decoded off the event loop (other async
    jobs' plain payloads are decoded on it)."""

    @store.job(name="hostile.async_validator")
    async def takes(order: Order) -> int:
        return order.n

    if beside_kind == "async":

        @store.job(name="hostile.beside")
        async def beside_async(n: int) -> int:
            return n

        beside: errands.JobDefinition[..., int] = beside_async
    else:

        @store.job(name="hostile.beside")
        def beside_sync(n: int) -> int:
            return n

        beside = beside_sync

    stuck = takes.enqueue(order=Order(n=5))
    validator_mode["mode"] = "hang"
    with worker(concurrency=4):
        wait_until(
            lambda: stuck.status() is JobState.RUNNING, timeout=30, what="the async job running"
        )
        handles = [beside.enqueue(n=i) for i in range(5)]
        assert [h.result(timeout=30) for h in handles] == list(range(5))
        validator_mode["mode"] = "ok"
        _GATE.set()
        assert stuck.result(timeout=30) == 5


def test_periodic_job_arguments_are_validated_once_at_registration_not_by_the_leader(
    store: errands.App, validator_mode: dict[str, str]
) -> None:
    """A periodic job's arguments run through its validators when ``@app.periodic``
    registers it; the leader's cron duty inserts each slot from that, calling no user
    code (a validator that would now hang is never called)."""

    @store.periodic("* * * * *", name="hostile.tick", args={"order": {"n": 3}})
    def tick(order: Order) -> None: ...

    validator_mode["mode"] = "hang"  # calling it now would block this test for a minute
    start = datetime(2026, 1, 1, 12, 0, 30, tzinfo=UTC)
    scheduler = Scheduler(store)
    scheduler.run_once(now=start)  # first sight: remembered from now
    started = time.monotonic()
    assert scheduler.run_once(now=start + timedelta(minutes=1)) == 1
    assert time.monotonic() - started < 30
    [job] = store.jobs(name=tick.name)
    assert job.args == {"order": {"n": 3}}


# -- on the leader's thread ------------------------------------------------------------------
def test_a_hanging_backoff_delays_a_rescue_by_its_deadline_only(store: errands.App) -> None:
    """Given an expired lease of a job whose backoff never returns, the leader's tick
    rescues it within about the backoff deadline (1 s), with the default delay, and
    rescues the other expired leases of the same tick too."""
    hang = threading.Event()

    @store.job(name="hostile.rescue_hang", backoff=lambda attempt: hang.wait(60))
    def stuck() -> None: ...

    @store.job(name="hostile.rescue_fine")
    def fine() -> None: ...

    ids = {stuck.enqueue().id, fine.enqueue().id}
    claim_as_dead_worker(store)
    for job_id in ids:
        expire_lease(store, job_id)
    leader = Maintenance(store, "leader")
    started = time.monotonic()
    try:
        leader.run_once()
    finally:
        hang.set()
    assert time.monotonic() - started < 30  # bounded: the deadline, not the hang
    assert {store.get_job(i).state for i in ids} == {JobState.RETRYABLE}
    leader.stop()


def _expired_leases(store: errands.App, job: Any, n: int) -> set[int]:
    """``n`` jobs of ``job`` claimed by a worker that died: their leases expired."""
    ids = {job.enqueue(n=i).id for i in range(n)}
    claim_as_dead_worker(store)
    for job_id in ids:
        expire_lease(store, job_id)
    return ids


def test_a_hanging_backoff_is_asked_once_per_rescue_batch_not_once_per_job(
    store: errands.App,
) -> None:
    """Eight expired leases of one job type whose backoff hangs: the rescue asked it for
    each, one after another (a second each: 500 rows, 500 s, past the leader's lease).
    It gives up on that job type for the rest of the batch after the first timeout."""
    hang = threading.Event()
    asked: list[int] = []

    def slow(attempt: int) -> float:
        asked.append(attempt)
        hang.wait(60)
        return 1.0

    @store.job(name="hostile.rescue_many_hang", backoff=slow)
    def stuck(n: int) -> None: ...

    ids = _expired_leases(store, stuck, 8)
    leader = Maintenance(store, "leader")
    try:
        leader.run_once()
    finally:
        hang.set()
    assert len(asked) == 1
    assert {store.get_job(i).state for i in ids} == {JobState.RETRYABLE}
    leader.stop()


def test_a_slow_backoff_in_time_is_asked_only_within_a_share_of_the_leadership(
    store: errands.App,
) -> None:
    """A backoff policy that answers in time, slowly (0.4 s, under its 1 s deadline), was
    asked for every expired lease before anything was written (500 rows: minutes, past
    the leader's lease). Past a third of the leadership, the batch takes the default."""
    asked: list[int] = []

    def slow(attempt: int) -> float:
        asked.append(attempt)
        time.sleep(0.4)
        return 1.0

    @store.job(name="hostile.rescue_slow", backoff=slow)
    def stuck(n: int) -> None: ...

    ids = _expired_leases(store, stuck, 20)
    leader = Maintenance(store, "leader")
    try:
        leader.run_once()
    finally:
        leader.stop()
    budget_calls = leader.ttl / 3 / 0.4 + 1
    assert 1 <= len(asked) <= budget_calls < 20, (len(asked), leader.ttl)
    # every one rescued in the tick (a short delay may be due, promoted, by its end)
    assert {store.get_job(i).state for i in ids} <= {JobState.RETRYABLE, JobState.AVAILABLE}


def test_a_blocked_on_dead_hook_after_a_rescue_stops_no_later_rescue(
    store_url: str,
) -> None:
    """Given an on_dead hook that blocks, when a rescue makes a job dead (its last
    attempt lost), then the hook runs off the leader's thread: the next tick rescues
    another expired lease at once."""
    app = errands.App(store_url, hook_timeout=30)
    entered, release = threading.Event(), threading.Event()

    @app.on_dead
    def blocking(job: errands.Job) -> None:
        entered.set()
        release.wait(30)

    @app.job(name="hostile.last_attempt", retries=0)
    def last() -> None: ...

    @app.job(name="hostile.later")
    def later() -> None: ...

    leader = Maintenance(app, "leader")
    try:
        doomed = last.enqueue()
        claim_as_dead_worker(app)
        expire_lease(app, doomed.id)
        leader.run_once()
        assert doomed.status() is JobState.DEAD
        assert entered.wait(30), "the hook never ran"
        other = later.enqueue()
        claim_as_dead_worker(app)
        expire_lease(app, other.id)
        leader.run_once()  # the hook still blocks: this tick must not wait for it
        assert other.status() is JobState.RETRYABLE
        assert not release.is_set()
    finally:
        release.set()
        leader.stop()
        app.close()


def test_a_periodic_job_whose_slot_cannot_be_inserted_holds_back_no_other(
    store: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One periodic job whose insert fails (logged, retried next tick) does not keep the
    other periodic jobs' slots from being inserted."""

    @store.periodic("* * * * *", name="hostile.cron_ok")
    def ok() -> None: ...

    @store.periodic("* * * * *", name="hostile.cron_bad")
    def bad() -> None: ...

    original = store.enqueue_many

    def failing(jobs: list[Any], conn: Any = None) -> Any:
        if any(j.definition.name == "hostile.cron_bad" for j in jobs):
            raise RuntimeError("insert refused (test)")
        return original(jobs, conn=conn)

    monkeypatch.setattr(store, "enqueue_many", failing)
    start = datetime(2026, 1, 1, 12, 0, 30, tzinfo=UTC)
    scheduler = Scheduler(store)
    scheduler.run_once(now=start)
    assert scheduler.run_once(now=start + timedelta(minutes=1)) == 1
    assert [j.name for j in store.jobs()] == ["hostile.cron_ok"]


_SERIALIZER_GATE = threading.Event()


class SlowReceipt(BaseModel):
    n: int

    @model_serializer
    def hangs(self) -> dict[str, int]:
        _SERIALIZER_GATE.wait(60)
        return {"n": self.n}


def test_a_hanging_result_serializer_is_stopped_by_the_jobs_timeout(
    store: errands.App, worker: Worker
) -> None:
    """A result serializer runs where the handler runs, inside its timeout: one that
    hangs makes the attempt a timeout, and the worker's other jobs go on."""

    @store.job(name="hostile.slow_result", timeout=0.5, retries=0)
    def makes() -> SlowReceipt:
        return SlowReceipt(n=1)

    @store.job(name="hostile.after_slow")
    def after() -> str:
        return "ran"

    _SERIALIZER_GATE.clear()
    try:
        handle = makes.enqueue()
        with worker(concurrency=2, abandon_after=1.0):
            wait_until(lambda: handle.status() is JobState.DEAD, timeout=30, what="timed out")
            assert after.enqueue().result(timeout=30) == "ran"
    finally:
        _SERIALIZER_GATE.set()
    assert handle.job().last_error.kind == "timeout"  # type: ignore[union-attr]


def test_each_on_dead_hook_of_a_death_has_its_own_time_limit(store_url: str) -> None:
    """Given hook_timeout=2 and two on_dead hooks of 1.2 s each, when a job dies, then
    both run to their end: they shared one limit, the second was interrupted at 0.8 s
    and the death was marked done, so it never ran (a pager alert lost). (Each hook has
    0.8 s to spare: with 0.3 s, a CI machine at a load of 25 interrupted the first.)"""
    app = errands.App(store_url, hook_timeout=2.0)
    finished: list[str] = []

    @app.on_dead
    def first(job: errands.Job) -> None:
        time.sleep(1.2)
        finished.append("first")

    @app.on_dead
    def second(job: errands.Job) -> None:
        for _ in range(120):  # pure Python: an interrupt would land here
            time.sleep(0.01)
        finished.append("second")

    @app.job(name="hostile.dies_twice")
    def dies() -> None:
        raise errands.Permanent("no")

    from tests.conftest import running_worker

    try:
        with running_worker(app):
            dies.enqueue()
            wait_until(lambda: len(finished) == 2, timeout=30, what="both hooks")
        assert finished == ["first", "second"]
    finally:
        app.close()


def test_an_on_dead_hook_after_one_stopped_at_its_limit_is_timed_too(store_url: str) -> None:
    """Given hook_timeout=0.5 and hooks [hangs, hangs, pager], when a job dies, then each
    hanging hook is stopped at its own limit and the pager runs: the thread of a hook
    stopped at its limit was replaced and no longer watched, so the second hook ran
    without a limit, the pager never ran and the death was never marked done."""
    app = errands.App(store_url, hook_timeout=0.5)
    stopped: list[str] = []
    paged = threading.Event()

    def hanging(name: str) -> Callable[[errands.Job], None]:
        def hook(job: errands.Job) -> None:
            try:
                for _ in range(3000):  # 30 s of pure Python: an interrupt lands here
                    time.sleep(0.01)
            except BaseException:
                stopped.append(name)
                raise

        return hook

    app.on_dead(hanging("first"))
    app.on_dead(hanging("second"))

    @app.on_dead
    def pager(job: errands.Job) -> None:
        paged.set()

    @app.job(name="hostile.dies_thrice")
    def dies() -> None:
        raise errands.Permanent("no")

    from tests.conftest import running_worker

    try:
        with running_worker(app):
            handle = dies.enqueue()
            wait_until(paged.is_set, timeout=20, what="the pager, after two stopped hooks")
            assert stopped == ["first", "second"]
            wait_until(  # the death's hooks are marked done: the leader does not run them again
                lambda: not app.backend.dead_hooks_due(0, 10),
                timeout=10,
                what="the death marked done",
            )
        assert handle.status() is errands.JobState.DEAD
    finally:
        app.close()


def test_a_backoff_lane_answers_at_once_once_nothing_can_stop_its_stuck_call() -> None:
    """Given a lane with STUCK_MAX calls stuck where no interrupt lands (a socket read in
    C), a policy is still answered while the lane's own thread is free; once that thread
    is stuck too (and no more are replaced), a call fails at once (the caller takes the
    default backoff) instead of waiting out its whole deadline, every later call alike."""
    from errands.hooks import STUCK_MAX, Lane

    lane = Lane("backoff-test", time_limit=0.05)
    release = threading.Event()

    def stick(n: int) -> None:
        lane.submit(release.wait, 30)  # blocked in C: the interrupt waits for it to return
        deadline = time.monotonic() + 5
        while lane.timed_out < n and time.monotonic() < deadline:
            lane.watch(time.monotonic())
            time.sleep(0.01)

    try:
        for n in range(1, STUCK_MAX + 1):
            stick(n)
        assert lane.timed_out == STUCK_MAX
        assert lane.call(lambda: 2.0, timeout=5) == 2.0  # its serving thread is free
        lane.submit(release.wait, 30)  # ... and now stuck too, with none to replace it
        time.sleep(0.2)
        lane.watch(time.monotonic())
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="stuck past their limit"):
            lane.call(lambda: 2.0, timeout=5)
        assert time.monotonic() - started < 4  # not after the call's 5 s deadline
    finally:
        release.set()


def test_a_call_whose_every_hook_runs_past_its_limit_leaves_one_thread_serving() -> None:
    """Given a call of two hooks (Lane.timed), each stopped at its limit, the lane has one
    thread serving afterwards: the second stop replaced the already replaced thread
    again, and each such death left one more thread serving the lane for good."""
    from errands.hooks import HookTimeout, Lane

    lane = Lane("dead-test", time_limit=0.1)
    stopped: list[int] = []

    def hang() -> None:
        for _ in range(1000):  # 10 s of pure Python: an interrupt lands here
            time.sleep(0.01)

    def death() -> None:
        for n in range(2):
            try:
                with lane.timed():
                    hang()
            except HookTimeout:
                stopped.append(n)

    for _ in range(3):
        future = lane.submit(death)
        assert future is not None
        deadline = time.monotonic() + 10
        while not future.done() and time.monotonic() < deadline:
            lane.watch(time.monotonic())
            time.sleep(0.01)
        assert future.done()
    assert stopped == [0, 1] * 3
    time.sleep(0.1)  # the replaced threads leave after their call
    serving = [t for t in threading.enumerate() if t.name.startswith("errands-dead-test-")]
    assert len(serving) == 1, serving
    assert lane.call(lambda: "still served", timeout=5) == "still served"


def test_an_event_subscriber_after_one_stopped_at_its_limit_still_gets_the_event(
    store_url: str,
) -> None:
    """Given hook_timeout=0.5 and two subscribers, the first hanging on a completion, the
    second gets the event: they ran in one lane call with one shared limit, and the stop
    of the first (a BaseException) left the second without it."""
    app = errands.App(store_url, hook_timeout=0.5)
    got = threading.Event()

    @app.events.subscribe
    def hangs(event: Any) -> None:
        if event.name == "errands.job.completed":
            for _ in range(1000):  # 10 s of pure Python: an interrupt lands here
                time.sleep(0.01)

    @app.events.subscribe
    def pager(event: Any) -> None:
        if event.name == "errands.job.completed":
            got.set()

    @app.job(name="hostile.completes")
    def completes() -> int:
        return 1

    from tests.conftest import running_worker

    try:
        with running_worker(app):
            assert completes.enqueue().result(timeout=10) == 1
            wait_until(got.is_set, timeout=10, what="the second subscriber's event")
    finally:
        app.close()


def test_a_hanging_before_insert_hook_never_holds_up_the_leaders_cron_duty(
    store_url: str,
) -> None:
    """Given a before_insert hook that hangs on a periodic job's slot, the leader's tick
    comes back within about hook_timeout (the slot is tried again at the next tick)
    instead of waiting on the hook with every rescue behind it; once the hook answers,
    the slot is inserted once."""
    from errands.hooks import protect_current_thread

    app = errands.App(store_url, hook_timeout=2.0)
    hang = threading.Event()
    hang.set()

    @app.events.before_insert
    def stamp(requests: list[Any]) -> None:
        deadline = time.monotonic() + 30
        while hang.is_set() and time.monotonic() < deadline:  # the interrupt lands here
            time.sleep(0.01)
        for request in requests:
            request.meta["stamped"] = True

    @app.periodic("* * * * *", name="hostile.cron_hooked")
    def hooked() -> None: ...

    start = datetime(2026, 1, 1, 12, 0, 30, tzinfo=UTC)
    scheduler = Scheduler(app)
    protect_current_thread()  # as the maintenance leader's thread is
    try:
        scheduler.run_once(now=start)
        started = time.monotonic()
        assert scheduler.run_once(now=start + timedelta(minutes=1)) == 0  # logged, not stuck
        assert time.monotonic() - started < 20  # not the hook's whole hang
        hang.clear()
        # Tried again at the next ticks (on a busy machine the stopped call may still
        # hold the lane at the first of them; a late insert lands once, by its key).
        wait_until(
            lambda: (
                scheduler.run_once(now=start + timedelta(minutes=1, seconds=5)) >= 0
                and bool(app.jobs(name="hostile.cron_hooked"))
            ),
            timeout=30,
            what="the slot inserted once the hook answers",
        )
        [job] = app.jobs(name="hostile.cron_hooked")
        assert job.meta.get("stamped") is True
    finally:
        protect_current_thread(False)
        hang.clear()
        app.close()


def test_a_periodic_job_whose_hook_hangs_never_keeps_the_others_waiting(
    store_url: str,
) -> None:
    """A tick leaves its other periodic jobs to the next after an insert timed out (each
    could take a whole hook_timeout, far past the leader's lease), and the next tick
    starts after the one that timed out: the others are inserted, not starved."""
    from errands.hooks import protect_current_thread

    app = errands.App(store_url, hook_timeout=1.0)
    release = threading.Event()

    @app.events.before_insert
    def stamp(requests: list[Any]) -> None:
        deadline = time.monotonic() + 30
        while any(r.name == "hostile.cron_a" for r in requests) and not release.is_set():
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)  # pure Python: the lane's interrupt lands here

    for name in ("hostile.cron_a", "hostile.cron_b"):
        app.periodic("* * * * *", name=name)(lambda: None)

    start = datetime(2026, 1, 1, 12, 0, 30, tzinfo=UTC)
    scheduler = Scheduler(app)
    protect_current_thread()
    try:
        scheduler.run_once(now=start)
        assert scheduler.run_once(now=start + timedelta(minutes=1), go_on=lambda: False) == 0
        assert scheduler.run_once(now=start + timedelta(minutes=1)) == 0  # a times out first
        wait_until(
            lambda: (
                scheduler.run_once(now=start + timedelta(minutes=1, seconds=5)) >= 0
                and bool(app.jobs(name="hostile.cron_b"))
            ),
            timeout=30,
            what="b inserted while a's hook still hangs",
        )
    finally:
        protect_current_thread(False)
        release.set()
        app.close()


def _append(requests: list[Any]) -> None:
    requests.append(requests[0])


def _drop(requests: list[Any]) -> None:
    requests.pop()


def _unstorable_meta(requests: list[Any]) -> None:
    for request in requests:
        request.meta["hostile"] = datetime.now(UTC)  # not JSON


def _nan_meta(requests: list[Any]) -> None:
    for request in requests:
        request.meta["hostile"] = float("nan")  # invalid JSON on SQLite, refused by jsonb


def _nul_meta(requests: list[Any]) -> None:
    for request in requests:
        request.meta["hostile"] = "a\x00b"


def _priority(requests: list[Any]) -> None:
    for request in requests:
        request.meta["hostile"] = True
        request.priority = 2**40  # past what PostgreSQL's column holds


def _raises_midway(requests: list[Any]) -> None:
    requests[0].meta["hostile"] = True
    raise RuntimeError("hook broke halfway")


@pytest.mark.parametrize(
    "hook", [_append, _drop, _unstorable_meta, _nan_meta, _nul_meta, _priority, _raises_midway]
)
def test_a_before_insert_hook_that_meddles_is_undone_and_every_job_is_stored_once(
    store_url: str, hook: Callable[[list[Any]], None], caplog: pytest.LogCaptureFixture
) -> None:
    """A before_insert hook may add storable keys to each request's meta, nothing more.
    Given one that changes the list, a request's other fields, leaves a meta the store
    cannot hold, or raises halfway, what it did is undone and logged with its name, the
    hooks after it still run, and the jobs are stored once each. Before: an appended or
    dropped request stored the jobs and then raised to the caller (who retried: twice
    stored), a NaN meta was stored as invalid JSON on SQLite (every later enqueue with a
    key of that job failed), a datetime or a huge priority raised from deep inside."""
    app = errands.App(store_url)
    try:
        app.events.before_insert(hook)

        @app.events.before_insert
        def stamp(requests: list[Any]) -> None:
            for request in requests:
                request.meta["stamped"] = True

        @app.job(name="hostile.hooked")
        def hooked(n: int) -> None: ...

        with caplog.at_level(logging.ERROR, logger="errands.events"):
            handles = app.enqueue_many([hooked.bind(n=1), hooked.bind(n=2)])
            single = hooked.enqueue(n=3)
        assert len(handles) == 2
        stored = app.jobs(name="hostile.hooked")
        assert sorted(j.id for j in stored) == sorted([*(h.id for h in handles), single.id])
        assert all(j.meta == {"stamped": True} for j in stored)
        assert all(j.priority == 0 for j in stored)
        assert hook.__name__ in caplog.text
        hooked.enqueue(n=4, key="again")  # the store took nothing it cannot read back
    finally:
        app.close()
