"""Self-fencing and the heartbeats behind it, with real workers on both backends and
heartbeats that fail or answer slowly (a proxy in front of the real call): a handler whose
lease cannot be renewed is stopped before the lease runs out, whatever it is; its job is
given back uncharged; the worker claims nothing while its heartbeats fail; a failure is
retried within a second; a stale attempt or a job's own short lease never makes a healthy
job lose its lease.

Every test asserts outcomes (who ran, how often, what the store recorded); the leases are
long enough that a busy machine's scheduling delays do not decide them.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import errands
from errands.backends.base import HeartbeatResult, LeaseRef
from errands.jobs import JobState
from tests.conftest import needs_boottime, running_worker, suspend_host

from .helpers import force_rescue, wait_until

Worker = Callable[..., Any]


class Heartbeats:
    """The worker's heartbeat call seen through an outage: while ``failing`` (or, once
    armed with ``fail_for``, for that many seconds from the first call after arming), each
    call raises as an unreachable store does; ``delay`` makes each answer that late."""

    def __init__(self, real: Callable[[Any], HeartbeatResult]) -> None:
        self.real = real
        self.failing = False
        self.delay = 0.0
        self.failed = 0
        self.passed = 0  # calls that got through
        self.passed_after_failing = threading.Event()  # a call got through after a failure
        self._fail_for: float | None = None
        self._until: float | None = None
        self._lock = threading.Lock()

    def fail_for(self, seconds: float) -> None:
        with self._lock:
            self._fail_for, self._until = seconds, None

    def __call__(self, leases: list[LeaseRef]) -> HeartbeatResult:
        with self._lock:
            now = time.monotonic()
            if self._fail_for is not None and self._until is None:
                self._until = now + self._fail_for
            failing = self.failing or (self._until is not None and now < self._until)
            if failing:
                self.failed += 1
        if failing:
            raise OSError("the store is unreachable (test)")
        if self.delay:
            time.sleep(self.delay)
        result = self.real(leases)
        self.passed += 1
        if self.failed:
            self.passed_after_failing.set()
        return result


def _cut(app: errands.App, monkeypatch: pytest.MonkeyPatch) -> Heartbeats:
    heartbeats = Heartbeats(app.backend.job_heartbeat_many)
    monkeypatch.setattr(app.backend, "job_heartbeat_many", heartbeats)
    return heartbeats


@pytest.fixture
def app_with_lease(store_url: str) -> Iterator[Callable[[float], errands.App]]:
    """An App on the test's store with a lease of its own (the ``store`` fixture's is 3 s)."""
    apps: list[errands.App] = []

    def make(lease: float) -> errands.App:
        apps.append(errands.App(store_url, lease=lease))
        return apps[-1]

    yield make
    for app in apps:
        app.close()


def _kinds(job: Any) -> list[str]:
    return [e.kind for e in job.errors]


def _work_until(ctx: errands.Context, done: Callable[[], bool], cancelled: list[str]) -> str:
    """A handler's work, in 10 ms steps, until ``done()`` (60 s at most): "done", or "cut
    short" when asked to stop first (the reason appended to ``cancelled``)."""
    deadline = time.monotonic() + 60
    while not done() and time.monotonic() < deadline:
        if ctx.cancelled:
            cancelled.append(ctx.cancel_reason)
            return "cut short"
        time.sleep(0.01)
    return "done"


def _until_finished(
    app: errands.App,
    name: str,
    started: threading.Event,
    finish: threading.Event,
    cancelled: list[str],
) -> Any:
    """A job (no retries) whose handler sets ``started``, then works until ``finish`` is
    set ("done") or it is asked to stop ("cut short", the reason in ``cancelled``)."""

    @app.job(name=name, retries=0)
    def long(ctx: errands.Context) -> str:
        started.set()
        return _work_until(ctx, finish.is_set, cancelled)

    return long


def test_a_sync_handler_without_a_context_is_interrupted_when_its_lease_cannot_be_renewed(
    app_with_lease: Callable[[float], errands.App], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a plain sync handler (no ctx: ctx.cancelled cannot reach it) and heartbeats
    that fail, when its lease is about to run out, then the worker interrupts its thread
    (HandlerInterrupt, as a timeout does), so it does not run on beside the worker that
    takes the job over; the job is given back, the attempt not charged."""
    app = app_with_lease(6)
    started, stopped = threading.Event(), threading.Event()
    seen: list[str] = []

    @app.job(name="fence.plain", retries=0)
    def plain() -> None:
        started.set()
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                time.sleep(0.02)
        except BaseException as exc:
            seen.append(type(exc).__name__)
            raise
        finally:
            stopped.set()

    heartbeats = _cut(app, monkeypatch)
    handle = plain.enqueue()
    with running_worker(app, maintenance=False):
        assert started.wait(30)
        heartbeats.failing = True
        assert stopped.wait(30), "the handler ran on after its lease could not be renewed"
        wait_until(lambda: handle.job().errors, timeout=30, what="the job given back")
    assert seen == ["HandlerInterrupt"]
    job = handle.job()
    assert (job.state, job.attempt, _kinds(job)) == (JobState.AVAILABLE, 0, ["released"])


def test_a_worker_whose_heartbeats_fail_claims_no_new_job_until_one_gets_through(
    store: errands.App,
    worker: Worker,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Given a worker with a free slot whose heartbeats fail, a job enqueued once its
    claim loop has paused is not claimed by it (it would only run until self-fenced, and
    a job it gave back was claimed again here while its first run still went on); at the
    first heartbeat that gets through, it claims again and runs the job."""
    started = threading.Event()
    healed = threading.Event()
    starts: list[bool] = []  # for each start of the later job: whether heartbeats healed

    @store.job(name="pause.first", retries=3)
    def first(ctx: errands.Context) -> None:
        if started.is_set():  # run again once given back: done at once
            return
        started.set()
        deadline = time.monotonic() + 30
        while not ctx.cancelled and time.monotonic() < deadline:
            time.sleep(0.01)

    @store.job(name="pause.later")
    def later() -> str:
        starts.append(healed.is_set())
        return "ran"

    heartbeats = _cut(store, monkeypatch)
    with worker(concurrency=2, maintenance=False):
        first.enqueue()
        assert started.wait(30)
        heartbeats.failing = True
        # The claim loop's pause, not the failed heartbeat alone: a claim the loop sent
        # before the failure may still be on its way (on a loaded machine it took the job
        # enqueued next; it would run until self-fenced, as any job claimed just before).
        wait_until(
            lambda: any(r.getMessage().startswith("heartbeats fail:") for r in caplog.records),
            timeout=30,
            what="the claim loop paused",
        )
        handle = later.enqueue()
        time.sleep(2.0)  # room to claim it (a claim every 50 ms), were claims not paused
        healed.set()
        heartbeats.failing = False
        assert handle.result(timeout=30) == "ran"
    assert starts == [True]


def test_a_self_fenced_job_on_its_last_attempt_is_given_back_and_completes_once_the_store_is_back(
    store: errands.App, worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a job with no retries left whose heartbeats fail until it is self-fenced (its
    handler returns early on ctx.cancelled), then the attempt is not charged: the job is
    given back, not dead (charged, an outage killed it), and once the heartbeats get
    through it runs again and completes on attempt 1."""
    reasons: list[str] = []

    @store.job(name="fence.last", retries=0)
    def last(ctx: errands.Context) -> str:
        if not reasons:
            deadline = time.monotonic() + 30
            while not ctx.cancelled and time.monotonic() < deadline:
                time.sleep(0.01)
            reasons.append(ctx.cancel_reason)
            return "cut short"
        return "done"

    heartbeats = _cut(store, monkeypatch)
    heartbeats.failing = True
    with worker(maintenance=False):
        handle = last.enqueue()
        wait_until(lambda: handle.job().errors, timeout=30, what="the job given back")
        heartbeats.failing = False
        assert handle.result(timeout=30) == "done"
    job = handle.job()
    assert reasons == ["lease could not be renewed"]
    assert (job.state, job.attempt, _kinds(job)) == (JobState.COMPLETED, 1, ["released"])


def test_prefetched_jobs_self_fenced_before_they_began_are_given_back_uncharged(
    store: errands.App, worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given prefetched jobs waiting for a handler thread (never begun) when heartbeats
    fail long enough to self-fence them, then they are given back, not charged: each
    completes later on attempt 1, none dead (charged, retries=0 made them dead)."""
    blocker_started = threading.Event()

    @store.job(name="prefetch.quick", retries=0)
    def quick(i: int) -> int:
        return i

    @store.job(name="prefetch.blocker", retries=3, priority=10)
    def blocker(ctx: errands.Context) -> None:
        if ctx.attempt == 1 and not blocker_started.is_set():
            blocker_started.set()
            deadline = time.monotonic() + 30
            while not ctx.cancelled and time.monotonic() < deadline:
                time.sleep(0.01)

    heartbeats = _cut(store, monkeypatch)
    with worker(concurrency=1, maintenance=False) as w:
        warm = [quick.enqueue(i=i) for i in range(20)]  # quick handlers: the worker prefetches
        assert [h.result(timeout=30) for h in warm] == list(range(20))
        handles = store.enqueue_many([blocker.bind(), *(quick.bind(i=100 + i) for i in range(3))])
        assert blocker_started.wait(30)
        wait_until(
            lambda: sum(a.waiting for a in w.attempts()) == 3,
            timeout=30,
            what="three jobs prefetched, waiting for the busy thread",
        )
        heartbeats.failing = True
        wait_until(lambda: handles[0].job().errors, timeout=30, what="the blocker given back")
        heartbeats.failing = False
        results = [h.result(timeout=30) for h in handles]
    assert results == [None, 100, 101, 102]
    for handle in handles:
        job = handle.job()
        assert (job.state, job.attempt) == (JobState.COMPLETED, 1), job.errors
        assert set(_kinds(job)) <= {"released"}, job.errors


def test_a_stale_attempt_still_running_does_not_make_the_heartbeats_of_healthy_jobs_fail(
    store: errands.App, worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given an attempt whose lease was lost while its handler runs on (it ignores
    ctx.cancelled) and a store that answers heartbeats in 0.2 s, then a healthy job's
    heartbeats still get through: it is never asked to stop and completes (the stale
    lease, long run out, cut every heartbeat's wait to 50 ms, so each failed and the
    healthy job was self-fenced)."""
    stale_started, let_go = threading.Event(), threading.Event()
    cancelled: list[str] = []

    @store.job(name="stale.stubborn", retries=3)
    def stubborn() -> None:
        stale_started.set()
        let_go.wait(60)

    @store.job(name="stale.healthy", retries=0)
    def healthy(ctx: errands.Context) -> str:
        end = time.monotonic() + 5
        return _work_until(ctx, lambda: time.monotonic() >= end, cancelled)

    heartbeats = _cut(store, monkeypatch)
    try:
        with worker(concurrency=3, maintenance=False) as w:
            stale = stubborn.enqueue()
            assert stale_started.wait(30)
            force_rescue(store, stale.id)  # attempt 1 runs on, its lease lost
            wait_until(
                lambda: any(a.stop_reason == "lease lost" for a in w.attempts()),
                timeout=30,
                what="the worker told its lease is lost",
            )
            heartbeats.delay = 0.2
            handle = healthy.enqueue()
            assert handle.result(timeout=30) == "done"
            let_go.set()
    finally:
        let_go.set()
    assert cancelled == []
    job = handle.job()
    assert (job.state, job.attempt, job.errors) == (JobState.COMPLETED, 1, [])


def test_an_outage_spanning_two_heartbeats_but_ending_before_the_fence_fences_nothing(
    app_with_lease: Callable[[float], errands.App], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given an 18 s lease (a heartbeat every 6 s) and an outage of 6.3 s from the first
    failed heartbeat, which the next scheduled heartbeat falls in too, then the failed
    heartbeat is retried every second, the first after the outage renews the lease, and
    the handler is never asked to stop (the next try a whole interval later failed as well
    and self-fenced it, 12 s after its lease was last renewed)."""
    app = app_with_lease(18)
    started, finish = threading.Event(), threading.Event()
    cancelled: list[str] = []
    long = _until_finished(app, "outage.long", started, finish, cancelled)
    heartbeats = _cut(app, monkeypatch)
    with running_worker(app, maintenance=False):
        handle = long.enqueue()
        assert started.wait(30)
        heartbeats.fail_for(6.3)
        wait_until(
            lambda: heartbeats.passed_after_failing.is_set() or cancelled,
            timeout=60,
            what="a heartbeat through after the outage",
        )
        assert cancelled == []
        finish.set()
        assert handle.result(timeout=30) == "done"
    assert heartbeats.failed >= 2
    job = handle.job()
    assert (job.state, job.attempt, job.errors) == (JobState.COMPLETED, 1, [])


def test_a_job_whose_stored_lease_is_shorter_than_the_workers_heartbeat_runs_once(
    app_with_lease: Callable[[float], errands.App],
) -> None:
    """Given a job enqueued by an app that gave it a 3 s lease, run by a worker whose own
    lease is 30 s (a heartbeat every 10 s), then its lease is renewed in time (every
    second, a third of its own lease): the handler runs once and the job completes on
    attempt 1 (at the worker's 10 s, it was rescued while it ran, and ran twice at once)."""
    producer = app_with_lease(30)

    @producer.job(name="short.lease", lease=3, retries=3)
    def enqueued(seconds: float) -> None: ...

    app = app_with_lease(30)
    runs: list[float] = []

    @app.job(name="short.lease", retries=3)
    def run(seconds: float) -> str:
        runs.append(time.monotonic())
        time.sleep(seconds)
        return "done"

    handle = enqueued.enqueue(seconds=6.0)
    with running_worker(app, concurrency=2):
        wait_until(
            lambda: app.get_job(handle.id).state is JobState.COMPLETED,
            timeout=60,
            what="the job completed",
        )
    job = app.get_job(handle.id)
    assert len(runs) == 1
    assert (job.attempt, job.rescues, job.errors) == (1, 0, [])


@needs_boottime
def test_a_worker_resumed_from_a_suspend_past_its_lease_self_fences_at_its_first_failed_heartbeat(
    app_with_lease: Callable[[float], errands.App], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a handler holding a 60 s lease (a heartbeat every 20 s), when the host sleeps
    for two minutes and, once it wakes, the store is out of reach (the network not back
    yet), then the first heartbeat that fails stops the handler: its lease has run out
    at the store, which may have handed the job to another worker. The job is given back
    uncharged. The worker's clock had stopped during the suspend (CLOCK_MONOTONIC): it
    believed the lease good for most of a minute more, and the handler ran on meanwhile."""
    app = app_with_lease(60)
    started, stopped = threading.Event(), threading.Event()

    @app.job(name="suspend.fenced", retries=0)
    def long(ctx: errands.Context) -> str:
        started.set()
        try:
            return _work_until(ctx, lambda: False, [])
        finally:
            stopped.set()

    heartbeats = _cut(app, monkeypatch)
    with running_worker(app, maintenance=False) as w:
        handle = long.enqueue()
        assert started.wait(30)
        suspend_host(monkeypatch, 120)
        heartbeats.failing = True
        w.leases.poke()  # the keeper's next round at once (by itself: within a second)
        # (its lease already out: asked to stop, interrupted and given back at once)
        assert stopped.wait(15), "the handler ran on after a suspend longer than its lease"
        wait_until(lambda: handle.job().errors, timeout=30, what="the job given back")
    job = handle.job()
    assert (job.state, job.attempt, _kinds(job)) == (JobState.AVAILABLE, 0, ["released"])
    assert "lease could not be renewed" in job.errors[0].message


@needs_boottime
def test_a_worker_resumed_from_a_suspend_whose_heartbeat_gets_through_keeps_its_job(
    app_with_lease: Callable[[float], errands.App], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a handler holding a 60 s lease, when the host sleeps for two minutes and its
    first heartbeat after waking gets through (no worker took the job meanwhile, so the
    store renews the lease, fenced by its token), then the handler is never asked to
    stop and the job completes on attempt 1: the store's answer decides, not the time
    the worker slept."""
    app = app_with_lease(60)
    started, finish = threading.Event(), threading.Event()
    cancelled: list[str] = []
    long = _until_finished(app, "suspend.kept", started, finish, cancelled)
    heartbeats = _cut(app, monkeypatch)
    with running_worker(app, maintenance=False) as w:
        handle = long.enqueue()
        assert started.wait(30)
        before = heartbeats.passed
        suspend_host(monkeypatch, 120)
        w.leases.poke()  # the keeper's next round at once (by itself: within a second)
        wait_until(
            lambda: heartbeats.passed > before, timeout=15, what="a heartbeat after the suspend"
        )
        finish.set()
        assert handle.result(timeout=30) == "done"
    assert cancelled == []
    job = handle.job()
    assert (job.state, job.attempt, job.errors) == (JobState.COMPLETED, 1, [])


@needs_boottime
def test_the_heartbeat_overdue_after_a_suspend_is_sent_at_once_without_a_poke(
    app_with_lease: Callable[[float], errands.App], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a handler holding a 150 s lease (a heartbeat every 50 s) and the lease
    keeper waiting for the next one, when the host sleeps for three minutes, then the
    keeper sends the overdue heartbeat within seconds of waking, by the clock that
    counted the suspend. Its wait ran on CLOCK_MONOTONIC, which a suspend stops: it woke
    up to a whole interval (here 50 s) late, while the store had let the lease run out."""
    app = app_with_lease(150)
    started, finish = threading.Event(), threading.Event()
    cancelled: list[str] = []
    long = _until_finished(app, "suspend.overdue", started, finish, cancelled)
    heartbeats = _cut(app, monkeypatch)
    with running_worker(app, maintenance=False):
        handle = long.enqueue()
        assert started.wait(30)
        before = heartbeats.passed  # the next heartbeat is due 50 s after the worker began
        suspend_host(monkeypatch, 180)  # no poke: the keeper must notice by itself
        try:
            wait_until(
                lambda: heartbeats.passed > before,
                timeout=20,
                what="the overdue heartbeat after the suspend",
            )
        finally:
            finish.set()
        assert handle.result(timeout=30) == "done"
    assert cancelled == []


def test_a_self_fenced_async_handler_is_given_back_off_the_event_loop(
    store: errands.App, worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given an async handler that returns once self-fencing cancels it, while the store
    does not answer, its job's give-back waits for the store: it waited on the event
    loop, and every other async job of the worker stood still meanwhile. Here the
    give-back is held until another async job on the loop has moved on."""
    import asyncio

    ticks: list[float] = []
    loop_moved = threading.Event()
    stop_ticking = threading.Event()

    runs: list[int] = []

    @store.job(name="fence.async_coop", retries=3)
    async def coop(ctx: errands.Context) -> str:
        runs.append(1)
        if len(runs) > 1:  # given back, then run again once the store answers
            return "done"
        while not ctx.cancelled:
            try:
                await asyncio.sleep(0.02)
            except asyncio.CancelledError:
                return "stopped on its cancel"
        return "stopped early"

    @store.job(name="fence.async_ticker")
    async def ticker() -> int:
        while not stop_ticking.is_set():
            ticks.append(time.monotonic())
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.02)
        return len(ticks)

    heartbeats = _cut(store, monkeypatch)
    release = store.backend.job_release_many
    held: list[str] = []

    def slow_release(refs: Any, message: str, **options: Any) -> Any:
        # the store not answering, until the loop shows it turns meanwhile
        held.append(threading.current_thread().name)
        start = len(ticks)
        deadline = time.monotonic() + 15
        while len(ticks) < start + 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        if len(ticks) >= start + 3:
            loop_moved.set()
        return release(refs, message, **options)

    monkeypatch.setattr(store.backend, "job_release_many", slow_release)
    ticking = ticker.enqueue()
    with worker(concurrency=4, maintenance=False):
        handle = coop.enqueue()
        wait_until(lambda: handle.status() is JobState.RUNNING, what="its start")
        heartbeats.failing = True
        wait_until(lambda: held, timeout=30, what="the self-fenced job's give-back")
        assert loop_moved.wait(20), "the event loop stood still while the job was given back"
        heartbeats.failing = False
        stop_ticking.set()
        assert ticking.result(timeout=30) > 0
        assert handle.result(timeout=30) == "done"
    assert "errands-loop" not in held
