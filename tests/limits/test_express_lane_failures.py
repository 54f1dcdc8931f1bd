"""The express lane's error paths, with real workers on both backends: an express claim
whose store call fails, a lane handler past its timeout (interrupted, or abandoned), and
a lane handler that raises. In each the worker goes on, the job's attempt is recorded as
in a slot, and the lane's thread is given back (a later quiet job starts on it again).

Every scene holds the worker's two slots with a noisy tenant's jobs (they wait on a gate),
so a quiet tenant's job can start only on the lane. The workers run without prefetch:
with a prefetch room a regular claim could take the quiet job too (and start it on the
lane), and these tests prove what the express claim does on its own.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

import errands
from errands import JobState
from errands.worker.worker import Worker

from .helpers import wait_until, workers

SLOTS = 2
EXPRESS = 1
LANE_THREAD = "errands-express"  # the lane's handler threads are named so (slots: errands-job)


class Scene:
    """A fair queue, a noisy tenant's jobs that hold a slot each until released, and a
    record of the handler thread each quiet run took."""

    def __init__(self, store: errands.App, queue: str) -> None:
        self.store = store
        self.queue = queue
        store.queue(queue, fair=True)
        self.gates: list[threading.Event] = []
        self._lock = threading.Lock()
        self.holding = 0
        self._threads: dict[str, list[str]] = defaultdict(list)

        @store.job(name=f"{queue}.hold", queue=queue, fair_key="tenant:{tenant}")
        def hold(tenant: str, round: int, n: int) -> None:
            with self._lock:
                self.holding += 1
            try:
                self.gates[round].wait(30)
            finally:
                with self._lock:
                    self.holding -= 1

        self.hold = hold

    def fill(self) -> None:
        """Hold both slots (a noisy tenant's two jobs) until :meth:`release`."""
        self.gates.append(threading.Event())
        round = len(self.gates) - 1
        self.store.enqueue_many(
            [self.hold.bind(tenant="noisy", round=round, n=n) for n in range(SLOTS)]
        )
        wait_until(lambda: self.holding == SLOTS, 30, "both slots busy with the noisy jobs")

    def release(self) -> None:
        for gate in self.gates:
            gate.set()

    def ran(self, label: str) -> None:
        """Called by a handler: note the thread this run of ``label`` took."""
        with self._lock:
            self._threads[label].append(threading.current_thread().name)

    def runs(self, label: str) -> list[str]:
        """The threads the runs of ``label`` took, in order."""
        with self._lock:
            return list(self._threads[label])

    def on_lane(self, label: str) -> list[bool]:
        return [name.startswith(LANE_THREAD) for name in self.runs(label)]


def given_back(worker: Worker) -> None:
    """Every slot and lane thread is free again, and no lane thread is left stuck or
    missing: the lane has exactly its ``express`` threads."""
    lane = worker.express_threads
    assert lane is not None
    wait_until(
        lambda: (worker._free, worker._express_free) == (SLOTS, EXPRESS),
        10,
        "every slot and lane thread given back",
    )
    wait_until(lambda: worker.stuck_threads() == 0, 10, "no handler thread left stuck")
    wait_until(lambda: len(lane._threads) == EXPRESS, 10, "the lane back to its own threads")
    assert (worker._free, worker._express_free) == (SLOTS, EXPRESS)  # not beyond either


@contextmanager
def busy_worker(scene: Scene, **options: Any) -> Iterator[Worker]:
    """A worker of two slots and a lane of one, its slots held by the noisy jobs; on a
    clean exit the slots are released and everything must be given back."""
    options = {"concurrency": SLOTS, "express": EXPRESS, "prefetch": 0, **options}
    with workers([scene.store], **options) as [worker]:
        try:
            scene.fill()
            yield worker
        finally:
            scene.release()
        wait_until(lambda: scene.holding == 0, 30, "the noisy jobs to end")
        given_back(worker)


def wait_state(handle: Any, state: JobState, what: str) -> Any:
    """The job once it is in ``state`` (its snapshot then)."""
    return wait_until(lambda: (j := handle.job()).state is state and j, 30, what)


def test_a_failing_express_claim_is_logged_the_slots_serve_on_and_the_lane_works_once_it_clears(
    store: errands.App, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The store call of every express claim raises (the backend's job_claim_limited,
    called with express=True) while the slots are held: the quiet job stays queued, the
    failure is logged, and the worker goes on. Released, the slots serve the noisy
    backlog and the quiet job. Once the fault clears, a quiet job behind full slots
    starts on the lane; in the end every slot and lane thread is given back."""
    caplog.set_level(logging.WARNING, logger="errands.worker")
    scene = Scene(store, "lanefault")

    @store.job(name="lanefault.work", queue="lanefault", fair_key="tenant:{tenant}")
    def work(tenant: str, n: int) -> None:
        scene.ran(f"{tenant}/{n}")

    backend = store.backend
    claim_limited = backend.job_claim_limited
    failing = threading.Event()
    failing.set()
    failed = [0]

    def faulty(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("express") and failing.is_set():
            failed[0] += 1
            raise RuntimeError("injected: the express claim's store call failed")
        return claim_limited(*args, **kwargs)

    monkeypatch.setattr(backend, "job_claim_limited", faulty)
    with busy_worker(scene) as worker:
        first = work.enqueue(tenant="quiet", n=1)
        # The lane tries (a notification, then each poll interval) and fails each time.
        wait_until(lambda: failed[0] >= 3, 30, "express claims to be tried and fail")
        wait_until(
            lambda: any(
                "express claim failed" in r.getMessage() and "injected" in r.getMessage()
                for r in caplog.records
            ),
            10,
            "the failed express claim logged",
        )
        assert scene.runs("quiet/1") == []  # only the lane could start it, and it failed
        assert worker._express_free == EXPRESS  # no lane thread taken by a failed claim

        # The slots keep serving: the noisy backlog and the quiet job run in them.
        backlog = store.enqueue_many([work.bind(tenant="noisy", n=n) for n in range(20)])
        scene.release()
        for handle in [*backlog, first]:
            wait_state(handle, JobState.COMPLETED, "the backlog and the quiet job served")
        assert scene.on_lane("quiet/1") == [False]
        assert all(scene.on_lane(f"noisy/{n}") == [False] for n in range(20))
        given_back(worker)

        # The fault clears: a quiet job behind full slots takes the lane again.
        failing.clear()
        scene.fill()
        second = work.enqueue(tenant="quiet", n=2)
        wait_state(second, JobState.COMPLETED, "the next quiet job to run")
        assert scene.on_lane("quiet/2") == [True]
        assert scene.holding == SLOTS  # the slots were busy all along
    assert failed[0] >= 3


def test_a_lane_handler_past_its_timeout_is_interrupted_failed_as_a_timeout_and_frees_the_lane(
    store: errands.App,
) -> None:
    """A quiet job on the lane that ignores ``ctx.cancelled`` past its 0.5 s timeout is
    interrupted in its lane thread (HandlerInterrupt runs its ``finally``), its attempt
    fails with JobTimeout (kind timeout) and is retried with its backoff; the retry and
    a later quiet tenant's job start on the lane again while the slots stay busy."""
    scene = Scene(store, "lanetimeout")
    unwound: list[int] = []

    @store.job(
        name="lanetimeout.slow",
        queue="lanetimeout",
        fair_key="tenant:{tenant}",
        timeout=0.5,
        retries=1,
        backoff=0.2,
    )
    def slow(tenant: str, ctx: errands.Context) -> str:
        scene.ran(tenant)
        if tenant != "quiet" or ctx.attempt > 1:
            return "done"
        try:
            while True:  # ignores ctx.cancelled: only the interrupt stops it
                threading.Event().wait(0.01)
        finally:
            unwound.append(ctx.attempt)

    with busy_worker(scene) as worker:
        handle = slow.enqueue(tenant="quiet")
        job = wait_state(handle, JobState.COMPLETED, "the timed-out job's retry to complete")
        assert scene.on_lane("quiet") == [True, True]
        assert unwound == [1]  # interrupted, not abandoned
        assert worker.express_threads is not None
        assert (worker.express_threads.abandoned, worker.threads.abandoned) == (0, 0)
        assert job.attempt == 2
        [error] = job.errors
        assert (error.attempt, error.type, error.kind) == (1, "JobTimeout", "timeout")
        assert error.message == "timed out after 0.5 s"
        assert "HandlerInterrupt" in (error.traceback or "")

        later = slow.enqueue(tenant="quiet2")
        wait_state(later, JobState.COMPLETED, "a later quiet job to run")
        assert scene.on_lane("quiet2") == [True]
        assert scene.holding == SLOTS


def test_a_lane_handler_blocked_past_its_timeout_is_abandoned_and_the_lane_count_does_not_leak(
    store: errands.App,
) -> None:
    """A quiet job on the lane blocked in a C call past its timeout: the interrupt cannot
    reach it, so ``abandon_after`` later its attempt is recorded as a timeout and its lane
    thread abandoned; a fresh lane thread runs the retry (the slots still busy). When the
    blocked handler finally returns, its late end is ignored (the lane is not counted
    free twice) and its thread retires: the lane is back to its one thread."""
    scene = Scene(store, "laneabandon")
    let_go = threading.Event()
    returned = threading.Event()

    @store.job(
        name="laneabandon.stuck",
        queue="laneabandon",
        fair_key="tenant:{tenant}",
        timeout=0.5,
        retries=1,
        backoff=0.2,
    )
    def stuck(tenant: str, ctx: errands.Context) -> str:
        scene.ran(tenant)
        if tenant != "quiet" or ctx.attempt > 1:
            return "done"
        try:
            let_go.wait(30)  # blocked in C: neither ctx.cancelled nor the interrupt reach it
        finally:
            returned.set()
        return "too late"

    with busy_worker(scene, abandon_after=1.5) as worker:
        lane = worker.express_threads
        assert lane is not None
        handle = stuck.enqueue(tenant="quiet")
        job = wait_state(handle, JobState.COMPLETED, "the abandoned job's retry to complete")
        assert scene.on_lane("quiet") == [True, True]
        first, retry = scene.runs("quiet")
        assert first != retry  # the retry ran on the abandoned thread's replacement
        assert not returned.is_set()
        assert (lane.abandoned, lane.stuck(), worker.threads.abandoned) == (1, 1, 0)
        assert worker._express_free == EXPRESS
        [error] = job.errors
        assert (error.attempt, error.type, error.kind) == (1, "JobTimeout", "timeout")
        assert "abandoned" in error.message

        let_go.set()  # the abandoned handler returns at last
        wait_until(returned.is_set, 10, "the abandoned handler to return")
        # A thread leaves the lane after its handler's end was handled: here, ignored.
        wait_until(lambda: len(lane._threads) == EXPRESS, 10, "the abandoned thread to retire")
        assert lane.stuck() == 0
        assert worker._express_free == EXPRESS  # its late end gave nothing back twice
        after = handle.job()
        assert (after.state, after.attempt, len(after.errors)) == (JobState.COMPLETED, 2, 1)

        later = stuck.enqueue(tenant="quiet2")
        wait_state(later, JobState.COMPLETED, "a later quiet job to run")
        assert scene.on_lane("quiet2") == [True]
        assert scene.holding == SLOTS


@pytest.mark.parametrize("retries", [1, 0], ids=["retried", "last-attempt"])
def test_a_lane_handler_that_raises_fails_its_attempt_as_in_a_slot_and_frees_the_lane(
    store: errands.App, retries: int
) -> None:
    """A quiet job on the lane that raises: the attempt is recorded as a transient
    failure (retryable with its backoff, its retry starting on the lane again; dead on
    its last attempt), and the lane serves a later quiet job."""
    scene = Scene(store, f"laneraise{retries}")

    @store.job(
        name=f"laneraise{retries}.flaky",
        queue=f"laneraise{retries}",
        fair_key="tenant:{tenant}",
        retries=retries,
        backoff=0.2,
    )
    def flaky(tenant: str, ctx: errands.Context) -> str:
        scene.ran(tenant)
        if tenant == "quiet" and ctx.attempt == 1:
            raise ValueError("boom on the lane")
        return "done"

    with busy_worker(scene) as worker:
        handle = flaky.enqueue(tenant="quiet")
        final = JobState.COMPLETED if retries else JobState.DEAD
        job = wait_state(handle, final, "the failed job to settle")
        assert scene.on_lane("quiet") == [True] * (1 + retries)
        [error] = job.errors
        assert (error.attempt, error.type, error.kind) == (1, "ValueError", "transient")
        assert error.message == "boom on the lane"
        assert job.attempt == 1 + retries

        later = flaky.enqueue(tenant="quiet2")
        wait_state(later, JobState.COMPLETED, "a later quiet job to run")
        assert scene.on_lane("quiet2") == [True]
        assert scene.holding == SLOTS
        assert worker._express_free == EXPRESS
