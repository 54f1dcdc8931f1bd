"""Prefetch: a worker with quick handlers claims a batch beyond its slots (DESIGN §7).

Prefetched jobs are claimed (running, leased, heartbeated) but wait for a handler thread;
they never make more than ``concurrency`` handlers run at once, go back to the queue at
once on a graceful stop, end cancelled without running when cancelled while waiting,
and are not taken at all while handlers are slow.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from typing import Any

import pytest

import errands
from errands import JobState

from .helpers import (
    WorkerThread,
    claim_as_dead_worker,
    execute_sql,
    force_rescue,
    query,
    raw_row,
    wait_until,
)


def states(app: errands.App, name: str) -> dict[str, int]:
    rows = query(
        app, "SELECT state, count(*) FROM errands_jobs WHERE name = ? GROUP BY state", (name,)
    )
    return {state: count for state, count in rows}


async def until_set(gate: threading.Event) -> None:
    """Await ``gate`` on the event loop: 20 s at most, as a sync handler's gate.wait(20)."""
    for _ in range(2000):
        if gate.is_set():
            return
        await asyncio.sleep(0.01)


KINDS = ["sync", "async"]  # a handler thread's jobs, and the event loop's (its slots)


class Blocked:
    """A job whose handlers block on a gate, counting how many run at once; ``kind``
    "async": an ``async def`` handler, which waits on the worker's event loop."""

    def __init__(
        self, app: errands.App, name: str = "pf.blocked", lease: float = 1, kind: str = "sync"
    ) -> None:
        self.gate = threading.Event()
        self.ran: list[int] = []
        self.peak = 0
        self._now = 0
        self._lock = threading.Lock()

        def began(n: int) -> None:
            with self._lock:
                self.ran.append(n)
                self._now += 1
                self.peak = max(self.peak, self._now)

        def ended() -> None:
            with self._lock:
                self._now -= 1

        if kind == "async":

            @app.job(name=name, lease=lease)
            async def blocked_async(n: int) -> None:
                began(n)
                try:
                    await until_set(self.gate)
                finally:
                    ended()

            self.job = blocked_async
            return

        @app.job(name=name, lease=lease)
        def blocked(n: int) -> None:
            began(n)
            try:
                self.gate.wait(20)
            finally:
                ended()

        self.job = blocked

    def finish(self, handles: list[errands.JobHandle]) -> None:
        """Open the gate and wait for every job to end."""
        self.gate.set()
        for handle in handles:
            handle.result(timeout=10)

    @property
    def running(self) -> int:
        with self._lock:
            return self._now


def learn_handlers_are_quick(app: errands.App, kind: str = "sync") -> None:
    """Quick jobs first: the worker prefetches once its handlers are seen to be quick.
    Of the same ``kind`` as the others (a worker of one kind of handler)."""
    if kind == "async":

        @app.job(name="pf.quick")
        async def quick_async(n: int) -> int:
            return n

        job: errands.JobDefinition[..., int] = quick_async
    else:

        @app.job(name="pf.quick")
        def quick(n: int) -> int:
            return n

        job = quick
    for handle in [job.enqueue(n=i) for i in range(10)]:
        handle.result(timeout=10)


@pytest.mark.parametrize("kind", KINDS)
def test_quick_handlers_get_jobs_prefetched_yet_never_more_than_concurrency_run_at_once(
    app: errands.App, worker_factory, kind: str
) -> None:
    blocked = Blocked(app, kind=kind)
    with worker_factory(concurrency=2, prefetch=2):
        learn_handlers_are_quick(app, kind)
        handles = [blocked.job.enqueue(n=i) for i in range(6)]
        # two run, two more are claimed and wait for a thread
        wait_until(lambda: states(app, "pf.blocked").get("running") == 4, what="4 claimed")
        time.sleep(0.3)
        assert states(app, "pf.blocked") == {"running": 4, "available": 2}
        assert blocked.running == 2
        blocked.finish(handles)

    assert blocked.peak == 2
    assert sorted(blocked.ran) == list(range(6))
    assert {h.job().attempt for h in handles} == {1}


class BothKinds:
    """A sync and an async job whose handlers block on one gate, counted together."""

    def __init__(self, app: errands.App) -> None:
        self.gate = threading.Event()
        self.ran: list[str] = []
        self.peak = self.now = 0
        self._lock = threading.Lock()

        @app.job(name="pf.both_sync", lease=5)
        def both_sync(n: int) -> None:
            self._began(f"sync-{n}")
            try:
                self.gate.wait(20)
            finally:
                self._ended()

        @app.job(name="pf.both_async", lease=5)
        async def both_async(n: int) -> None:
            self._began(f"async-{n}")
            try:
                await until_set(self.gate)
            finally:
                self._ended()

        @app.job(name="pf.both_quick_sync")
        def quick_sync(n: int) -> int:
            return n

        @app.job(name="pf.both_quick_async")
        async def quick_async(n: int) -> int:
            return n

        self.sync_job, self.async_job = both_sync, both_async
        self.quick = (quick_sync, quick_async)

    def _began(self, name: str) -> None:
        with self._lock:
            self.ran.append(name)
            self.now += 1
            self.peak = max(self.peak, self.now)

    def _ended(self) -> None:
        with self._lock:
            self.now -= 1

    def learn_quick(self) -> None:
        for job in self.quick:
            for handle in [job.enqueue(n=i) for i in range(10)]:
                handle.result(timeout=10)

    def claimed(self, app: errands.App) -> dict[str, int]:
        both = Counter(states(app, "pf.both_sync")) + Counter(states(app, "pf.both_async"))
        return dict(both)


def test_a_worker_with_sync_and_async_handlers_prefetches_yet_runs_at_most_concurrency(
    app: errands.App, worker_factory
) -> None:
    """A worker of an app with both kinds of handler prefetches, as one of either kind
    does (it claimed only -c jobs a round: its sync handlers ran on -c threads and its
    async ones in the loop's -c slots, so prefetched jobs of both could have run up to
    twice -c). Its sync handlers take the loop's slots too: two async jobs hold both
    slots, the prefetched sync jobs wait for them on free threads, and never more than
    -c handlers run at once."""
    both = BothKinds(app)
    with worker_factory(concurrency=2, prefetch=2) as worker:
        assert worker.prefetch == 2
        both.learn_quick()
        first = [both.async_job.enqueue(n=i) for i in range(2)]
        wait_until(lambda: both.now == 2, what="two async handlers holding both slots")
        rest = [both.sync_job.enqueue(n=i) for i in range(3)]
        rest.append(both.async_job.enqueue(n=2))
        # the two slots busy, two more jobs claimed (prefetched): sync ones on free threads
        wait_until(lambda: both.claimed(app).get("running") == 4, what="4 claimed")
        time.sleep(0.3)
        assert both.claimed(app) == {"running": 4, "available": 2}
        assert both.now == 2, both.ran
        both.gate.set()
        for handle in first + rest:
            handle.result(timeout=10)

    assert both.peak == 2
    assert sorted(both.ran) == ["async-0", "async-1", "async-2", "sync-0", "sync-1", "sync-2"]
    assert {h.job().attempt for h in first + rest} == {1}


def test_a_stop_gives_back_the_sync_jobs_waiting_for_slots_async_handlers_hold(
    app: errands.App, start_worker
) -> None:
    """The prefetched sync jobs of a worker with both kinds wait on threads of their own
    for a slot: a stop gives them back at once (not run, not charged), and the worker
    stops once the running handlers end, its waiting threads let go."""
    both = BothKinds(app)
    worker = start_worker(concurrency=2, prefetch=2, grace=20)
    both.learn_quick()
    running = [both.async_job.enqueue(n=i) for i in range(2)]
    wait_until(lambda: both.now == 2, what="two async handlers holding both slots")
    waiting = [both.sync_job.enqueue(n=i) for i in range(2)]
    wait_until(lambda: both.claimed(app).get("running") == 4, what="4 claimed")
    time.sleep(0.2)  # (the sync jobs' threads wait for a slot)

    worker.worker.stop()
    wait_until(
        lambda: all(h.status() is JobState.AVAILABLE for h in waiting),
        what="the waiting sync jobs given back",
        timeout=30,
    )
    both.gate.set()
    assert worker.stop() < 15
    assert worker.exit_code == 0
    assert all(h.status() is JobState.COMPLETED for h in running)
    assert {h.job().attempt for h in waiting} == {0}  # released, the attempt not charged
    assert sorted(both.ran) == ["async-0", "async-1"]  # the sync ones never ran
    assert worker.worker.stuck_threads() == 0


def test_a_sync_handler_abandoned_past_its_timeout_gives_its_slot_to_an_async_job(
    app: errands.App, worker_factory
) -> None:
    """In a worker with both kinds, a sync handler that ignores its timeout (blocked in C:
    the interrupt never lands) is abandoned ``abandon_after`` later, and its slot goes to
    the next job, here an async one, while the stuck thread runs on."""
    release = threading.Event()

    @app.job(name="pf.stuck_sync", timeout=0.2, retries=0)
    def stuck() -> None:
        release.wait(30)

    @app.job(name="pf.next_async")
    async def next_async() -> str:
        return "ran"

    try:
        with worker_factory(concurrency=1, prefetch=2, abandon_after=0.5) as worker:
            assert worker.shares_slots
            handle = stuck.enqueue()
            wait_until(lambda: handle.status() is JobState.RUNNING, what="the stuck job's start")
            assert next_async.enqueue().result(timeout=10) == "ran"
            job = handle.job()
            assert job.state is JobState.DEAD
            assert "abandoned" in job.errors[-1].message
            release.set()
    finally:
        release.set()


def test_a_plain_handlers_slot_is_given_back_where_no_interrupt_can_land(
    app: errands.App, worker_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a worker with both kinds, a plain handler's slot is given back once its call is
    over, not at the end of the call: a timeout's HandlerInterrupt may be aimed at a call
    until it is over, and one landing between the slot's release and its hand-over lost
    the slot (or the waiter it was handed to) for good: a handler short from then on."""
    from errands.worker.runners import HandlerSlots

    seen: list[bool] = []
    give = HandlerSlots.give
    holder: list[Any] = []

    def recording_give(self: HandlerSlots) -> None:
        worker = holder[0]
        seen.append(threading.get_ident() in worker.threads._running)
        give(self)

    monkeypatch.setattr(HandlerSlots, "give", recording_give)

    @app.job(name="pf.plain")
    def plain(n: int) -> int:
        return n

    @app.job(name="pf.in_the_loop")
    async def in_the_loop() -> None:
        return None

    with worker_factory(concurrency=2, prefetch=4) as worker:
        holder.append(worker)
        assert worker.shares_slots
        assert [h.result(timeout=10) for h in [plain.enqueue(n=i) for i in range(5)]] == [
            0,
            1,
            2,
            3,
            4,
        ]
    assert seen and not any(seen)  # given back, never inside the call


@pytest.mark.parametrize("kind", KINDS)
def test_prefetched_jobs_go_back_to_the_queue_at_once_on_stop_and_are_not_charged(
    app: errands.App, start_worker, kind: str
) -> None:
    blocked = Blocked(app, lease=5, kind=kind)  # a 1 s lease can lapse on a busy machine meanwhile
    worker = start_worker(concurrency=2, prefetch=2, grace=20)
    learn_handlers_are_quick(app, kind)
    handles = [blocked.job.enqueue(n=i) for i in range(4)]
    wait_until(lambda: states(app, "pf.blocked").get("running") == 4, what="4 claimed")
    # two handlers running, two claimed jobs waiting for a thread (on a busy machine the
    # handler threads can start well after the claim: stopping before they do releases all 4)
    wait_until(lambda: blocked.running == 2, what="two handlers running")

    worker.worker.stop()  # like SIGTERM: the two waiting jobs are released right away...
    seen: list[object] = []

    def released() -> bool:
        seen[:] = [states(app, "pf.blocked"), sorted(blocked.ran), worker.worker.attempts()]
        return seen[0] == {"running": 2, "available": 2}

    try:
        wait_until(released, timeout=30, what="the prefetched jobs released, the others running")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; states, ran, attempts: {seen}") from None
    blocked.gate.set()  # ...and the running ones finish within the grace period
    worker.stop()

    assert worker.exit_code == 0
    done = [h for h in handles if h.status() is JobState.COMPLETED]
    back = [h for h in handles if h.status() is JobState.AVAILABLE]
    assert len(done) == 2 and len(back) == 2
    assert sorted(blocked.ran) == sorted(h.job().args["n"] for h in done)
    assert {h.job().attempt for h in back} == {0}  # released, the attempt not charged


@pytest.mark.parametrize("kind", KINDS)
def test_prefetched_jobs_given_back_at_a_stop_gain_no_error_entry_and_keep_their_place(
    each_store_url: str, kind: str
) -> None:
    """On both stores: the prefetched jobs a stopping worker gives back never ran, so
    nothing is recorded on them (no ``released`` entry), the attempt is not charged, and
    each keeps its due time (its place in the queue). Each such release appended an
    entry: a job found prefetched at every deploy gained one per deploy."""
    app = errands.App(each_store_url)
    try:
        blocked = Blocked(app, lease=5, kind=kind)
        worker = WorkerThread(app, concurrency=1, prefetch=2, grace=20).start()
        try:
            learn_handlers_are_quick(app, kind)
            handles = [blocked.job.enqueue(n=i) for i in range(3)]
            due = {h.id: h.job().run_at for h in handles}
            wait_until(
                lambda: all(h.status() is JobState.RUNNING for h in handles),
                what="one running, two prefetched",
            )
            wait_until(lambda: blocked.running == 1, what="one handler running")
            [ran] = blocked.ran
            prefetched = [h for h in handles if h.job().args["n"] != ran]

            worker.worker.stop()  # like SIGTERM: the two waiting jobs go back at once
            wait_until(
                lambda: all(h.status() is JobState.AVAILABLE for h in prefetched),
                timeout=30,
                what="the prefetched jobs given back",
            )
        finally:
            blocked.gate.set()
            worker.stop()

        assert blocked.ran == [ran]
        for handle in prefetched:
            job = handle.job()
            assert (job.state, job.attempt, job.errors) == (JobState.AVAILABLE, 0, [])
            assert job.run_at == due[handle.id]
    finally:
        app.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_job_cancelled_while_prefetched_ends_cancelled_without_running(
    app: errands.App, worker_factory, kind: str
) -> None:
    blocked = Blocked(app, kind=kind)
    with worker_factory(concurrency=1) as worker:
        learn_handlers_are_quick(app, kind)
        first = blocked.job.enqueue(n=1)
        waiting = blocked.job.enqueue(n=2)
        wait_until(lambda: states(app, "pf.blocked").get("running") == 2, what="both claimed")
        wait_until(lambda: blocked.ran == [1], what="the first one running")

        assert waiting.cancel().state == "running"  # cancel requested; the lease says so
        wait_until(  # a heartbeat (a third of the 1 s lease) delivers the cancel
            lambda: (
                any(a.id == waiting.id and a.stop_reason for a in worker.attempts())
                # an async one ends at once: it leaves its wait for a slot of the loop
                or (kind == "async" and waiting.status() is JobState.CANCELLED)
            ),
            what="the cancel delivered to the prefetched attempt",
        )
        blocked.gate.set()
        assert first.result(timeout=10) is None
        wait_until(lambda: waiting.status() is JobState.CANCELLED, what="the cancelled job")

    assert blocked.ran == [1]
    assert waiting.job().attempt == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_prefetched_job_whose_lease_ran_out_while_it_waited_is_handed_back_not_run(
    app: errands.App, worker_factory, kind: str
) -> None:
    blocked = Blocked(app, lease=30, kind=kind)  # heartbeats every 10 s: none lands during the test
    released: list[int] = []
    app.events.subscribe(
        lambda e: released.append(e["job_id"]) if e.name == "errands.job.released" else None
    )
    with worker_factory(concurrency=1, prefetch=2) as worker:
        learn_handlers_are_quick(app, kind)
        first = blocked.job.enqueue(n=1)
        late = blocked.job.enqueue(n=2)
        wait_until(lambda: states(app, "pf.blocked").get("running") == 2, what="both claimed")
        wait_until(lambda: blocked.ran == [1], what="the first one running")
        # As after a freeze past the lease: no heartbeat vouches for the waiting one now.
        [waiting] = [a for a in worker.attempts() if a.id == late.id]
        waiting.lease_valid_until = 0.0
        blocked.finish([first, late])  # it is handed back, claimed again and run then

    assert released == [late.id]
    assert late.job().attempt == 1  # the hand-back did not charge an attempt
    assert sorted(blocked.ran) == [1, 2]


def test_a_prefetched_job_a_stop_took_as_its_lease_ran_out_is_released_by_the_stop_alone(
    app: errands.App, worker_factory
) -> None:
    """A sync job whose lease ran out while it waited, taken by a graceful stop in the same
    instant its thread took it up: the stop releases it; the thread no longer releases it
    too (a second release, refused by the fence, reported a stale write)."""
    blocked = Blocked(app, lease=30)
    released: list[int] = []
    app.events.subscribe(
        lambda e: released.append(e["job_id"]) if e.name == "errands.job.released" else None
    )
    with worker_factory(concurrency=1, prefetch=2) as worker:
        learn_handlers_are_quick(app)
        first = blocked.job.enqueue(n=1)
        late = blocked.job.enqueue(n=2)
        wait_until(lambda: states(app, "pf.blocked").get("running") == 2, what="both claimed")
        wait_until(lambda: blocked.ran == [1], what="the first one running")
        [waiting] = [a for a in worker.attempts() if a.id == late.id]
        waiting.lease_valid_until = 0.0
        took: list[bool] = []
        begin = waiting.begin

        def begin_as_the_stop_takes_it() -> bool:
            began = begin()
            took.append(waiting.give_back())  # the stop takes it (and writes its release)
            return began

        waiting.begin = begin_as_the_stop_takes_it  # type: ignore[method-assign]
        blocked.finish([first])
        wait_until(lambda: not waiting.waiting, what="a thread to take the late one up")

    assert took == [True]
    assert released == []
    assert blocked.ran == [1]


def test_an_async_job_whose_lease_ran_out_before_it_began_is_given_back_recording_nothing(
    app: errands.App, worker_factory
) -> None:
    """An async job claimed while the event loop stood still (another handler blocking it)
    whose lease ran out before its handler began: it is handed back as a prefetched job
    is, with nothing recorded on the job (no error entry, its place in the queue kept),
    then claimed again and run once. It was given back as if an attempt had run (an entry
    of kind ``released`` naming an attempt that never began)."""
    gate = threading.Event()
    ran: list[str] = []
    released: list[int] = []
    app.events.subscribe(
        lambda e: released.append(e["job_id"]) if e.name == "errands.job.released" else None
    )

    @app.job(name="pf.loop_blocker", lease=30)  # heartbeats every 10 s: none in the test
    async def loop_blocker() -> None:
        ran.append("blocker")
        gate.wait(20)  # blocking code on the loop: no other async job begins meanwhile

    @app.job(name="pf.async_late", lease=30)
    async def async_late() -> None:
        ran.append("late")

    with worker_factory(concurrency=2, prefetch=0) as worker:
        blocker = loop_blocker.enqueue()
        wait_until(lambda: ran == ["blocker"], what="the loop blocked")
        late = async_late.enqueue()
        wait_until(
            lambda: any(a.id == late.id for a in worker.attempts()),
            what="the late job claimed, waiting for the loop",
        )
        due = late.job().run_at
        # As after a loop blocked past the lease: no heartbeat vouches for it now.
        [waiting] = [a for a in worker.attempts() if a.id == late.id]
        waiting.lease_valid_until = 0.0
        gate.set()  # it is handed back, claimed again and run then
        assert blocker.result(timeout=10) is None
        assert late.result(timeout=10) is None

    assert released == [late.id]
    job = late.job()
    assert job.errors == []  # nothing happened to it: nothing recorded
    assert job.attempt == 1  # the hand-back did not charge an attempt
    assert job.run_at == due  # its place in the queue kept
    assert ran == ["blocker", "late"]


def test_slow_handlers_get_no_job_prefetched(app: errands.App, worker_factory) -> None:
    blocked = Blocked(app)

    @app.job(name="pf.slow")
    def slow() -> None:
        time.sleep(0.2)

    with worker_factory(concurrency=1):
        slow.enqueue().result(timeout=10)  # a 0.2 s handler: a waiting job would idle 0.2 s
        handles = [blocked.job.enqueue(n=i) for i in range(3)]
        wait_until(lambda: blocked.running == 1, what="the first blocked job running")
        time.sleep(0.3)
        assert states(app, "pf.blocked") == {"running": 1, "available": 2}
        blocked.finish(handles)


@pytest.mark.parametrize("kind", KINDS)
def test_prefetch_zero_claims_no_job_beyond_concurrency(
    app: errands.App, worker_factory, kind: str
) -> None:
    blocked = Blocked(app, kind=kind)
    with worker_factory(concurrency=2, prefetch=0):
        learn_handlers_are_quick(app, kind)
        handles = [blocked.job.enqueue(n=i) for i in range(4)]
        wait_until(lambda: blocked.running == 2, what="two blocked jobs running")
        time.sleep(0.3)
        assert states(app, "pf.blocked") == {"running": 2, "available": 2}
        blocked.finish(handles)


def test_the_default_prefetch_is_four_jobs_per_slot(app: errands.App) -> None:
    # Celery's default (worker_prefetch_multiplier = 4); the run-time bound still applies
    assert app.worker(concurrency=3).prefetch == 12
    assert app.worker(concurrency=3, prefetch=5).prefetch == 5


def test_a_fair_queue_of_quick_jobs_prefetches_sixteen_jobs_per_slot_not_four(
    app: errands.App, worker_factory
) -> None:
    """A fair claim reads and ranks a window of keys (~2.5 x a plain claim's time), and a
    worker takes about half its room per claim while the other half runs: at a plain
    queue's 4 jobs per slot a fair queue of 1,000 keys and no-op jobs ran at half a plain
    one's pace (bench/fairness.py). The horizon still bounds it (slow jobs: none)."""
    app.queue("pf.fair", fair=True)
    gate = threading.Event()

    @app.job(name="pf.fairblocked", queue="pf.fair", fair_key="{n}", lease=5)
    def fair_blocked(n: int) -> None:
        gate.wait(20)

    with worker_factory(concurrency=2, express=0):  # (no express lane: slots only)
        learn_handlers_are_quick(app)
        handles = app.enqueue_many([fair_blocked.bind(n=i) for i in range(50)])  # at once
        # two run, 16 x 2 more are claimed and wait for a thread
        wait_until(lambda: states(app, "pf.fairblocked").get("running") == 34, what="34 claimed")
        time.sleep(0.3)
        assert states(app, "pf.fairblocked") == {"running": 34, "available": 16}
        gate.set()
        for handle in handles:
            handle.result(timeout=10)


def test_a_given_prefetch_bounds_a_fair_queues_too(app: errands.App) -> None:
    app.queue("pf.fair", fair=True)

    @app.job(name="pf.fairjob", queue="pf.fair", fair_key="{n}")
    def fair_job(n: int) -> None: ...

    assert app.worker(concurrency=3).fair_prefetch == 48
    assert app.worker(concurrency=3, prefetch=5).fair_prefetch == 5
    assert app.worker(concurrency=3, prefetch=0).fair_prefetch == 0
    # a larger one: still 16 per slot (the window of keys read under the claim lock)
    assert app.worker(concurrency=3, prefetch=1024).fair_prefetch == 48


def test_a_worker_without_a_fair_queue_holds_no_more_unwritten_outcomes_than_before(
    app: errands.App,
) -> None:
    """The deeper prefetch is a fair queue's: a worker without one keeps its cap of
    outcomes waiting to be written at twice its slots and prefetch (I9: a worker that
    held 505 when it lost its store queued them all for isolated runs)."""
    worker = app.worker(concurrency=10)
    assert (worker.fair_prefetch, worker._unwritten_max) == (0, 2 * (10 + 40))


def test_a_rescued_job_of_a_fair_queue_starts_ahead_of_its_prefetched_backlog(
    app: errands.App,
) -> None:
    """A rescued job is claimed by the suspect claim, which took only the plain prefetch
    room: a fair queue's deeper prefetch kept that room below zero while its backlog
    lasted, and a rescued job of the queue waited behind the whole backlog. Counted in
    jobs, not seconds: it starts with most of the backlog still waiting."""
    app.queue("pf.fairq", fair=True)
    done: list[int] = []
    at_start: list[int] = []

    @app.job(name="pf.fq", queue="pf.fairq", fair_key="{k}")
    def fq(k: str, n: int) -> None:
        if n < 0:
            at_start.append(len(done))
        time.sleep(0.0005)
        done.append(n)

    backlog = 20_000
    app.enqueue_many([fq.bind(k=f"noisy{i % 3}", n=i) for i in range(backlog)])
    worker = app.worker(concurrency=4, queues=["pf.fairq"], poll_interval=0.2, express=0)
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    thread.start()
    try:
        wait_until(lambda: len(done) >= 1_000, timeout=60, what="the backlog running")
        victim = fq.enqueue(k="victim", n=-1, delay=3600)
        made = execute_sql(
            app,
            "UPDATE errands_jobs SET rescues = 1, attempt = 1, state = 'available', "
            "run_at = 0 WHERE id = ?",
            (victim.id,),
        )
        assert made == 1
        wait_until(lambda: at_start or len(done) >= backlog, timeout=120, what="the rescued job")
        assert at_start and at_start[0] < backlog // 2, (at_start, len(done))
    finally:
        worker.stop()
        thread.join(60)


def test_a_worker_of_async_handlers_alone_prefetches_four_jobs_per_slot(app: errands.App) -> None:
    @app.job(name="pf.async")
    async def in_the_loop() -> None:
        return None

    # prefetched jobs wait on the loop for one of its -c slots, as for a handler thread
    assert app.worker(concurrency=4).prefetch == 16


def test_a_worker_that_serves_both_sync_and_async_handlers_prefetches_through_shared_slots(
    app: errands.App,
) -> None:
    @app.job(name="pf.async")
    async def in_the_loop() -> None:
        return None

    @app.job(name="pf.sync")
    def in_a_thread() -> None:
        return None

    # each kind bounds its own handlers by -c: both kinds take the same -c slots
    worker = app.worker(concurrency=4)
    assert (worker.prefetch, worker.shares_slots) == (16, True)
    worker = app.worker(concurrency=4, prefetch=0)  # no prefetch: -c claimed, no slots
    assert (worker.prefetch, worker.shares_slots) == (0, False)
    assert app.worker(concurrency=4, pool="process", app_path="x:app").prefetch == 0


def test_a_negative_prefetch_is_refused_with_a_clear_error(app: errands.App) -> None:
    with pytest.raises(errands.ConfigurationError, match=r"prefetch .* of at least 0, got -1"):
        app.worker(prefetch=-1)


@pytest.mark.parametrize("kind", KINDS)
def test_a_rescued_job_is_claimed_ahead_of_fresh_ones_while_prefetched_jobs_hold_every_slot(
    app: errands.App, worker_factory, kind: str
) -> None:
    """Issue 16, I9: a worker with quick handlers keeps jobs prefetched, so a slot that
    frees is taken by one of them at once and its claim rounds never see a free slot. A
    rescued job due meanwhile is still claimed by its next round, ahead of the fresh
    backlog (it starts at the next free slot, before the prefetched ones); it used to be
    claimed only by a round that found a slot free, which a backlog of quick jobs never
    leaves: in the full-size soak, rescued jobs waited up to 5.6 s behind fresh ones."""
    gates = [threading.Event() for _ in range(8)]
    if kind == "async":

        @app.job(name="pf.gated", lease=10)
        async def gated_async(n: int) -> None:
            while not gates[n].is_set():
                await asyncio.sleep(0.01)

        @app.job(name="pf.rescued", retries=3, backoff=0)
        async def rescued_async() -> str:
            return "ran"

        gated: errands.JobDefinition[..., None] = gated_async
        rescued: errands.JobDefinition[..., str] = rescued_async
    else:

        @app.job(name="pf.gated", lease=10)
        def gated_sync(n: int) -> None:
            gates[n].wait(20)

        @app.job(name="pf.rescued", retries=3, backoff=0)
        def rescued_sync() -> str:
            return "ran"

        gated, rescued = gated_sync, rescued_sync

    late = rescued.enqueue()
    claim_as_dead_worker(app, late.id, lease=10.0)
    with worker_factory(concurrency=2, prefetch=2, poll_interval=0.1, maintenance=False):
        learn_handlers_are_quick(app, kind)
        handles = [gated.enqueue(n=i) for i in range(8)]
        # two run, two are prefetched: no free slot, and no room for another claim
        wait_until(lambda: states(app, "pf.gated").get("running") == 4, what="4 claimed")
        force_rescue(app, late.id)
        time.sleep(0.3)  # past the poll interval: the next round looks for rescued jobs
        gates[0].set()  # a slot frees; a prefetched job takes it; one claim's room opens
        wait_until(
            lambda: raw_row(app, late.id).state == "running",
            timeout=10,
            what="the rescued job claimed by the next round",
        )
        assert states(app, "pf.gated").get("available") == 4  # claimed ahead of them
        for gate in gates:
            gate.set()
        assert late.result(timeout=10) == "ran"
        for handle in handles:
            handle.result(timeout=10)
    assert late.job().rescues == 1


def test_a_quiet_tenants_job_starts_ahead_of_a_noisy_tenants_prefetched_ones(
    app: errands.App, worker_factory
) -> None:
    """Issue 19: in a fair queue the claim ranks keys fairly, but prefetched jobs waited
    for a thread in arrival order, so a quiet tenant's job claimed behind a noisy
    tenant's prefetched ones waited for all of them (its dwell p99 was 10x an idle
    queue's). A job whose key has none waiting in the worker goes ahead of the waiting
    ones; the noisy tenant's next job waits its turn behind it."""
    app.queue("pf_fair", fair=True)
    gates = {("noisy", n): threading.Event() for n in range(6)}
    gates[("quiet", 0)] = threading.Event()
    gates[("quiet", 0)].set()
    started: list[tuple[str, int]] = []

    @app.job(name="pf.tenant", queue="pf_fair", fair_key="{tenant}", lease=10)
    def tenant(tenant: str, n: int) -> None:
        started.append((tenant, n))
        gates[(tenant, n)].wait(20)

    with worker_factory(concurrency=1, prefetch=2, queues=["default", "pf_fair"],
                        maintenance=False):  # fmt: skip
        learn_handlers_are_quick(app)
        noisy = [tenant.enqueue(tenant="noisy", n=n) for n in range(6)]
        # one runs, two wait prefetched: the claim has no room left
        wait_until(lambda: states(app, "pf.tenant").get("running") == 3, what="3 claimed")
        quiet = tenant.enqueue(tenant="quiet", n=0)
        gates[("noisy", 0)].set()  # noisy 1 takes the slot; the room opens for the quiet job
        wait_until(
            lambda: raw_row(app, quiet.id).state != "available",
            timeout=10,
            what="the quiet job claimed behind two prefetched noisy ones",
        )
        gates[("noisy", 1)].set()
        wait_until(lambda: len(started) >= 3, timeout=10, what="the next job started")
        assert started[:3] == [("noisy", 0), ("noisy", 1), ("quiet", 0)], started
        for gate in gates.values():
            gate.set()
        for handle in [*noisy, quiet]:
            handle.result(timeout=10)


def test_a_fair_queues_job_never_goes_ahead_of_another_queues_prefetched_job(
    app: errands.App, worker_factory
) -> None:
    """The fair order of prefetched jobs stays within the fair queue: a plain queue's job
    prefetched first still starts first (a fair job going ahead of every other queue's
    could keep one waiting for as long as new keys kept coming)."""
    app.queue("pf_fair2", fair=True)
    gates = {n: threading.Event() for n in range(2)}
    started: list[str] = []

    @app.job(name="pf.plain", lease=10)
    def plain(n: int) -> None:
        started.append(f"plain {n}")
        gates[n].wait(20)

    @app.job(name="pf.tenant2", queue="pf_fair2", fair_key="{tenant}", lease=10)
    def tenant(tenant: str) -> None:
        started.append(tenant)

    with worker_factory(concurrency=1, prefetch=2, queues=["default", "pf_fair2"],
                        maintenance=False):  # fmt: skip
        learn_handlers_are_quick(app)
        plains = [plain.enqueue(n=n) for n in range(2)]
        # plain 0 runs, plain 1 waits prefetched: one claim's room is left
        wait_until(lambda: states(app, "pf.plain").get("running") == 2, what="2 claimed")
        quiet = tenant.enqueue(tenant="quiet")
        wait_until(
            lambda: raw_row(app, quiet.id).state != "available",
            timeout=10,
            what="the fair job claimed behind the prefetched plain one",
        )
        gates[0].set()
        wait_until(lambda: len(started) >= 2, timeout=10, what="the next job started")
        assert started[:2] == ["plain 0", "plain 1"], started
        gates[1].set()
        for handle in [*plains, quiet]:
            handle.result(timeout=10)


def test_an_async_job_whose_task_cannot_start_is_given_back_uncharged_and_its_claim_runs(
    app: errands.App, worker_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a claim of async jobs, when one job's task cannot be made on the loop, then
    that job is given back (available again, no attempt charged, nothing recorded) and
    runs at a later claim, and the others of its claim run meanwhile: it was recorded as
    failed (charged) for a run that never happened."""
    from errands.worker.dispatch import Dispatcher

    ran: list[int] = []

    @app.job(name="pf.async_start")
    async def starts(n: int) -> int:
        ran.append(n)
        return n

    handles = [starts.enqueue(n=i) for i in range(4)]
    refused = handles[1].id
    tried: list[int] = []
    original = Dispatcher._start_async

    def start_async(self: Dispatcher, attempt: Any, *rest: Any) -> None:
        if attempt.id == refused and not tried:
            tried.append(attempt.id)
            raise RuntimeError("no task for it")
        original(self, attempt, *rest)

    monkeypatch.setattr(Dispatcher, "_start_async", start_async)
    with worker_factory(concurrency=4):
        assert [h.result(timeout=20) for h in handles] == [0, 1, 2, 3]

    assert tried == [refused]
    job = handles[1].job()
    assert (job.attempt, job.errors) == (1, [])  # the give-back charged nothing
    assert sorted(ran) == [0, 1, 2, 3]
