"""Many worker processes on one SQLite file (RELIABILITY F18, I10).

Four real worker processes race to claim 5,000 jobs from one file. No job may be run
twice (no double claims), "database is locked" must never reach a worker's log, and the
file must pass ``PRAGMA integrity_check`` afterwards.
"""

from __future__ import annotations

import signal
import time
from collections import Counter

import acc_bulk
import pytest

from .harness import Cluster, wait_until

pytestmark = pytest.mark.acceptance

JOBS = 2500  # exactly once needs many claims racing, not a long run (5,000: a minute in CI)
WORKERS = 4


def test_four_worker_processes_on_one_sqlite_file_complete_each_job_exactly_once(
    cluster: Cluster,
) -> None:
    cluster.effects_in_store()  # handlers write to the same file: more lock contention
    app = cluster.app("acc_bulk")
    workers = [cluster.start_worker(app="acc_bulk:app", label=f"w{i}") for i in range(WORKERS)]

    started = time.monotonic()
    handles = app.enqueue_many([acc_bulk.bulk_noop.bind(n=i) for i in range(JOBS)])  # one txn
    ids = {h.id for h in handles}
    assert len(ids) == JOBS

    wait_until(
        lambda: cluster.states().get("completed", 0) == JOBS,
        240,  # a deadline, not a bound: ~30 s here on a quiet machine, 90 was too short at load 14
        f"{JOBS} jobs to complete on {WORKERS} workers",
        interval=0.2,
        describe=lambda: f"states: {dict(cluster.states())}",
    )
    took = time.monotonic() - started

    assert cluster.states() == Counter({"completed": JOBS})
    # Exactly one execution per job, and it was attempt 1: nobody ran a job twice.
    effects = cluster.effects()
    per_job = Counter(job_id for job_id, *_ in effects)
    assert set(per_job) == ids
    assert set(per_job.values()) == {1}
    assert {attempt for _, attempt, _, _ in effects} == {1}
    assert cluster.query("SELECT count(*) FROM errands_jobs WHERE errors != '[]'") == [(0,)]
    # Every worker took part (the claim is shared, not won by one process).
    by_worker = Counter(worker for _, _, _, worker in effects)
    assert set(by_worker) == {w.worker_id for w in workers}, by_worker

    for proc in workers:
        proc.signal(signal.SIGTERM)
    for proc in workers:
        assert proc.wait_exit(20) == 0, proc.label
    for proc in workers:
        log = proc.stderr()
        assert "database is locked" not in log.lower(), proc.label
        assert "Traceback" not in log, proc.label
    assert cluster.integrity() == "ok"
    print(f"{JOBS} jobs on {WORKERS} processes in {took:.1f} s; per worker {dict(by_worker)}")
