"""Leases, fencing, rescue and poison jobs, in-process (DESIGN §3, F1, F5, F11, F12).

Lease loss is forced: the test moves a running job's ``lease_expires_at`` into the past and
rescues it with its own rescuer, as the maintenance leader would after a worker paused for
longer than its lease. The stale attempt's handler is still running when that happens.
"""

import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import errands
from errands import JobState, clock
from errands.maintenance.service import LEADER_NAME, Maintenance, leader_ttl
from tests.conftest import needs_boottime, suspend_host

from .helpers import claim_as_dead_worker, expire_lease, force_rescue, raw_row, wait_until


def test_stale_completion_after_lease_loss_is_rejected_and_the_job_completes_exactly_once(
    app: errands.App, worker_factory
) -> None:
    release_first = threading.Event()
    runs: list[int] = []
    first_saw: dict[str, object] = {}

    @app.job(name="lease.duplicate", lease=1, retries=3, backoff=0.05)
    def duplicate(ctx: errands.Context) -> int:
        runs.append(ctx.attempt)
        if ctx.attempt == 1:
            for _ in range(1000):  # "paused" past its lease, until the worker says stop
                if ctx.cancelled:
                    first_saw["reason"] = ctx.cancel_reason
                    break
                threading.Event().wait(0.01)
            release_first.wait(10)  # then hold on until attempt 2 has completed
        return ctx.attempt

    handle = duplicate.enqueue()
    with worker_factory(concurrency=2, maintenance=False) as worker:
        wait_until(lambda: runs == [1], what="attempt 1 to start")
        stale = force_rescue(app, handle.id)
        # duplicate delivery: the same worker claims the job again and completes it
        assert handle.result(timeout=10) == 2
        # the stale handler is told by the next heartbeat that its lease is gone
        wait_until(lambda: first_saw, what="the stale handler to be told to stop")
        release_first.set()
        wait_until(lambda: worker.completer.stale_rejected == 1, what="the stale write")

    assert runs == [1, 2]
    assert first_saw == {"reason": "lease lost"}
    job = handle.job()
    assert job.state is JobState.COMPLETED
    assert job.attempt == 2
    assert job.result == 2  # attempt 1's late "1" was not written over it
    assert job.rescues == 1
    [lost] = job.errors
    assert (lost.type, lost.attempt, lost.worker) == ("WorkerLost", 1, worker.id)
    assert raw_row(app, handle.id).lease_token is None
    assert stale.lease_token is not None


def test_stale_attempt_finishing_first_does_not_drop_the_newer_attempts_lease(
    app: errands.App, worker_factory
) -> None:
    """Attempt 1 (stale) returns while attempt 2 of the same job runs in the same worker.

    Attempt 2 must keep its heartbeat: if it lost it, the maintenance leader would rescue
    it after its 1 s lease and run the job a third time.
    """
    release_first = threading.Event()
    release_second = threading.Event()
    runs: list[int] = []

    @app.job(name="lease.overlap", lease=1, retries=5, backoff=0.05)
    def overlap(ctx: errands.Context) -> int:
        runs.append(ctx.attempt)
        (release_first if ctx.attempt == 1 else release_second).wait(10)
        return ctx.attempt

    handle = overlap.enqueue()
    with worker_factory(concurrency=2) as worker:
        wait_until(lambda: runs == [1], what="attempt 1 to start")
        force_rescue(app, handle.id)
        wait_until(lambda: runs == [1, 2], what="attempt 2 to start")
        release_first.set()
        wait_until(lambda: worker.completer.stale_rejected == 1, what="the stale write")
        # attempt 2 runs on for more than two of its leases; the leader rescues expired ones
        wait_until(lambda: worker.maintenance and worker.maintenance.is_leader)
        threading.Event().wait(2.5)
        row = raw_row(app, handle.id)
        assert (row.state, row.attempt, row.rescues) == ("running", 2, 1)
        release_second.set()
        assert handle.result(timeout=10) == 2

    assert runs == [1, 2]
    job = handle.job()
    assert job.rescues == 1
    assert [e.attempt for e in job.errors] == [1]


def test_worker_whose_lease_was_lost_stops_its_handler_and_its_write_is_rejected(
    app: errands.App, worker_factory
) -> None:
    runs: list[int] = []
    reasons: list[str] = []

    @app.job(name="lease.polite", lease=1, retries=3, backoff=0.05)
    def polite(ctx: errands.Context) -> int:
        runs.append(ctx.attempt)
        if ctx.attempt == 1:
            for _ in range(1000):
                if ctx.cancelled:
                    reasons.append(ctx.cancel_reason)
                    break
                threading.Event().wait(0.01)
        return ctx.attempt

    handle = polite.enqueue()
    # one slot: attempt 2 can only start once the stale attempt 1 gave it back
    with worker_factory(concurrency=1, maintenance=False) as worker:
        wait_until(lambda: runs == [1], what="attempt 1 to start")
        force_rescue(app, handle.id)
        assert handle.result(timeout=10) == 2

    assert reasons == ["lease lost"]
    assert runs == [1, 2]
    assert worker.completer.stale_rejected == 1
    job = handle.job()
    assert (job.state, job.attempt, job.result) == (JobState.COMPLETED, 2, 2)


def test_expired_lease_of_a_dead_worker_is_rescued_as_worker_lost_then_completed(
    app: errands.App, worker_factory
) -> None:
    @app.job(name="lease.rescued", retries=3, backoff=lambda attempt: 0.5)
    def rescued(ctx: errands.Context) -> int:
        return ctx.attempt

    handle = rescued.enqueue()
    claim_as_dead_worker(app, handle.id, worker_id="dead-worker", lease=1.0)  # never finishes

    states: list[JobState] = []

    def finished() -> bool:
        state = handle.status()
        if not states or states[-1] is not state:
            states.append(state)
        return state.is_terminal

    with worker_factory() as worker:
        wait_until(finished, interval=0.005, what="the rescued job to finish")
        assert worker.maintenance is not None and worker.maintenance.rescued == 1

    assert states[0] is JobState.RUNNING  # held by the dead worker
    assert JobState.RETRYABLE in states
    assert states[-1] is JobState.COMPLETED
    assert handle.result(timeout=1) == 2
    job = handle.job()
    assert job.attempt == 2
    assert job.rescues == 1
    [lost] = job.errors
    assert (lost.type, lost.attempt, lost.worker) == ("WorkerLost", 1, "dead-worker")
    assert "lost its lease on attempt 1" in lost.message
    assert lost.traceback is None
    # rescued to retryable with the job's own backoff
    assert (job.run_at - lost.at).total_seconds() == pytest.approx(0.5, abs=0.01)


def test_job_rescued_three_times_goes_dead_as_poison(app: errands.App) -> None:
    dead: list[errands.Job] = []
    app.on_dead(dead.append)

    @app.job(name="lease.poison", retries=10, backoff=0)
    def crashes_its_worker() -> None:
        raise AssertionError("only dead workers hold this job")

    handle = crashes_its_worker.enqueue()
    leader = Maintenance(app, "leader")
    for crash in range(1, 4):
        row = claim_as_dead_worker(app, handle.id, worker_id=f"worker-{crash}")
        assert row.attempt == crash
        assert expire_lease(app, handle.id) == 1
        leader.run_once()
        assert leader.is_leader
        assert raw_row(app, handle.id).rescues == crash

    job = handle.job()
    assert job.state is JobState.DEAD
    assert job.attempt == 3 < job.max_attempts  # dead for being poison, not out of attempts
    assert [e.type for e in job.errors] == ["WorkerLost"] * 3
    assert [e.worker for e in job.errors] == ["worker-1", "worker-2", "worker-3"]
    assert job.errors[-1].message.startswith("poison: worker died 3 times")
    wait_until(lambda: dead, what="the on_dead hook (it runs on its own thread)")
    assert [j.id for j in dead] == [handle.id]
    leader.stop()


def test_replayed_poison_job_starts_with_a_clean_rescue_count_and_completes(
    app: errands.App, worker_factory
) -> None:
    healthy = {"now": False}

    @app.job(name="lease.poison_then_fixed", retries=10, backoff=0)
    def fixed_later() -> str:
        assert healthy["now"]
        return "fixed"

    handle = fixed_later.enqueue()
    leader = Maintenance(app, "leader")
    for crash in range(1, 4):
        claim_as_dead_worker(app, handle.id, worker_id=f"worker-{crash}")
        expire_lease(app, handle.id)
        leader.run_once()
    leader.stop()
    assert handle.status() is JobState.DEAD

    healthy["now"] = True
    assert app.replay([handle.id]).matched == [handle.id]
    assert raw_row(app, handle.id).rescues == 0
    with worker_factory():
        assert handle.result(timeout=10) == "fixed"
    assert handle.job().attempt == 1


def test_lease_expiring_on_the_last_attempt_goes_dead_as_worker_lost(app: errands.App) -> None:
    @app.job(name="lease.last_chance", retries=0)
    def last_chance() -> None:
        raise AssertionError("only a dead worker holds this job")

    handle = last_chance.enqueue()
    claim_as_dead_worker(app, handle.id)
    expire_lease(app, handle.id)
    leader = Maintenance(app, "leader")
    leader.run_once()
    leader.stop()

    job = handle.job()
    assert job.state is JobState.DEAD
    [lost] = job.errors
    assert lost.type == "WorkerLost"
    assert not lost.message.startswith("poison")
    with pytest.raises(errands.JobFailed, match="WorkerLost"):
        handle.result(timeout=1)


def test_cancel_of_a_job_whose_worker_died_ends_cancelled_at_rescue_and_never_runs(
    app: errands.App, worker_factory
) -> None:
    ran: list[int] = []

    @app.job(name="lease.cancel_while_lost", retries=3, backoff=0)
    def cancel_while_lost() -> None:
        ran.append(1)

    @app.job(name="lease.sentinel")
    def sentinel() -> str:
        return "done"

    handle = cancel_while_lost.enqueue()
    claim_as_dead_worker(app, handle.id, lease=1.0)
    assert handle.cancel().state == "running"  # asked; nobody is there to stop it
    expire_lease(app, handle.id)
    with worker_factory() as worker:
        wait_until(lambda: handle.status() is JobState.CANCELLED, what="rescue to cancel it")
        assert sentinel.enqueue().result(timeout=10) == "done"
        assert worker.maintenance is not None and worker.maintenance.rescued == 1

    assert ran == []
    assert handle.job().attempt == 1


def test_a_burst_of_rescued_jobs_drains_as_fast_as_they_run_not_one_per_poll_interval(
    app: errands.App, worker_factory
) -> None:
    """Rescued jobs (suspects) run one at a time per worker, but the next one is claimed
    as soon as the last ends: a poll interval of 30 s would otherwise space them 30 s."""
    running: list[int] = []
    overlap: list[int] = []

    @app.job(name="lease.suspect", retries=3, backoff=0)
    def suspect(n: int) -> int:
        if running:
            overlap.append(n)
        running.append(n)
        threading.Event().wait(0.05)
        running.remove(n)
        return n

    handles = [suspect.enqueue(n=i) for i in range(5)]
    for handle in handles:
        claim_as_dead_worker(app, handle.id, lease=1.0)
    for handle in handles:
        force_rescue(app, handle.id)
    assert {raw_row(app, h.id).rescues for h in handles} == {1}

    with worker_factory(concurrency=4, poll_interval=30.0, maintenance=False):
        assert [h.result(timeout=10) for h in handles] == list(range(5))

    assert overlap == []  # never two suspects side by side


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_claim_whose_reply_came_back_after_its_lease_ran_out_is_not_run(
    app: errands.App, worker_factory, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The store starts a lease when it runs the claim; a reply held up past the lease (a
    network cut that delivers it late) must not start the handler: the job may be
    rescued and running elsewhere by then. The worker counts the lease from the claim's
    send, hands the lease back, and the job runs once, on a later claim."""
    held: list[str] = []
    real_claim = app.backend.job_claim

    def claim(params):
        rows = real_claim(params)
        if rows and not held:
            held.extend(row.lease_token or "" for row in rows)
            time.sleep(1.3)  # the reply held past the 1 s lease
        return rows

    monkeypatch.setattr(app.backend, "job_claim", claim)
    ran: list[str] = []

    def token(ctx: errands.Context) -> str:
        return ctx._runtime.attempt.row.lease_token  # type: ignore[attr-defined]

    if kind == "sync":

        @app.job(name="lease.held_reply", lease=1)
        def job(ctx: errands.Context) -> None:
            ran.append(token(ctx))

    else:

        @app.job(name="lease.held_reply", lease=1)
        async def job(ctx: errands.Context) -> None:
            ran.append(token(ctx))

    handle = job.enqueue()
    with worker_factory(concurrency=2):
        assert handle.result(timeout=60) is None
    assert held and len(ran) == 1 and ran[0] not in held, (held, ran)


def test_leadership_lasts_no_longer_than_a_lease_so_a_stopped_leaders_rescues_move_on(
    app: errands.App,
) -> None:
    """A leader that stops (SIGSTOP, a frozen VM) stops the rescues until its leadership
    runs out: it lasts five ticks, at least 5 s, but no longer than the app's lease (at
    least two ticks), so the jobs of a worker that died beside it are rescued about as
    soon as their own leases run out (the full-size soak: 21 rescued jobs waited 4.2-5.7 s
    behind a stopped leader, with 2 s leases)."""
    assert leader_ttl(1.0, 30.0) == 5.0  # the defaults: unchanged
    assert leader_ttl(2.0, 60.0) == 10.0
    assert leader_ttl(0.2, 2.0) == 2.0  # the soak's: a lease
    assert leader_ttl(1.0, 0.5) == 2.0  # two ticks at least
    app.lease = 3.0
    stopped, other = Maintenance(app, "w-stopped"), Maintenance(app, "w-other")
    assert stopped.ttl == 3.0
    stopped.run_once()
    assert stopped.is_leader
    other.run_once()
    assert not other.is_leader  # the leadership is held while renewed
    # the leader ticks no more: once its leadership runs out, the other takes over
    wait_until(lambda: other.run_once() or other.is_leader, timeout=30, interval=0.2)


def test_a_leader_whose_tick_outlasts_a_third_of_its_leadership_renews_it_between_duties(
    app: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Leadership is renewed at the start of a tick; a tick slower than a third of it (a
    big rescue batch, a prune, a store waiting on a lock) renews it again between its
    duties, so that no other worker takes it over and runs the same duties beside it."""
    app.lease = 3.0  # leadership: 3 s
    # the promotion then takes past a third of the leadership
    leader, elections = _tick(app, monkeypatch, "w-slow", lambda: time.sleep(1.2))
    assert leader.is_leader
    assert elections == ["w-slow", "w-slow"]  # at the start, and after the slow duty


def _tick(
    app: errands.App, monkeypatch: pytest.MonkeyPatch, worker_id: str, after: Callable[[], object]
) -> tuple[Maintenance, list[str]]:
    """One tick of a leader ``worker_id`` that calls ``after`` once its first duty (the
    promotion) is done; the leader, and every election it asked the store for."""
    leader = Maintenance(app, worker_id)
    elections: list[str] = []
    elect, promote = app.backend.leader_attempt_elect, app.backend.job_promote_due

    def counted(name: str, owner: str, ttl: float) -> bool:
        elections.append(owner)
        return elect(name, owner, ttl)

    def promotion_then(limit: int = 1000) -> int:
        done = promote(limit)
        after()
        return done

    monkeypatch.setattr(app.backend, "leader_attempt_elect", counted)
    monkeypatch.setattr(app.backend, "job_promote_due", promotion_then)
    leader.run_once()
    return leader, elections


@needs_boottime
def test_a_leader_whose_host_was_suspended_during_a_tick_renews_before_its_next_duty(
    app: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a leader whose host sleeps for a minute during a tick (past its leadership,
    a few seconds, which the store's clock counted), then it asks the store again before
    the tick's next duty, and runs it only if still the leader: another worker may have
    taken the leadership meanwhile. Its clock had stopped during the suspend, so it ran
    the next duty as leader without asking."""
    # the lid closed after the tick's first duty
    leader, elections = _tick(app, monkeypatch, "w-sleeper", lambda: suspend_host(monkeypatch, 60))
    assert leader.is_leader
    assert elections == ["w-sleeper", "w-sleeper"]  # at the start, and after the suspend


def test_a_leader_stopped_during_a_long_duty_does_not_take_the_leadership_again(
    app: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop() waits for the duty in flight, then resigns. A duty that outlives the wait
    ends the tick without renewing: it took the leadership stop() had just resigned, ran
    the tick's other duties on a worker on its way out, and held it until it expired."""
    app.lease = 3.0  # leadership: 3 s; renewed between duties after 1 s
    leader = Maintenance(app, "w-leaving", tick=0.05)
    entered, release = threading.Event(), threading.Event()
    after_stop: list[str] = []
    rescue, expire_waits = leader.rescue, leader.expire_waits

    def long_rescue() -> int:
        entered.set()
        release.wait(30)
        return rescue()

    def recorded_expire_waits() -> int:
        if leader._stop.is_set():
            after_stop.append("signal timeouts")
        return expire_waits()

    monkeypatch.setattr(leader, "rescue", long_rescue)
    monkeypatch.setattr(leader, "expire_waits", recorded_expire_waits)
    leader.start()
    assert entered.wait(30) and leader.is_leader
    leader.stop(wait=0.2)  # the rescue is still running: stop() resigns and returns
    time.sleep(1.2)  # past a third of the leadership: a renewal would be due
    release.set()
    leader._thread.join(30)
    assert not leader._thread.is_alive()
    assert after_stop == []  # the tick ended with its duty
    assert not leader.is_leader
    assert Maintenance(app, "w-next")._elect()  # free at once, not held until it expires


def test_a_leader_stopped_during_its_election_resigns_once(
    app: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop() whose wait runs out while the thread is inside an election resigns; the
    election then returns to a stopped leader, which gives the leadership up again
    without a second errands.leader.resigned (metrics and the lifecycle log counted
    two), and a thread stopped while leader resigns as it ends."""
    leader = Maintenance(app, "w-electing", tick=0.05)
    events: list[str] = []
    app.events.subscribe(lambda event: events.append(event.name), inline=True)
    elect = app.backend.leader_attempt_elect
    calls, entered, release = [0], threading.Event(), threading.Event()

    def slow_second_election(name: str, worker_id: str, ttl: float) -> bool:
        calls[0] += 1
        if calls[0] == 2:
            entered.set()
            release.wait(30)
        return elect(name, worker_id, ttl)

    monkeypatch.setattr(app.backend, "leader_attempt_elect", slow_second_election)
    monkeypatch.setattr(leader, "run_once", leader._elect)  # elections only: every tick
    leader.start()
    assert entered.wait(30) and leader.is_leader
    leader.stop(wait=0.2)  # the election is still running: stop() resigns and returns
    release.set()
    leader._thread.join(30)
    assert not leader._thread.is_alive()
    leadership = [e for e in events if e.startswith("errands.leader.")]
    assert leadership == ["errands.leader.elected", "errands.leader.resigned"]
    assert not leader.is_leader
    assert Maintenance(app, "w-next")._elect()  # free at once, not held until it expires


def _failing_election(name: str, worker_id: str, ttl: float) -> bool:
    raise OSError("connection to the store lost")


def test_a_leader_whose_elections_fail_steps_down_once_its_leadership_runs_out(
    app: errands.App, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Given a leader whose elections start to raise (the store unreachable), then it
    stays leader while the store still names it (its last election's ttl), runs no duty,
    and once that ttl has run out steps down: is_leader false, errands.leader.resigned
    once, the errands_leader gauge 0; when an election works again it is elected anew.
    It kept claiming the leadership (gauge 1) for ever, beside the worker that took over."""
    from errands import clock
    from errands.observability.metrics import install_metrics
    from tests.observability.conftest import metric_value

    registry = install_metrics(app, cache_seconds=0).registry
    events: list[str] = []
    app.events.subscribe(lambda event: events.append(event.name), inline=True)
    leader = Maintenance(app, "w-cut-off", tick=0.05)
    assert leader._elect() and leader.is_leader
    wait_until(lambda: metric_value(registry, "errands_leader") == 1, what="leader gauge 1")
    elect = app.backend.leader_attempt_elect
    monkeypatch.setattr(app.backend, "leader_attempt_elect", _failing_election)
    ran: list[str] = []
    monkeypatch.setattr(leader, "rescue", lambda: ran.append("rescue"))

    leader.run_once()  # within the ttl: still the leader, no duty
    assert leader.is_leader and ran == []
    real_now = clock.now
    monkeypatch.setattr(clock, "now", lambda: real_now() + leader.ttl + 1)  # the ttl is over
    for _ in range(3):
        leader.run_once()
    assert not leader.is_leader and ran == []
    wait_until(lambda: metric_value(registry, "errands_leader") == 0, what="leader gauge 0")
    leadership = [e for e in events if e.startswith("errands.leader.")]
    assert leadership == ["errands.leader.elected", "errands.leader.resigned"]

    monkeypatch.setattr(app.backend, "leader_attempt_elect", elect)
    caplog.set_level(logging.INFO, logger="errands.maintenance")
    assert leader._elect() and leader.is_leader
    assert "leader election works again (after 4 failed)" in caplog.text
    leadership = [e for e in events if e.startswith("errands.leader.")]
    assert leadership[-1] == "errands.leader.elected"


def test_a_failing_leader_election_is_logged_once_an_interval_with_one_traceback(
    app: errands.App, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Given a maintenance thread whose every election raises, ticking every 20 ms, then
    40 failed elections write one warning with the traceback (the next is due after
    ELECTION_WARN_EVERY) and no "maintenance tick failed": each tick logged a full
    traceback (45 in 9 s at tick 0.2)."""
    caplog.set_level(logging.DEBUG, logger="errands.maintenance")
    calls = [0]

    def failing(name: str, worker_id: str, ttl: float) -> bool:
        calls[0] += 1
        raise OSError("connection to the store lost")

    monkeypatch.setattr(app.backend, "leader_attempt_elect", failing)
    leader = Maintenance(app, "w-unlucky", tick=0.02)
    leader.start()
    try:
        wait_until(lambda: calls[0] >= 40, timeout=60, what="40 failed elections")
    finally:
        leader.stop()
    records = [r for r in caplog.records if r.name == "errands.maintenance"]
    loud = [r for r in records if r.levelno >= logging.WARNING]
    assert len(loud) == 1, [r.getMessage() for r in loud]
    assert "leader election failed (connection to the store lost)" in loud[0].getMessage()
    assert loud[0].exc_info is not None
    assert sum("failed again" in r.getMessage() for r in records) >= 39
    assert not leader.is_leader


STEPPED_DOWN_AND_BACK = [
    "errands.leader.elected",
    "errands.leader.resigned",
    "errands.leader.elected",
]


@contextlib.contextmanager
def _leaders_row_held(app: errands.App) -> Iterator[None]:
    """Another session holds what an election needs, until the block ends: on PostgreSQL
    the leadership's row (SELECT ... FOR UPDATE, so the election's upsert waits for it);
    on SQLite the file's write lock (BEGIN IMMEDIATE). The election hangs without an
    error, as it does when the store stops answering (a partition with no RST)."""
    backend: Any = app.backend
    if hasattr(backend, "schema"):  # PostgreSQL
        import psycopg

        with psycopg.connect(backend.config.conninfo) as conn:  # a transaction: BEGIN
            held = conn.execute(
                f'SELECT name FROM "{backend.schema}".errands_leaders WHERE name = %s FOR UPDATE',
                (LEADER_NAME,),
            ).fetchall()
            assert held == [(LEADER_NAME,)]
            try:
                yield
            finally:
                conn.rollback()
        return
    conn = sqlite3.connect(backend.path, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            conn.execute("ROLLBACK")
    finally:
        conn.close()


def test_a_leader_whose_election_hangs_steps_down_once_its_leadership_runs_out(
    each_store_url: str,
) -> None:
    """Given a leader whose election stops answering (another session holds the lock it
    needs: no error, no reply), then it steps down once the leadership its last granted
    election gave it has run out (is_leader false, errands.leader.resigned once), as one
    whose election raises does; once the store answers again it is elected anew. Its
    election waited without a bound (SQLite: up to its write_timeout, here longer than
    the test), and all the while it went on believing it led."""
    url = each_store_url
    if url.startswith("sqlite"):  # the store's own wait for its write lock: not the bound
        url += "?write_timeout=600"
    app = errands.App(url, lease=2)
    app.migrate()
    leader = Maintenance(app, "w-partitioned", tick=0.05)
    stepped_down: list[tuple[float, float]] = []  # (when, the leadership's end then)
    events: list[str] = []

    def seen(event: Any) -> None:
        events.append(event.name)
        if event.name == "errands.leader.resigned":
            stepped_down.append((clock.now(), leader._leader_until))

    app.events.subscribe(seen, inline=True)
    leader.start()
    try:
        wait_until(lambda: leader.is_leader, timeout=60, what="the leadership")
        with _leaders_row_held(app):
            wait_until(lambda: stepped_down, timeout=60, what="the hung leader to step down")
            assert not leader.is_leader
            [(when, leadership_ends)] = stepped_down
            assert when >= leadership_ends  # never before the store could name another
        # the store answers again: the hung election ends, the next one elects it anew
        wait_until(lambda: leader.is_leader, timeout=60, what="the leadership again")
        assert events == STEPPED_DOWN_AND_BACK
    finally:
        leader.stop()
        app.close()


def _duty_meets_a_lock(
    app: errands.App,
    lock: Callable[[], Callable[[], None]],
    then: Callable[[Callable[[], int]], int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A leader whose rescue, once armed, takes ``lock`` (another session's; it returns
    how to let go) and then calls ``then`` (which meets the lock): the leader steps down
    once its leadership has run out, never before, the rescue's failure logged; once
    the lock is let go it is elected anew. Closes ``app``."""
    leader = Maintenance(app, "w-duty-locked", tick=0.05)
    stepped_down: list[tuple[float, float]] = []
    events: list[str] = []
    armed, locked, free = threading.Event(), threading.Event(), threading.Event()
    rescue = leader.rescue

    def seen(event: Any) -> None:
        events.append(event.name)
        if event.name == "errands.leader.resigned":
            stepped_down.append((clock.now(), leader._leader_until))

    def rescue_meeting_a_lock() -> int:
        if not armed.is_set() or locked.is_set():
            return rescue()
        let_go = lock()
        locked.set()
        threading.Thread(target=lambda: (free.wait(), let_go())).start()
        return then(rescue)

    leader.rescue = rescue_meeting_a_lock  # type: ignore[method-assign]
    app.events.subscribe(seen, inline=True)
    leader.start()
    try:
        wait_until(lambda: leader.is_leader, timeout=60, what="the leadership")
        armed.set()
        wait_until(locked.is_set, timeout=60, what="the duty to meet the lock")
        wait_until(lambda: stepped_down, timeout=60, what="the leader to step down")
        assert not leader.is_leader
        [(when, leadership_ends)] = stepped_down
        assert when >= leadership_ends  # never before the store could name another
        assert "maintenance rescue failed" in caplog.text  # its store call gave up
        free.set()
        wait_until(lambda: leader.is_leader, timeout=60, what="the leadership again")
        assert events == STEPPED_DOWN_AND_BACK
    finally:
        free.set()
        leader.stop()
        app.close()


def _app_with_a_file_to_lock(
    tmp_path: Any, lease: float
) -> tuple[errands.App, Callable[[], Callable[[], None]], Callable[[], object]]:
    """An SQLite app (write_timeout 600 s) with a no-op job: the app, ``lock()`` (another
    session takes the file's write lock; it returns how to let go) and ``write()`` (an
    enqueue: waits for that lock)."""
    path = f"{tmp_path}/leader.db"
    app = errands.App(f"sqlite:///{path}?write_timeout=600", lease=lease)

    @app.job(name="noop")
    def noop() -> None:
        pass

    app.migrate()

    def lock() -> Callable[[], None]:
        holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        holder.execute("BEGIN IMMEDIATE")
        return lambda: (holder.rollback(), holder.close())

    return app, lock, noop.enqueue


def test_a_leader_whose_duty_waits_for_a_locked_sqlite_file_steps_down_once_its_leadership_runs_out(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Given a leader one of whose duties waits for the SQLite file's write lock (another
    session took it as the duty began; write_timeout 600 s), then the duty's write gives
    up at the leadership's end (DatabaseBusy, logged as the duty's failure), the next
    election finds the file still locked, and the leader steps down (resigned once,
    never before its leadership ran out); once the file is free it is elected anew. The
    duty waited up to write_timeout on the leader's thread while the leadership ran
    out, the leader never asking again and never stepping down."""
    app, lock, enqueue = _app_with_a_file_to_lock(tmp_path, lease=2)

    def write(rescue: Callable[[], int]) -> int:
        enqueue()  # a write: waits for the lock the holder has
        return 0

    _duty_meets_a_lock(app, lock, write, caplog)


def test_a_stop_ends_a_leader_duty_waiting_for_a_locked_sqlite_file(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Given a leader whose duty waits for the SQLite file's write lock (another session
    took it as the duty began; a 50 s leadership bounds the wait), when it is stopped,
    then the duty's wait ends at once, the maintenance thread ends within stop()'s wait
    and the duty says it was ended by the stop (no traceback). The duty waited until the
    leadership's end, past stop()'s 10 s wait for the thread, which stayed alive (a CI
    run's resignation test met it)."""
    app, lock, enqueue = _app_with_a_file_to_lock(tmp_path, lease=60)
    caplog.set_level(logging.INFO, logger="errands.maintenance")
    leader = Maintenance(app, "w-stopping-duty", tick=10)
    assert leader.ttl == 50
    locked, free = threading.Event(), threading.Event()
    rescue = leader.rescue

    def rescue_on_a_locked_file() -> int:
        if locked.is_set():
            return rescue()
        let_go = lock()
        locked.set()
        threading.Thread(target=lambda: (free.wait(), let_go())).start()
        enqueue()  # a write: waits for the lock the holder has
        return 0

    leader.rescue = rescue_on_a_locked_file  # type: ignore[method-assign]
    leader.start()
    try:
        wait_until(locked.is_set, timeout=60, what="the duty to meet the locked file")
        leader.stop()  # waits up to 10 s for the thread
        assert not leader._thread.is_alive()
        assert "maintenance rescue ended by the stop" in caplog.text
        assert "maintenance rescue failed" not in caplog.text
    finally:
        free.set()
        leader.stop()
        app.close()


def test_a_leader_renews_before_a_duty_once_less_than_two_thirds_of_its_leadership_is_left(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Elections answer slowly (0.8 s of a 2 s leadership) and the rescue takes 0.5 s:
    before each duty the leader asks again once less than two thirds of the leadership
    is left (counted from when the election was sent: the leadership's end bounds the
    duty's waits for the store), so the next duty may wait 1.2 s, not the 0.7 s left of
    the last one. Counted from the election's answer, nothing was renewed, and after an
    election slower still the duties had next to no time (0.05 s) to wait for a busy
    store (a cold review)."""
    from errands.backends.base import connection_wait

    app = errands.App(f"sqlite:///{tmp_path}/renew.db", lease=2)
    app.migrate()
    leader = Maintenance(app, "w-slow-election", tick=0.05)
    assert leader.ttl == 2
    elect = app.backend.leader_attempt_elect

    def slow_election(*args: Any, **kwargs: Any) -> bool:
        time.sleep(0.8)
        return elect(*args, **kwargs)

    waits: dict[str, float] = {}

    def slow_rescue() -> int:
        waits["rescue"] = connection_wait(60.0)
        time.sleep(0.5)
        return 0

    def expire_waits() -> int:
        waits["signal timeouts"] = connection_wait(60.0)
        return 0

    monkeypatch.setattr(app.backend, "leader_attempt_elect", slow_election)
    leader.rescue = slow_rescue  # type: ignore[method-assign]
    leader.expire_waits = expire_waits  # type: ignore[method-assign]
    try:
        leader.run_once()
        assert leader.is_leader
        assert waits["signal timeouts"] > 0.95, waits  # renewed: 1.2 s; not renewed: 0.7 s
    finally:
        leader.stop()
        app.close()


def test_a_leader_whose_duty_waits_for_a_postgres_lock_steps_down_once_its_leadership_runs_out(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Given a leader on PostgreSQL one of whose duties meets a lock another session
    holds (as the rescue began, that session took errands_jobs IN ACCESS EXCLUSIVE MODE,
    as an operator's LOCK TABLE or a migration's DDL does, and the leadership's row FOR
    UPDATE), then the rescue's statement gives up waiting at the leadership's end (its
    lock_timeout: DatabaseBusy, logged as the duty's failure), the next election finds
    the leadership's row still held, and the leader steps down (resigned once, never
    before its leadership ran out); once the locks are let go it is elected anew. The
    statement waited on the server for as long as the lock was held, the leader never
    asking again nor stepping down, its errands_leader gauge 1 beside the next leader."""
    import psycopg

    app = errands.App(pg_url, lease=2)
    app.migrate()
    backend: Any = app.backend

    def lock() -> Callable[[], None]:
        holder = psycopg.connect(backend.config.conninfo)  # a transaction: BEGIN
        holder.execute(f'LOCK TABLE "{backend.schema}".errands_jobs IN ACCESS EXCLUSIVE MODE')
        holder.execute(
            f'SELECT name FROM "{backend.schema}".errands_leaders WHERE name = %s FOR UPDATE',
            (LEADER_NAME,),
        )
        return lambda: (holder.rollback(), holder.close())

    def read(rescue: Callable[[], int]) -> int:
        return rescue()  # its read of the expired leases waits for the table's lock

    _duty_meets_a_lock(app, lock, read, caplog)
    assert "locked for longer than" in caplog.text


def test_a_stopping_worker_gives_up_a_resignation_that_gets_no_answer(
    each_store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Given a worker that leads the maintenance and a store that stops answering the
    resignation (another session holds the lock it needs: no error, no reply), then the
    worker's stop gives the resignation up after a short bound, says so once, and
    returns, its maintenance thread ended (the leadership runs out by its ttl). The
    resignation waited without a bound (PostgreSQL: for as long as the lock is held, or
    the TCP timeouts on a partition; SQLite: its write_timeout, here 600 s) and held the
    maintenance thread, the stop waiting for it."""
    from .helpers import WorkerThread

    url = each_store_url
    if url.startswith("sqlite"):  # the store's own wait for its write lock: the hang
        url += "?write_timeout=600"
    app = errands.App(url, lease=30)
    app.migrate()
    caplog.set_level(logging.WARNING, logger="errands.maintenance")
    # a long tick: the maintenance thread waits between two elections when it is told
    # to stop (so it resigns, rather than step down from an election that hangs)
    worker = WorkerThread(app, maintenance_tick=5).start()
    maintenance = worker.worker.maintenance
    assert maintenance is not None
    try:
        wait_until(lambda: maintenance.is_leader, timeout=60, what="the leadership")
        with _leaders_row_held(app):
            # the hang lasts for ever (PostgreSQL) or 600 s (SQLite); the stop's own
            # bounds add up to a few seconds
            worker.stop(timeout=120)
            assert not maintenance._thread.is_alive()
            assert not maintenance.is_leader
            logged = [r.getMessage() for r in caplog.records]
            gave_up = [m for m in logged if "could not resign" in m]
            assert len(gave_up) == 1, gave_up
            # PostgreSQL: the helper's bound; SQLite: its wait for the write lock, bounded
            # by the caller's deadline as well (errands.backends.base.calls_until)
            assert "no answer" in gave_up[0] or "locked for" in gave_up[0], gave_up
    finally:
        if worker.thread.is_alive():
            worker.worker.stop()
        app.close()
