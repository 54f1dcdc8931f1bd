"""on_dead hooks at least once per death, whatever crashes (issue 16: the soak saw 1-3 % of
deaths whose hooks never ran: their worker was killed between the death's commit and the
hooks). Real ``errands worker`` processes on a real SQLite file."""

from __future__ import annotations

import signal

import acc_hooks
import acc_support
import pytest

from .harness import Cluster, wait_until

pytestmark = pytest.mark.acceptance

HOOKS = "acc_hooks:app"


def _hook_runs(cluster: Cluster, job_id: int) -> list[int]:
    """The pids that ran the job's on_dead hook, in order."""
    conn = acc_support.connect(str(cluster.effects_path))
    try:
        rows = conn.execute(
            "SELECT pid FROM effects WHERE kind = 'hook' AND job_id = ? ORDER BY at", (job_id,)
        ).fetchall()
    finally:
        conn.close()
    return [r[0] for r in rows]


def test_a_worker_killed_after_writing_a_death_leaves_its_hooks_to_the_leader(
    cluster: Cluster,
) -> None:
    """Given a worker that crashes right after committing a job's death (before its
    on_dead hooks ran), when another worker leads the cluster, then it runs that death's
    hooks once the grace has passed, and only once."""
    cluster.app("acc_hooks")
    victim = cluster.start_worker(
        app=HOOKS, label="victim", env={"ERRANDS_FAULT_POINTS": "after_finish_commit:1"}
    )
    handle = acc_hooks.doomed.enqueue(n=1)
    assert victim.wait_exit(20) == 86  # the fault point's crash, just after the commit
    assert cluster.state_of(handle.id) == "dead"
    assert _hook_runs(cluster, handle.id) == []  # the crash came before the hooks

    survivor = cluster.start_worker(app=HOOKS, label="survivor", leader=True)
    wait_until(lambda: _hook_runs(cluster, handle.id), 30, "the leader to run the hooks")
    survivor.wait_log("no worker ran within", timeout=5)
    assert cluster.query("SELECT count(*) FROM errands_dead_hooks")[0][0] == 0
    assert _hook_runs(cluster, handle.id) == [survivor.pid]
    survivor.signal(signal.SIGTERM)
    assert survivor.wait_exit(15) == 0


def test_hooks_a_worker_ran_leave_no_record_for_the_leader(cluster: Cluster) -> None:
    """Given a worker that runs a death's hooks itself, then it marks them done: no
    record is left that the leader would run again (each hook ran once)."""
    cluster.app("acc_hooks")
    worker = cluster.start_worker(app=HOOKS, label="worker", leader=True)
    handles = [acc_hooks.doomed.enqueue(n=n) for n in range(5)]
    for handle in handles:
        wait_until(lambda h=handle: _hook_runs(cluster, h.id), 20, "the worker's own hooks")
    wait_until(
        lambda: cluster.query("SELECT count(*) FROM errands_dead_hooks")[0][0] == 0,
        10,
        "the hooks marked done",
        describe=lambda: str(cluster.query("SELECT * FROM errands_dead_hooks")),
    )
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit(15) == 0
    assert [_hook_runs(cluster, h.id) for h in handles] == [[worker.pid]] * 5
