"""Timeouts and cancels in ``--pool process`` (item 9): the sync handler runs in a child
process, and a timeout or an operator's cancel kills that child (SIGKILL); a new child
takes its slot. (Thread-mode timeouts — ctx.cancelled, then HandlerInterrupt, then
abandon — are proven in tests/integration/test_timeouts.py.)
"""

from __future__ import annotations

from errands import JobState
from tests.acceptance.harness import pid_alive

from .helpers import LimitsCluster, wait_until


def start_pid(cluster: LimitsCluster, job_id: int) -> int | None:
    rows = cluster.query_effects(
        "SELECT pid FROM effects WHERE job_id = ? AND kind = 'start'", job_id
    )
    return rows[0][0] if rows else None


def test_timeout_or_cancel_in_process_pool_kills_the_child_and_a_new_child_takes_its_slot(
    cluster: LimitsCluster,
) -> None:
    """Given a worker with ``--pool process`` and one slot: a job past its 1 s timeout has
    its child killed and is recorded as JobTimeout; the next job runs in a new child; a
    cancelled running job has its child killed too and ends cancelled."""
    app = cluster.app("limits_app")
    timed, untimed = app.registry["slow.timed"], app.registry["slow.untimed"]
    stuck = timed.enqueue(seconds=60)
    worker = cluster.start_worker(
        "-q", "slow", "-c", "1", "--pool", "process", app="limits_app:app"
    )
    first = wait_until(lambda: start_pid(cluster, stuck.id), 30, "the job to start in a child")
    assert first != worker.pid
    wait_until(lambda: stuck.status() is JobState.DEAD, 30, "the timed-out job to be dead")
    job = stuck.job()
    assert job.last_error is not None
    assert (job.last_error.type, job.last_error.message) == ("JobTimeout", "timed out after 1 s")
    wait_until(lambda: not pid_alive(first), 10, "the timed-out child to be killed")

    running = untimed.enqueue(seconds=60)
    second = wait_until(lambda: start_pid(cluster, running.id), 30, "the next job to start")
    assert second not in (first, worker.pid)
    assert app.cancel(running.id, actor="ops").state == "running"
    wait_until(lambda: running.status() is JobState.CANCELLED, 30, "the job to be cancelled")
    wait_until(lambda: not pid_alive(second), 10, "the cancelled job's child to be killed")
    assert running.job().attempt == 1  # never run again
