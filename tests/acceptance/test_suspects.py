"""Rescued jobs (suspects) run several at once, each isolated in a child process of the
worker (issue 16, A15): a burst of them drains at the pace they run, and one that kills
its process takes none of the others along (real ``errands worker`` processes on SQLite).
"""

from __future__ import annotations

import signal

import acc_basic
import pytest

from errands.backends.base import ClaimParams, QueueClaim
from errands.maintenance.service import Maintenance

from .harness import Cluster, wait_until

pytestmark = pytest.mark.acceptance

SLEEP = 1.5


def _strand_as_suspects(cluster: Cluster, ids: list[int]) -> None:
    """Claim the jobs as a worker that then dies, and rescue them: each is a suspect."""
    app = cluster.app()
    claimed = app.backend.job_claim(ClaimParams([QueueClaim("default", 10)], 10, "dead", 30.0))
    assert sorted(r.id for r in claimed) == sorted(ids)
    cluster.execute(
        "UPDATE errands_jobs SET lease_expires_at = (julianday('now') - 2440587.5) * 86400.0 "
        "- 60 WHERE state = 'running'"
    )
    assert Maintenance(app, "test-rescuer").rescue() == len(ids)


def test_suspects_run_several_at_once_each_in_its_own_child_and_a_crasher_takes_none_along(
    cluster: Cluster,
) -> None:
    """Given three sleeping jobs and one that kills its process, all rescued once, when one
    worker (-c 8, so 4 suspect lanes) takes them, then the sleepers run at the same time in
    distinct child processes and complete with one rescue each and nothing else charged;
    the crasher kills only its children, is recorded at once as crashes, and goes dead as
    poison after its third death; the worker itself never dies."""
    app = cluster.app()
    sleepers = [acc_basic.sleepy.enqueue(seconds=SLEEP) for _ in range(3)]
    crash = acc_basic.crash.enqueue()
    _strand_as_suspects(cluster, [h.id for h in sleepers] + [crash.id])

    worker = cluster.start_worker("-c", "8", label="worker")
    wait_until(
        lambda: (
            all(cluster.state_of(h.id) == "completed" for h in sleepers)
            and cluster.state_of(crash.id) == "dead"
        ),
        60,
        "the sleepers completed and the crasher dead",
        describe=lambda: str(dict(cluster.states())),
    )
    assert worker.alive, "a suspect took the worker down"

    pids = {pid for handle in sleepers for _, _, pid, _ in cluster.effects(handle.id)}
    assert len(pids) == 3  # one child process each
    assert worker.pid not in pids  # never in the worker itself
    jobs = [app.get_job(h.id) for h in sleepers]
    latest_start = max(j.attempted_at for j in jobs)  # type: ignore[type-var]
    earliest_end = min(j.finished_at for j in jobs)  # type: ignore[type-var]
    assert latest_start < earliest_end, "they ran one after another, not at once"
    for job in jobs:
        assert (job.rescues, [e.type for e in job.errors]) == (1, ["WorkerLost"])

    job = app.get_job(crash.id)
    assert [e.type for e in job.errors] == ["WorkerLost", "WorkerProcessDied", "WorkerProcessDied"]
    assert [e.kind for e in job.errors] == ["worker_lost", "crash", "poison"]
    assert job.errors[-1].message.startswith("poison: worker died 3 times")
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit(15) == 0
