"""Workers that die, crash or freeze mid-job (RELIABILITY F1, F5, F11, F12).

Real ``errands worker`` processes on a real SQLite file, with real signals: SIGKILL,
SIGSTOP/SIGCONT, and a handler that ``os._exit``s its own process. After each fault the
invariants are checked in SQL and against the handlers' own effects table: nothing lost
(I1), duplicates accounted for by recorded lease losses (I4), attempts and reasons (I5),
stale writes rejected (I6).
"""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import time
from collections import Counter

import acc_basic
import acc_chaos
import pytest

from .harness import Cluster, Proc, wait_until

pytestmark = pytest.mark.acceptance

# Lease 2 s; the maintenance leader's own lease is at least 5 s (Maintenance.ttl), so when
# the leader itself dies, its successor takes over within ~5 s. Rescue therefore lands
# within lease + leader ttl + a tick or two of the fault; deadlines below allow for that
# with room for a slow CI machine.
RESCUE_DEADLINE = 25.0


def _errors(cluster: Cluster, job_id: int) -> list[dict[str, object]]:
    (raw,) = cluster.query("SELECT errors FROM errands_jobs WHERE id = ?", (job_id,))[0]
    return list(json.loads(raw))


def test_killed_worker_job_is_rescued_and_completed_by_another_worker(cluster: Cluster) -> None:
    app = cluster.app()
    handle = acc_basic.sleepy.enqueue(seconds=60, first_only=True)

    first = cluster.start_worker(label="victim")
    wait_until(lambda: cluster.effects(handle.id), 15, "the job to start on the first worker")
    first.signal(signal.SIGKILL)
    assert first.wait_exit(5) == -signal.SIGKILL
    assert cluster.state_of(handle.id) == "running"  # the dead worker still holds the lease

    second = cluster.start_worker(label="rescuer")
    wait_until(
        lambda: cluster.state_of(handle.id) == "completed",
        RESCUE_DEADLINE,
        "the second worker to complete the rescued job",
        describe=lambda: str(app.get_job(handle.id)),
    )

    job = app.get_job(handle.id)
    assert job.attempt == 2
    assert job.result["attempt"] == 2
    assert job.result["worker"] == second.worker_id
    assert [(e.type, e.attempt, e.worker) for e in job.errors] == [
        ("WorkerLost", 1, first.worker_id)
    ]
    assert "lost its lease on attempt 1" in job.errors[0].message
    runs = cluster.effects(handle.id)
    assert [(attempt, worker) for _, attempt, _, worker in runs] == [
        (1, first.worker_id),
        (2, second.worker_id),
    ]

    second.signal(signal.SIGTERM)
    assert second.wait_exit(15) == 0


def _stuck(cluster: Cluster) -> str:
    """What keeps jobs from completing: states, the unfinished rows, the leader, the time."""
    rows = cluster.query(
        "SELECT id, state, attempt, rescues, run_at, lease_owner, lease_expires_at, errors "
        "FROM errands_jobs WHERE state != 'completed' ORDER BY id LIMIT 10"
    )
    leaders = cluster.query("SELECT * FROM errands_leaders")
    now = cluster.query("SELECT (julianday('now') - 2440587.5) * 86400.0")[0][0]
    lines = [f"states: {dict(cluster.states())}; db now {now:.3f}; leaders {leaders}"]
    lines += [f"  {r[:7]} errors={[e['message'][:50] for e in json.loads(r[7])]}" for r in rows]
    return "\n".join(lines)


STORM_JOBS = 1200
STORM_WORKERS = 3
STORM_SECONDS = 15.0


def test_kill_storm_loses_no_job_and_every_duplicate_is_a_recorded_lease_loss(
    cluster: Cluster,
) -> None:
    app = cluster.app("acc_chaos")
    handles = app.enqueue_many([acc_chaos.chaos_work.bind(n=i) for i in range(STORM_JOBS)])
    ids = {h.id for h in handles}
    assert len(ids) == STORM_JOBS

    def start(slot: int, generation: int) -> Proc:
        return cluster.start_worker(
            "-c", "4", app="acc_chaos:app", label=f"w{slot}-{generation}", ready=False
        )

    workers = [start(slot, 0) for slot in range(STORM_WORKERS)]
    rng = random.Random(20240607)
    kills = 0
    storm_ends = time.monotonic() + STORM_SECONDS
    while time.monotonic() < storm_ends:
        time.sleep(rng.uniform(0.5, 1.0))
        if cluster.states().get("completed", 0) == STORM_JOBS:
            break
        slot = rng.randrange(STORM_WORKERS)
        workers[slot].signal(signal.SIGKILL)
        workers[slot].wait_exit(5)
        kills += 1
        workers[slot] = start(slot, kills)

    # The fault heals: the fleet (as restarted) must drain the backlog on its own.
    wait_until(
        lambda: cluster.states().get("completed", 0) == STORM_JOBS,
        60,
        f"all {STORM_JOBS} jobs to complete after {kills} SIGKILLs",
        interval=0.2,
        describe=lambda: _stuck(cluster),
    )

    # I1: nothing lost, nothing dead, nothing left behind.
    assert cluster.states() == Counter({"completed": STORM_JOBS})
    rows = cluster.query("SELECT id, attempt, rescues, errors FROM errands_jobs")
    assert {r[0] for r in rows} == ids

    executions = cluster.executions()
    attempts_run = Counter((job_id, attempt) for job_id, attempt, _, _ in cluster.effects())
    lost_total = 0
    for job_id, attempt, rescues, raw_errors in rows:
        errors = json.loads(raw_errors)
        lost = [e for e in errors if e["type"] == "WorkerLost"]
        lost_total += len(lost)
        # Only lease losses failed these jobs, each recorded once, with its own attempt.
        assert len(lost) == len(errors) == rescues, (job_id, errors)
        assert sorted(e["attempt"] for e in lost) == list(range(1, attempt)), (job_id, errors)
        # I4: every extra execution is explained by a recorded lease loss.
        assert 1 <= executions[job_id] <= 1 + len(lost), (job_id, executions[job_id], errors)
    # One claim = one fresh lease token: no attempt ever ran twice.
    assert max(attempts_run.values()) == 1
    assert set(executions) == ids

    assert kills >= 5, f"the storm ended after only {kills} kills"
    assert lost_total > 0, "no job was ever caught by a kill: the storm proved nothing"
    assert cluster.integrity() == "ok"
    for proc in cluster.procs:
        assert "database is locked" not in proc.stderr().lower(), proc.label

    print(
        f"storm: {STORM_JOBS} jobs, {kills} SIGKILLs, {lost_total} lease losses recorded, "
        f"{sum(executions.values()) - STORM_JOBS} duplicate executions, 0 lost"
    )
    for proc in workers:  # a worker respawned a moment ago may still be importing: its
        proc.wait_log(r"worker w-[0-9a-f]+ started", timeout=60)  # SIGTERM handler is not in
        proc.signal(signal.SIGTERM)  # place yet, and the default action would end it
    for proc in workers:
        assert proc.wait_exit(15) == 0, proc.label


def test_paused_worker_late_completion_is_rejected_after_another_worker_completed_the_job(
    cluster: Cluster,
) -> None:
    app = cluster.app()
    # Attempt 1 sleeps 3 s (longer than the 2 s lease); a rescued attempt returns at once.
    handle = acc_basic.sleepy.enqueue(seconds=3, first_only=True)

    paused = cluster.start_worker(label="paused")
    wait_until(lambda: cluster.effects(handle.id), 15, "the job to start on the first worker")
    _pause_outside_a_write(paused, cluster)
    try:
        rescuer = cluster.start_worker(label="rescuer")
        wait_until(
            lambda: cluster.state_of(handle.id) == "completed",
            RESCUE_DEADLINE,
            "another worker to rescue and complete the job of the paused worker",
            describe=lambda: str(app.get_job(handle.id)),
        )
        completed = app.get_job(handle.id)
    finally:
        paused.signal(signal.SIGCONT)

    # The resumed worker's handler returns; its fenced completion must change nothing.
    paused.wait_log(r"stale write rejected", 15)
    assert paused.alive, "the resumed worker must keep serving, not crash"

    job = app.get_job(handle.id)
    assert job == completed, "the stale write changed the completed job"
    assert job.state.value == "completed"
    assert job.attempt == 2
    assert job.result["worker"] == rescuer.worker_id
    assert [(e.type, e.attempt, e.worker) for e in job.errors] == [
        ("WorkerLost", 1, paused.worker_id)
    ]
    runs = cluster.effects(handle.id)
    assert [(attempt, worker) for _, attempt, _, worker in runs] == [
        (1, paused.worker_id),
        (2, rescuer.worker_id),
    ]
    assert len(runs) <= 1 + len(job.errors)  # I4

    for proc in (paused, rescuer):
        proc.signal(signal.SIGTERM)
    for proc in (paused, rescuer):
        assert proc.wait_exit(15) == 0, proc.label


def _pause_outside_a_write(proc: Proc, cluster: Cluster) -> None:
    """SIGSTOP ``proc`` at a moment it holds no write transaction of the SQLite file: a
    process stopped inside one (a heartbeat, an election) holds the file's write lock
    until it runs again, and no other worker can rescue anything meanwhile (SQLite's one
    writer; on a busy machine the rescuer waited its whole write_timeout to start)."""
    for _ in range(100):
        proc.signal(signal.SIGSTOP)
        probe = sqlite3.connect(cluster.db_path, timeout=0.2, isolation_level=None)
        try:
            probe.execute("BEGIN IMMEDIATE")
            probe.execute("ROLLBACK")
            return
        except sqlite3.OperationalError:  # locked: let it finish its write, then again
            proc.signal(signal.SIGCONT)
            time.sleep(0.05)
        finally:
            probe.close()
    raise AssertionError("the worker held the SQLite write lock at every try")


def test_handler_that_crashes_its_process_goes_dead_as_poison_after_three_rescues(
    cluster: Cluster,
) -> None:
    app = cluster.app()
    # A steady leader that serves an empty queue rescues the crashes (it never crashes).
    leader = cluster.start_worker("-q", "idle", label="leader", leader=True)
    crash = acc_basic.crash.enqueue()
    others = app.enqueue_many([acc_basic.noop.bind(n=i) for i in range(20)])

    # A supervisor, as systemd or Kubernetes would be: restart the worker when it dies.
    def start(generation: int) -> Proc:
        return cluster.start_worker(
            "-c", "1", "--no-maintenance", label=f"crashy-{generation}", ready=False
        )

    worker = start(0)
    crashes: list[int | None] = []
    deadline = time.monotonic() + 45
    while cluster.state_of(crash.id) != "dead":
        assert time.monotonic() < deadline, f"the crashing job never went dead: {crashes}"
        if not worker.alive:
            crashes.append(worker.returncode)
            worker = start(len(crashes))
        time.sleep(0.05)

    job = app.get_job(crash.id)
    assert job.rescues == 3
    assert job.attempt == 3 < job.max_attempts  # dead as poison, not for running out
    assert [e.type for e in job.errors] == ["WorkerLost"] * 3
    assert [e.attempt for e in job.errors] == [1, 2, 3]
    assert job.errors[-1].message.startswith("poison"), job.errors[-1].message
    assert len(cluster.effects(crash.id)) == 3
    assert crashes == [1, 1, 1]  # os._exit(1), three times, then never again

    # The fleet is not taken down in a loop: the other jobs complete, and so do new ones.
    later = acc_basic.noop.enqueue(n=99)
    wait_until(
        lambda: all(cluster.state_of(h.id) == "completed" for h in [*others, later]),
        20,
        "the other jobs to complete",
        describe=lambda: str(dict(cluster.states())),
    )
    assert worker.alive
    assert cluster.state_of(crash.id) == "dead"
    for proc in (worker, leader):
        proc.signal(signal.SIGTERM)
    for proc in (worker, leader):
        assert proc.wait_exit(15) == 0, proc.label


def test_jobs_claimed_alongside_a_crashing_job_are_not_marked_poison(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.start_worker("-q", "idle", label="leader", leader=True)
    crash = acc_basic.crash.enqueue()
    # Claimed in one batch with the crash (-c 4), still sleeping when it kills the process.
    bystanders = app.enqueue_many([acc_basic.sleepy.bind(seconds=0.5) for _ in range(3)])

    def start(generation: int) -> Proc:
        return cluster.start_worker(
            "-c", "4", "--no-maintenance", label=f"crashy-{generation}", ready=False
        )

    worker, restarts = start(0), 0
    deadline = time.monotonic() + 45
    while cluster.state_of(crash.id) != "dead":
        assert time.monotonic() < deadline, "the crashing job never went dead"
        if not worker.alive:
            restarts += 1
            worker = start(restarts)
        time.sleep(0.05)
    wait_until(
        lambda: all(cluster.state_of(h.id) in ("completed", "dead") for h in bystanders),
        20,
        "the bystanders to finish",
    )
    reasons = {h.id: [e.message for e in app.get_job(h.id).errors] for h in bystanders}
    assert all(cluster.state_of(h.id) == "completed" for h in bystanders), reasons
