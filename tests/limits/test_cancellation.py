"""Cancellation (item 8): pending jobs at once; running jobs cooperatively (``ctx.cancelled``
for sync handlers, task cancellation for async ones); a cancelled job never runs again,
even when its lease expires during the cancel; ``errands jobs cancel ID``.

A running job learns of its cancel at its worker's next heartbeat (a third of the
lease: the store's App has ``lease=2``).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import errands
from errands import JobState
from errands.backends.base import ClaimParams, QueueClaim
from errands.maintenance.service import Maintenance

from .helpers import expire_lease, run_cli, wait_until, workers


def test_cancelling_a_running_sync_job_sets_ctx_cancelled_and_it_ends_cancelled(
    store: errands.App,
) -> None:
    """Given two running sync handlers that poll ctx.cancelled and raise when it turns
    true, one with retries left and one on its last attempt, when both are cancelled,
    then both end cancelled (never retryable, never dead) and neither runs again."""
    started = threading.Barrier(3)
    runs: list[tuple[str, int]] = []
    seen: list[str] = []

    def poll(ctx: errands.Context) -> None:
        runs.append((ctx.name, ctx.attempt))
        started.wait(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if ctx.cancelled:
                seen.append(ctx.cancel_reason)
                raise RuntimeError("stopped on request")
            time.sleep(0.01)

    retrying = store.job(name="cancel.sync", retries=3, backoff=0.01)(poll)
    last = store.job(name="cancel.sync_last", retries=0)(poll)

    @store.job(name="cancel.sentinel")
    def sentinel() -> str:
        return "done"

    handles = [retrying.enqueue(), last.enqueue()]
    with workers([store]):
        started.wait(10)
        for handle in handles:
            result = store.cancel(handle.id, actor="ops:alice")
            assert (result.previous_state, result.state) == ("running", "running")
        for handle in handles:
            wait_until(lambda h=handle: h.status() is JobState.CANCELLED, 10, "a cancelled job")
        assert sentinel.enqueue().result(timeout=10) == "done"  # past the 0.01 s backoff
    assert sorted(runs) == [("cancel.sync", 1), ("cancel.sync_last", 1)]
    assert seen == ["cancelled", "cancelled"]
    assert {h.status() for h in handles} == {JobState.CANCELLED}
    [event, _] = store.audit()
    assert (event.action, event.actor, event.detail) == (
        "cancel",
        "ops:alice",
        {"previous_state": "running"},
    )


def test_cancelling_a_running_async_job_cancels_its_task_and_it_ends_cancelled(
    store: errands.App,
) -> None:
    started = threading.Event()
    runs: list[int] = []
    seen: list[str] = []

    @store.job(name="cancel.async", retries=3, backoff=0.01)
    async def wait_long(ctx: errands.Context) -> None:
        runs.append(ctx.attempt)
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append("CancelledError")
            raise

    @store.job(name="cancel.async_sentinel")
    async def sentinel() -> str:
        return "done"

    handle = wait_long.enqueue()
    with workers([store]):
        assert started.wait(10)
        handle.cancel()
        wait_until(lambda: handle.status() is JobState.CANCELLED, 10, "the job to be cancelled")
        assert sentinel.enqueue().result(timeout=10) == "done"
    assert (runs, seen) == ([1], ["CancelledError"])
    with pytest.raises(errands.JobCancelled):
        handle.result(timeout=1)


def test_cancel_of_a_job_whose_worker_died_ends_cancelled_when_its_lease_is_rescued(
    store: errands.App,
) -> None:
    """Given a job claimed by a worker that then died, when it is cancelled and its lease
    expires, then the rescuer makes it cancelled (never retryable or available), and a
    live worker never runs it."""
    ran: list[int] = []

    @store.job(name="cancel.orphan", retries=3, backoff=0.01)
    def orphan(n: int) -> None:
        ran.append(n)

    @store.job(name="cancel.orphan_sentinel")
    def sentinel() -> str:
        return "done"

    handle = orphan.enqueue(n=1)
    [row] = store.backend.job_claim(ClaimParams([QueueClaim("default", 1)], 1, "w-dead", 30))
    assert row.id == handle.id
    assert store.cancel(handle.id).state == "running"  # requested: nobody will hear it
    assert expire_lease(store, handle.id) == 1
    assert Maintenance(store, "w-rescuer").rescue() == 1
    job = handle.job()
    assert job.state is JobState.CANCELLED
    assert job.errors[-1].type == "WorkerLost"
    with workers([store]):
        assert sentinel.enqueue().result(timeout=10) == "done"
    assert ran == []
    assert handle.status() is JobState.CANCELLED


def test_cancelled_job_whose_lease_expires_while_its_handler_ignores_the_cancel_never_runs_again(
    store: errands.App,
) -> None:
    """Given a running sync handler that ignores ctx.cancelled, when it is cancelled and
    its lease expires (forced) and the rescuer runs, then the job is cancelled at once;
    the handler's late return is rejected by the fence, and it never runs again."""
    started, release = threading.Event(), threading.Event()
    runs: list[int] = []

    @store.job(name="cancel.stubborn", retries=3, backoff=0.01)
    def stubborn(ctx: errands.Context) -> str:
        runs.append(ctx.attempt)
        started.set()
        release.wait(20)  # a blocking call that cannot look at ctx.cancelled
        return "finished anyway"

    @store.job(name="cancel.stubborn_sentinel")
    def sentinel() -> str:
        return "done"

    rejected: list[dict[str, object]] = []
    store.events.subscribe(
        lambda event: (
            rejected.append(event.fields)
            if event.name == "errands.job.stale_write_rejected"
            else None
        )
    )
    handle = stubborn.enqueue()
    rescuer = Maintenance(store, "w-rescuer")
    with workers([store], maintenance=False):
        assert started.wait(10)
        store.cancel(handle.id)

        def rescued() -> bool:  # a live heartbeat may renew the lease in between: retry
            expire_lease(store, handle.id)
            rescuer.rescue()
            return handle.status() is not JobState.RUNNING

        wait_until(rescued, 10, "the rescue of the expired lease")
        assert handle.status() is JobState.CANCELLED
        release.set()
        wait_until(lambda: rejected, 10, "the stale completion to be rejected")
        assert sentinel.enqueue().result(timeout=10) == "done"
    assert runs == [1]
    job = handle.job()
    assert (job.state, job.result) == (JobState.CANCELLED, None)


def test_jobs_cancel_command_cancels_pending_jobs_and_asks_running_ones_to_stop(
    store: errands.App,
) -> None:
    @store.job(name="cancel.cli")
    def nothing(n: int) -> None: ...

    pending = nothing.enqueue(n=1, delay=600)
    running = nothing.enqueue(n=2)
    store.backend.job_claim(ClaimParams([QueueClaim("default", 1)], 1, "w-elsewhere", 30))
    result = run_cli(
        "jobs", "cancel", str(pending.id), str(running.id), "--url", store.url, "--actor", "ops"
    )
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        f"job {pending.id}: cancelled (was scheduled)",
        f"job {running.id}: running; cancel requested, its worker stops it",
    ]
    assert pending.status() is JobState.CANCELLED
    assert running.job().cancel_requested
    assert [e.actor for e in store.audit()] == ["ops", "ops"]

    again = run_cli("jobs", "cancel", str(pending.id), "--url", store.url)
    assert again.exit_code == 1
    assert "only scheduled, available, retryable, waiting or running jobs" in again.output
