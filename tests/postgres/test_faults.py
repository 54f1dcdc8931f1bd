"""Faults on a real PostgreSQL under real worker processes (RELIABILITY F5, F6, F7, F17).

The database restarts (fast and immediate shutdown) or stops for a while, the workers'
sessions are killed with ``pg_terminate_backend``, a worker freezes past its lease
(SIGSTOP), and the maintenance leader is SIGKILLed. After each fault the invariants are
checked in SQL and against the handlers' own effects table: nothing lost (I1), duplicate
executions accounted for by recorded lease losses (I4), stale writes rejected (I6), the
workers recover by themselves (I9), a worker cut off from the database stops its handler
before its lease runs out (self-fencing), a new leader within its lease (F17).
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import pgacc_basic
import pytest

import errands
from tests.pg import OwnServer, fresh_own_pg_url, own_server

from .harness import LEADER_TTL, PgCluster, wait_until

# One xdist worker runs every test that uses the tests' own PostgreSQL cluster: one
# cluster per run, restarted by one test at a time.
pytestmark = [pytest.mark.acceptance, pytest.mark.xdist_group("own_postgres")]

RUN_JOBS = 5_000
RUN_DEADLINE = 120.0


def _enqueue_run(pgc: PgCluster, count: int, ms: float) -> list[int]:
    app = pgc.app()
    ids = []
    for first in range(0, count, 1_000):
        batch = [
            pgacc_basic.touch.bind(n=i, ms=ms) for i in range(first, min(count, first + 1_000))
        ]
        ids.extend(h.id for h in app.enqueue_many(batch))
    app.close()  # the test process keeps no pooled connection across the fault
    return ids


def _wait_completed(pgc: PgCluster, count: int, timeout: float = RUN_DEADLINE) -> None:
    wait_until(
        lambda: pgc.states().get("completed", 0) >= count,
        timeout,
        f"{count} jobs to complete",
        interval=0.2,
        describe=lambda: str(pgc.states()),
    )


def _worked_since(pgc: PgCluster, since: float) -> dict[str, int]:
    return dict(
        pgc.query(
            "SELECT worker, count(*) FROM {s}.effects WHERE at > to_timestamp(%s) GROUP BY 1",
            (since,),
        )
    )


@pytest.fixture
def postgres_cluster() -> Iterator[OwnServer]:
    """The tests' own PostgreSQL cluster, which these tests restart and stop."""
    server = own_server()
    try:
        yield server
    finally:
        server.start()  # whatever happened, later tests find the server up


@pytest.fixture
def pg_url(postgres_cluster: OwnServer) -> Iterator[str]:
    """Every test here runs on the tests' own cluster: the faults it injects (restarts,
    stops, killed sessions) disturb no other test."""
    yield from fresh_own_pg_url()


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_workers_recover_by_themselves_from_a_postgres_restart_and_every_job_completes(
    pgc: PgCluster, postgres_cluster: OwnServer, mode: str
) -> None:
    """Given two workers busy with 5,000 jobs, when PostgreSQL restarts (`-m fast`, and
    `-m immediate`: a crash and recovery), the workers keep running, reconnect without
    help and finish every job; executions per job ≤ 1 + lease losses recorded on it."""
    workers = [pgc.start_worker("-c", "8", label=f"worker{i}") for i in range(2)]
    ids = _enqueue_run(pgc, RUN_JOBS, ms=20)
    _wait_completed(pgc, RUN_JOBS // 5)
    # A few handlers that outlast the outage: their leases (2 s) are at stake during it.
    app = pgc.app()
    long_ids = [
        h.id
        for h in app.enqueue_many(
            [pgacc_basic.sleepy.bind(seconds=4, first_only=True, priority=10) for _ in range(4)]
        )
    ]
    app.close()
    wait_until(
        lambda: len({e[0] for e in pgc.effects() if e[0] in long_ids}) == 4,
        15,
        "the long jobs to start",
    )

    away = postgres_cluster.restart(mode)
    back_at = pgc.db_now()
    done_before = pgc.states().get("completed", 0)
    assert done_before < RUN_JOBS, "the run ended before the restart: make it longer"

    _wait_completed(pgc, RUN_JOBS + len(long_ids))
    figures = pgc.check_accounted(ids + long_ids)
    # No crash loop: both processes are still the ones started, and both ran jobs after
    # the server came back (they reconnected by themselves).
    assert all(w.alive for w in workers), pgc.report()
    after = _worked_since(pgc, back_at)
    assert set(after) == {w.worker_id for w in workers}, after
    print(
        f"restart -m {mode}: server away {away:.1f} s; {done_before} done before; "
        f"after: {after}; {figures}"
    )


def test_worker_cut_off_by_a_postgres_outage_stops_its_handler_before_the_lease_runs_out(
    pgc: PgCluster, postgres_cluster: OwnServer
) -> None:
    """Given a worker running a job, when PostgreSQL stops, the worker's heartbeats fail
    at once (not after the pool's 30 s wait) and it asks the handler to stop before its
    2 s lease runs out (self-fencing, DESIGN §3); once the server is back the job is
    retried and completes, and the worker never stopped running."""
    app = pgc.app()
    worker = pgc.start_worker(label="worker")
    handle = pgacc_basic.patient.enqueue()
    wait_until(lambda: pgc.effects(handle.id), 15, "the job to start")
    app.close()

    fence = re.compile(rf"cannot renew the lease of job {handle.id}:")
    cut_at = time.monotonic()
    postgres_cluster.stop("fast")
    try:
        wait_until(
            lambda: fence.search(worker.stderr()),
            pgacc_basic.LEASE + 10,
            "the worker to self-fence",
            describe=lambda: worker.stderr()[-3000:],
        )
        fenced_after = time.monotonic() - cut_at
    finally:
        postgres_cluster.start()
    # The worker fenced on its own clock, before the lease it last renewed ran out (the
    # renewal counts from before its request was sent: the store's lease ends later). The
    # wall-clock figure seen from here only shows it did not wait for the pool's 30 s
    # timeout: on a loaded machine this process may see the log line late.
    match = re.search(rf"{fence.pattern} .*\(in (-?[0-9.]+) s\)", worker.stderr())
    assert match is not None, worker.stderr()[-2000:]
    assert float(match.group(1)) > 0, f"fenced {match.group(1)} s before the lease ran out"
    assert fenced_after < pgacc_basic.LEASE * 5, f"self-fenced {fenced_after:.1f} s after"

    wait_until(
        lambda: pgc.state_of(handle.id) == "completed",
        60,
        "the job to complete after the outage",
        describe=lambda: str(pgc.errors_of(handle.id)),
    )
    pgc.check_accounted([handle.id])
    assert worker.alive
    print(f"self-fenced {fenced_after:.2f} s after the server stopped")


def test_jobs_complete_and_duplicates_stay_accounted_when_worker_sessions_are_killed(
    pgc: PgCluster,
) -> None:
    """Given two busy workers, when every one of their PostgreSQL sessions (pools and
    LISTEN) is terminated every 0.5 s for 4 s, every job still completes and executions
    per job ≤ 1 + lease losses recorded on it (I1, I4)."""
    workers = [pgc.start_worker("-c", "8", label=f"worker{i}") for i in range(2)]
    ids = _enqueue_run(pgc, RUN_JOBS, ms=20)
    _wait_completed(pgc, RUN_JOBS // 10)

    killed = 0
    rounds = 0
    storm_end = time.monotonic() + 4.0
    while time.monotonic() < storm_end:
        killed += pgc.terminate_backends()
        rounds += 1
        time.sleep(0.5)
    storm_over = pgc.db_now()
    assert killed >= rounds // 2, f"only {killed} sessions terminated in {rounds} rounds"
    assert pgc.states().get("completed", 0) < RUN_JOBS, "the run ended during the storm"

    _wait_completed(pgc, RUN_JOBS)
    figures = pgc.check_accounted(ids)
    assert all(w.alive for w in workers), pgc.report()
    after = _worked_since(pgc, storm_over)
    assert set(after) == {w.worker_id for w in workers}, after
    print(f"{killed} sessions terminated in {rounds} rounds; after: {after}; {figures}")


def test_worker_frozen_past_its_lease_has_its_late_completion_rejected(pgc: PgCluster) -> None:
    """Given a worker frozen (SIGSTOP) mid-job for longer than its 2 s lease, another
    worker takes the job over and completes it; when the frozen one resumes (SIGCONT)
    its late completion is rejected ("stale write rejected") and the job keeps the
    other worker's result, with exactly one WorkerLost entry (F5, I6)."""
    app = pgc.app()
    frozen = pgc.start_worker(label="frozen")
    handle = pgacc_basic.sleepy.enqueue(seconds=1.0, first_only=True)
    wait_until(lambda: pgc.effects(handle.id), 15, "the job to start on the first worker")
    frozen.signal(signal.SIGSTOP)
    try:
        other = pgc.start_worker(label="other")
        wait_until(
            lambda: pgc.state_of(handle.id) == "completed",
            30,
            "the other worker to rescue and complete the job",
            describe=lambda: str(app.get_job(handle.id)),
        )
    finally:
        frozen.signal(signal.SIGCONT)
    frozen.wait_log(rf"stale write rejected: job {handle.id} ", timeout=15)

    job = app.get_job(handle.id)
    assert job.state == "completed"
    # a rescued job runs isolated, in a child process of the worker that took it over
    assert job.result == {"attempt": 2, "pid": job.result["pid"], "worker": other.worker_id}
    parent = _parent_pid(job.result["pid"])  # the worker's forkserver (or the worker)
    assert other.pid in (parent, _parent_pid(parent))
    assert [(e.type, e.attempt) for e in job.errors] == [("WorkerLost", 1)]
    assert [(a, w) for _, a, _, w in pgc.effects(handle.id)] == [
        (1, frozen.worker_id),
        (2, other.worker_id),
    ]
    assert frozen.alive and other.alive  # the resumed worker carries on serving


def test_killed_leader_is_replaced_and_its_running_job_rescued_within_lease_and_leader_ttl(
    pgc: PgCluster,
) -> None:
    """Given two workers where the maintenance leader runs a long job, when the leader is
    SIGKILLed, the other worker becomes leader (errands_leaders) and rescues the job
    within lease + leader ttl, then completes it (F17)."""
    app = pgc.app()
    leader = pgc.start_worker(label="leader")
    wait_until(lambda: pgc.leader() == leader.worker_id, 15, "the first worker to lead")
    handle = pgacc_basic.sleepy.enqueue(seconds=60, first_only=True)
    wait_until(lambda: pgc.effects(handle.id), 15, "the job to start on the leader")
    follower = pgc.start_worker(label="follower")
    assert pgc.leader() == leader.worker_id

    killed_at = pgc.db_now()
    leader.signal(signal.SIGKILL)
    assert leader.wait_exit(5) == -signal.SIGKILL

    wait_until(
        lambda: pgc.state_of(handle.id) == "completed",
        30,
        "the follower to take over, rescue and complete the job",
        describe=lambda: str(app.get_job(handle.id)),
    )
    assert pgc.leader() == follower.worker_id
    follower.wait_log(rf"worker {follower.worker_id} is now the maintenance leader", timeout=5)
    job = app.get_job(handle.id)
    (lost,) = job.errors
    assert lost.type == "WorkerLost" and lost.worker == leader.worker_id
    rescued_after = lost.at.timestamp() - killed_at
    assert rescued_after <= pgacc_basic.LEASE + LEADER_TTL, (
        f"rescued {rescued_after:.1f} s after the kill"
    )
    assert job.result["worker"] == follower.worker_id
    print(f"rescued {rescued_after:.2f} s after the leader was killed")


OUTAGE = 20.0  # long enough that unbounded reconnect backoff would wait ~11 s after it


def test_worker_resumes_within_seconds_after_a_long_database_outage(pg_url: str) -> None:
    """A worker cut off from PostgreSQL for 20 s (every connection reset, new ones
    refused at once) picks up a new job within a few seconds of the database coming back: its
    pool's reconnect attempts and its claim retries back off, but only up to a few
    seconds, so a long outage does not leave workers asleep after it ends."""
    from tests.conftest import running_worker
    from tests.soak.proxy import FaultProxy, ProxyLoop

    server = urlsplit(pg_url)
    loop = ProxyLoop()
    proxy = FaultProxy(loop, server.hostname or "127.0.0.1", server.port or 5432)
    direct = errands.App(pg_url)
    cut_off = errands.App(urlunsplit(server._replace(netloc=f"postgres@127.0.0.1:{proxy.port}")))
    assert cut_off.url != pg_url
    for app in (direct, cut_off):
        app.job(name="outage.ping", retries=0)(_ping)
    try:
        with running_worker(cut_off, poll_interval=0.2):
            first = direct.enqueue_many([direct.registry["outage.ping"].bind(n=1)])[0]
            wait_until(lambda: first.status().value == "completed", 20, "the first job")
            proxy.refuse()
            time.sleep(OUTAGE)
            proxy.refuse(False)
            healed = time.monotonic()
            second = direct.enqueue_many([direct.registry["outage.ping"].bind(n=2)])[0]
            wait_until(lambda: second.status().value == "completed", 60, "the second job")
            resumed_after = time.monotonic() - healed
        assert resumed_after < 8.0, f"the worker resumed {resumed_after:.1f} s after the outage"
    finally:
        cut_off.close()
        direct.close()
        proxy.close()
        loop.close()


def _ping(n: int) -> int:
    return n


def _parent_pid(pid: int) -> int:
    """The parent of a live process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])
