"""Many worker processes on one PostgreSQL database share a large backlog exactly once.

``FOR UPDATE SKIP LOCKED`` claims mean two workers never take the same row; fenced
completion means a finished job is written once. Checked against the handlers' own
effects table, not only against what errands stored.
"""

from __future__ import annotations

import time

import pgacc_basic
import pytest

from .harness import PgCluster, brief, wait_until

pytestmark = pytest.mark.acceptance

JOBS = 10_000
CHUNK = 2_000
WORKERS = 4


def test_four_workers_complete_ten_thousand_jobs_exactly_once(pgc: PgCluster) -> None:
    """Given 10,000 jobs enqueued in bulk and 4 worker processes, every job completes
    and its handler ran exactly once: one effects row per job, none lost, none twice."""
    app = pgc.app()
    workers = [pgc.start_worker("-c", "8", label=f"worker{i}") for i in range(WORKERS)]

    started = time.monotonic()
    ids: list[int] = []
    for first in range(0, JOBS, CHUNK):
        handles = app.enqueue_many(
            [pgacc_basic.bulk.bind(n=i) for i in range(first, first + CHUNK)]
        )
        ids.extend(h.id for h in handles)
    assert len(set(ids)) == JOBS

    wait_until(
        lambda: pgc.states().get("completed", 0) == JOBS,
        150,
        f"all {JOBS} jobs to complete",
        interval=0.25,
        describe=lambda: str(pgc.states()),
    )
    elapsed = time.monotonic() - started

    assert pgc.states() == {"completed": JOBS}
    counts = dict(
        pgc.query("SELECT job_id, count(*) FROM {s}.effects GROUP BY job_id HAVING count(*) > 0")
    )
    assert set(counts) == set(ids), "some jobs completed without their handler running"
    twice = sorted(job_id for job_id, n in counts.items() if n != 1)
    assert not twice, "jobs executed more than once (effects; errors):\n" + "\n".join(
        f"{job_id}: {pgc.effects(job_id)}; {brief(pgc.errors_of(job_id))}" for job_id in twice[:20]
    )
    # No fault was injected (and the job's 30 s lease survives a starved CPU): no retries,
    # no rescues, every job completed on attempt 1.
    assert (
        pgc.query("SELECT count(*) FROM {s}.errands_jobs WHERE attempt <> 1 OR errors <> '[]'")[0][
            0
        ]
        == 0
    )
    # The backlog was shared: every worker ran a fair part of it.
    per_worker = dict(pgc.query("SELECT worker, count(*) FROM {s}.effects GROUP BY worker"))
    assert set(per_worker) == {w.worker_id for w in workers}
    assert min(per_worker.values()) > JOBS / WORKERS / 4, per_worker
    assert all(w.alive for w in workers)
    print(f"{JOBS} jobs on {WORKERS} workers in {elapsed:.1f} s; per worker {per_worker}")
