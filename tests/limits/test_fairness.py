"""Fair queues with real workers: ``app.queue("reports", fair=True)`` and
``@app.job(fair_key="tenant:{tenant_id}")``, on both backends.

A tenant that dumps a backlog first does not hold back the tenants behind it, and a tenant
whose jobs take longer does not get more of the workers' time for it.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from click.testing import CliRunner

import errands
from errands.cli.main import cli
from errands.maintenance import Maintenance, service

from .helpers import LimitsCluster, run_cli, wait_until, workers

NOISY = 120
QUIET = 5


def _starts(store: errands.App, *, fair: bool) -> list[str]:
    """Run a noisy tenant's backlog, enqueued first, and one job of each of QUIET quiet
    tenants enqueued after it; the tenants in the order their jobs started."""
    queue = "reports" if fair else "fifo"
    if fair:
        store.queue(queue, fair=True)
    else:
        store.queue(queue, limit=1000)  # a limited (counting) queue, without fairness
    started: list[str] = []
    lock = threading.Lock()

    @store.job(name=f"{queue}.build", queue=queue, fair_key="tenant:{tenant}")
    def build(tenant: str, n: int) -> None:
        with lock:
            started.append(tenant)
        time.sleep(0.005)

    store.enqueue_many([build.bind(tenant="noisy", n=i) for i in range(NOISY)])
    store.enqueue_many([build.bind(tenant=f"quiet{i}", n=0) for i in range(QUIET)])
    with workers([store], concurrency=4):
        wait_until(lambda: len(started) == NOISY + QUIET, 120, "every job started")
    return started


def test_quiet_tenants_start_before_a_backlog_enqueued_ahead_of_them_drains(
    store: errands.App,
) -> None:
    """120 jobs of a noisy tenant, then one job of each of 5 quiet tenants, on 4 slots:
    in a fair queue every quiet job starts within the first claim rounds (the bound is
    ceil(6 keys / 4 slots) + 1 = 3 rounds, at most 12 starts; 20 are allowed for rounds
    that free one slot at a time); in a queue without fairness they start last."""
    fair = _starts(store, fair=True)
    last_quiet = max(i for i, tenant in enumerate(fair) if tenant != "noisy")
    assert last_quiet < 20, fair[:30]
    fifo = _starts(store, fair=False)
    assert min(i for i, tenant in enumerate(fifo) if tenant != "noisy") >= NOISY - 8


def test_a_tenant_with_slower_jobs_gets_no_more_than_its_share_of_worker_time(
    store: errands.App,
) -> None:
    """Two backlogged tenants on 2 slots; one's jobs take 10x longer. Counting jobs (one
    each per round) would give it 10/11 of the worker time; fair claiming weighs worker
    time, so once it is a quantum over its half it waits and the other catches up."""
    store.queue("mixed", fair=True)
    busy: dict[str, float] = {"slow": 0.0, "fast": 0.0}
    lock = threading.Lock()

    @store.job(name="mixed.work", queue="mixed", fair_key="{tenant}")
    def work(tenant: str, n: int) -> None:
        t0 = time.monotonic()
        time.sleep(0.4 if tenant == "slow" else 0.04)
        with lock:
            busy[tenant] += time.monotonic() - t0

    store.enqueue_many([work.bind(tenant="slow", n=i) for i in range(100)])
    store.enqueue_many([work.bind(tenant="fast", n=i) for i in range(1000)])
    with workers([store], concurrency=2):
        wait_until(lambda: busy["slow"] + busy["fast"] >= 12.0, 120, "12 s of worker time")
    share = busy["slow"] / (busy["slow"] + busy["fast"])
    assert share < 0.8, busy  # by job count it would be 0.91
    figures = {f.key: f for f in store.backend.fair_figures("mixed")}
    assert set(figures) == {"slow", "fast"}


def test_queues_show_lists_each_keys_worker_time_share_and_dwell_and_weight_sets_it(
    store: errands.App,
) -> None:
    """`errands queues weight` stores an audited weight; `errands queues show Q --json`
    gives per-key figures, the top keys one by one and the rest as "other"."""
    store.queue("reports", fair=True, aging=30)

    @store.job(name="reports.build", queue="reports", fair_key="tenant:{tenant}")
    def build(tenant: int, n: int) -> None:
        time.sleep(0.01)

    handles = store.enqueue_many([build.bind(tenant=n % 6, n=n) for n in range(24)])
    weighted = run_cli("queues", "weight", "tenant:0", "5", "--url", store.url, "--actor", "ops")
    assert weighted.output == "fair key tenant:0: weight 5\n"
    with workers([store], concurrency=3):
        for handle in handles:
            handle.result(timeout=60)
    shown = run_cli("queues", "show", "reports", "--url", store.url, "--json", "--top", "3")
    data = json.loads(shown.output)
    assert (data["fair"], data["aging"]) == (True, 30.0)
    keys = data["keys"]
    assert [k["keys"] for k in keys] == [1, 1, 1, 3] and keys[-1]["key"] == "other"
    assert sum(k["attempts"] for k in keys) == 24
    assert all(k["mean_dwell_seconds"] is not None and k["due"] == 0 for k in keys)
    assert sum(k["share"] for k in keys) == pytest.approx(1.0, abs=0.01)
    weights = {k["key"]: k["weight"] for k in keys}
    assert weights.get("tenant:0", 5.0) == 5.0
    table = run_cli("queues", "show", "reports", "--url", store.url).output
    assert table.startswith("queue reports: active, fair, aging 30s\n") and "tenant:" in table
    refused = CliRunner().invoke(cli, ["queues", "weight", "tenant:0", "0", "--url", store.url])
    assert refused.exit_code != 0 and "weight must be a number above 0" in refused.output


def test_queues_show_gives_the_weights_of_the_apps_callable_and_a_stored_one_wins(
    store: errands.App,
) -> None:
    """Keys without a stored weight show what ``app.fair_weight(fn)`` answers (marked
    "code"); a stored weight wins ("stored"); a key the callable fails for shows 1, as its
    claims use it."""
    store.queue("reports", fair=True)

    @store.fair_weight
    def weight(key: str) -> float:
        if key == "tenant:2":
            raise LookupError("no such plan")
        return 3.0

    @store.job(name="reports.build", queue="reports", fair_key="tenant:{tenant}")
    def build(tenant: int) -> None:
        pass

    handles = store.enqueue_many([build.bind(tenant=n) for n in range(3)])
    store.fair_weight("tenant:1", 7, actor="ops")
    with workers([store], concurrency=2):
        for handle in handles:
            handle.result(timeout=60)
    figures = {f.key: (f.weight, f.weight_source) for f in store.fair_figures("reports")}
    assert figures == {
        "tenant:0": (3.0, "code"),
        "tenant:1": (7.0, "stored"),
        "tenant:2": (1.0, "code"),
    }


def test_a_fair_queue_without_a_limit_claims_for_the_prefetch_room_and_a_capped_one_does_not(
    store: errands.App,
) -> None:
    """A fair claim reads every backlogged key, so with many keys and quick jobs a batch
    spreads its cost: a fair queue declared without a limit or rate fills the prefetch
    room like a plain queue; one with a cluster-wide limit claims for free slots only."""
    from errands.backends.base import QueueClaim
    from errands.worker.claiming import Claimer

    store.queue("open", fair=True)
    store.queue("capped", fair=True, limit=50)
    for queue in ("open", "capped"):
        store.backend.queue_declare(store.queues[queue], "test")

        @store.job(name=f"{queue}.job", queue=queue, fair_key="{tenant}")
        def job(tenant: str, n: int) -> None: ...

        store.enqueue_many([job.bind(tenant=f"t{n % 4}", n=n) for n in range(20)])
    claimer = Claimer(store, "w-test", ["open", "capped"], 1.0)
    opened = claimer.claim([QueueClaim("open", 20)], room=6, free=2, suspects=0)
    capped = claimer.claim([QueueClaim("capped", 20)], room=6, free=2, suspects=0)
    assert (opened.error, capped.error) == (None, None)
    assert (len(opened.rows), len(capped.rows)) == (6, 2)
    assert len({r.fair_key for r in opened.rows}) == 4  # still spread over the keys


def test_a_fair_queues_claim_takes_no_more_than_its_fair_room_whatever_the_prefetch(
    store: errands.App,
) -> None:
    """Its window of keys, read under the queue's claim lock, grows with its room: a
    worker's large --prefetch does not make each fair claim read thousands of keys."""
    from errands.backends.base import QueueClaim
    from errands.worker.claiming import Claimer

    store.queue("open", fair=True)
    store.backend.queue_declare(store.queues["open"], "test")

    @store.job(name="open.job", queue="open", fair_key="{tenant}")
    def job(tenant: str, n: int) -> None: ...

    store.enqueue_many([job.bind(tenant=f"t{n % 40}", n=n) for n in range(200)])
    claimer = Claimer(store, "w-test", ["open"], 1.0, fair_room=15)
    claimed = claimer.claim([QueueClaim("open", 200)], room=120, free=3, suspects=0)
    assert claimed.error is None and len(claimed.rows) == 15


LOST = {"attempt": 1, "type": "LeaseExpired", "message": "lost", "traceback": None}


def _rescued(store: errands.App, rows: list[Any]) -> None:
    """Rescue ``rows`` (claimed with a lease of 0.05 s) once their leases expired."""
    from errands.backends.base import RescueParams

    rescues = [RescueParams(r.id, r.lease_token or "", "retryable", LOST, 0.0) for r in rows]
    wait_until(
        lambda: store.backend.job_rescue_many(rescues) == [True] * len(rows),
        10,
        "the lost leases rescued",
    )


def _tenants_with_rescued_jobs(store: errands.App, *, busy_rescued: bool) -> dict[str, int]:
    """A fair queue "tenants": "busy" (30 s of worker time), "noisy" (none: behind its
    share, it ranks first), "quiet" (2 s: behind its share too, it ranks second), each
    with jobs due; "quiet" (and "busy", ranked third, when ``busy_rescued``) with a
    rescued job. The rescued jobs' ids by tenant."""
    from errands.backends.base import FinishParams, QueueClaim

    store.queue("tenants", fair=True)
    store.backend.queue_declare(store.queues["tenants"], "test")

    @store.job(name="tenants.job", queue="tenants", fair_key="{tenant}")
    def job(tenant: str, n: int) -> None: ...

    # a rescued job comes after its key's fresh ones: "busy" keeps only its rescued one
    # (and "noisy" one job, which ranks first: more would take the turns after it too)
    counts = (
        {"busy": 2, "noisy": 3, "quiet": 2}
        if busy_rescued
        else {"busy": 10, "noisy": 30, "quiet": 2}
    )
    store.enqueue_many([job.bind(tenant=t, n=n) for t, c in counts.items() for n in range(c)])
    backend = store.backend
    first = backend.job_claim_limited(QueueClaim("tenants", 3), "w-old", 30.0)
    ran = {"busy": 30.0, "noisy": 0.0, "quiet": 2.0}
    done = [
        FinishParams(r.id, r.lease_token or "", "completed", fair=True, ran=ran[str(r.fair_key)])
        for r in first
    ]
    assert sorted(str(r.fair_key) for r in first) == ["busy", "noisy", "quiet"]
    assert backend.job_finish_many(done) == [True] * 3
    second = {
        str(r.fair_key): r
        for r in backend.job_claim_limited(QueueClaim("tenants", 3), "w-old", 0.05)
    }
    assert sorted(second) == ["busy", "noisy", "quiet"]
    lost = ["quiet", "busy"] if busy_rescued else ["quiet"]
    done = [
        FinishParams(r.id, r.lease_token or "", "completed", fair=True, ran=ran[key])
        for key, r in second.items()
        if key not in lost
    ]
    assert backend.job_finish_many(done) == [True] * len(done)
    _rescued(store, [second[key] for key in lost])
    return {key: second[key].id for key in lost}


def test_a_workers_suspect_claim_ranks_a_fair_queue_over_the_rounds_room(
    store: errands.App,
) -> None:
    """A worker whose suspects are not isolated claims one rescued job a round, first.
    "noisy" is behind its share (it ranks first), "quiet" has a rescued job (it ranks
    second): the round (room 3: one slot free, two jobs' prefetch, which a fair queue
    without a limit claims for) starts the rescued job, as it would a fresh "quiet" job.
    Its suspect claim ranked over one turn took nothing while "noisy" stayed behind its
    share, and the fresh claim leaves rescued jobs out."""
    from errands.backends.base import QueueClaim
    from errands.worker.claiming import Claimer

    rescued = _tenants_with_rescued_jobs(store, busy_rescued=False)
    claimer = Claimer(store, "w-test", ["tenants"], 1.0)
    claimed = claimer.claim([QueueClaim("tenants", 3)], room=3, free=1, suspects=1)
    assert claimed.error is None
    assert [r.id for r in claimed.rows if r.rescues] == [rescued["quiet"]]
    assert claimed.rows[0].id == rescued["quiet"]  # rescued jobs first in the round
    assert sorted(str(r.fair_key) for r in claimed.rows[1:]) == ["busy", "noisy"]


def test_a_suspect_claim_ranks_only_the_turns_left_after_the_rounds_earlier_suspects(
    store: errands.App,
) -> None:
    """A worker with three suspect lanes, room 3, plan [plainq, tenants]: plainq's
    rescued job takes one turn; the fair queue's suspect claim then ranks the two turns
    left ("noisy", "quiet") and takes "quiet"'s rescued job, not "busy"'s (ranked
    third), so "noisy", ranked first, gets the round's last slot. Ranked over the whole
    room, it took both rescued jobs and "noisy" got nothing."""
    from errands.backends.base import ClaimParams, QueueClaim
    from errands.worker.claiming import Claimer

    rescued = _tenants_with_rescued_jobs(store, busy_rescued=True)

    @store.job(name="plainq.job", queue="plainq")
    def plain(n: int) -> None: ...

    plain.enqueue(n=1)
    lost = store.backend.job_claim(ClaimParams([QueueClaim("plainq", 1)], 1, "w-old", 0.05))
    _rescued(store, lost)
    claimer = Claimer(store, "w-test", ["plainq", "tenants"], 1.0)
    plan = [QueueClaim("plainq", 3), QueueClaim("tenants", 3)]
    claimed = claimer.claim(plan, room=3, free=3, suspects=3)
    assert claimed.error is None
    assert sorted(r.id for r in claimed.rows if r.rescues) == sorted([lost[0].id, rescued["quiet"]])
    assert [str(r.fair_key) for r in claimed.rows if not r.rescues] == ["noisy"]


def _quiet_behind_full_slots(
    store: errands.App, express: int, cap: int | None = None, limit: int | None = None
) -> tuple[int | None, int]:
    """Two slots busy with a noisy tenant's jobs, which wait (up to 30 s) for the quiet
    tenant's job to start; then one quiet job. How many noisy jobs ran when the quiet
    one started (None: it never started while they waited), and the most noisy jobs
    seen running at once. ``cap``: the queue's per-worker cap (``-q lane=2``), with two
    more slots beyond it; ``limit``: a cluster-wide limit (its claims take free slots
    only). Once everything ran, the worker's slots and lane are all free."""
    queue = f"lane{express}{cap or ''}{limit or ''}"
    store.queue(queue, fair=True, limit=limit)
    quiet_started = threading.Event()
    lock = threading.Lock()
    running = {"noisy": 0, "most": 0, "ended": 0}
    seen: list[int | None] = [None]

    @store.job(name=f"{queue}.work", queue=queue, fair_key="tenant:{tenant}")
    def work(tenant: str, n: int) -> None:
        if tenant == "quiet":
            with lock:
                seen[0] = running["noisy"]
                running["ended"] += 1
            quiet_started.set()
            return
        with lock:
            running["noisy"] += 1
            running["most"] = max(running["most"], running["noisy"])
        try:
            quiet_started.wait(30)
        finally:
            with lock:
                running["noisy"] -= 1
                running["ended"] += 1

    store.enqueue_many([work.bind(tenant="noisy", n=n) for n in range(6)])
    queues = {queue: cap} if cap else [queue]
    slots = 4 if cap else 2
    with workers([store], concurrency=slots, express=express, queues=queues) as [worker]:
        wait_until(lambda: running["noisy"] == 2, 30, "both slots busy with the backlog")
        work.enqueue(tenant="quiet", n=0)
        if express and not cap:
            wait_until(quiet_started.is_set, 30, "the quiet job started")
        else:
            quiet_started.wait(1.0)  # a moment for a start that must not come
        started_beside = seen[0]
        quiet_started.set()  # let the backlog go
        wait_until(lambda: running["ended"] == 7, 60, "every job ran")
        wait_until(
            lambda: (worker._free, worker._express_free) == (slots, express),
            10,
            "every slot and lane thread given back",
        )
    return started_beside, running["most"]


def test_a_quiet_tenants_job_starts_on_the_express_lane_while_a_backlog_fills_every_slot(
    store: errands.App,
) -> None:
    """Every slot runs the noisy tenant's jobs; the quiet tenant, with nothing running,
    starts on the worker's express lane at once instead of waiting for a slot. The
    lane never runs the backlog's key (it has jobs running): never more than the
    slots' two noisy jobs at once."""
    assert _quiet_behind_full_slots(store, express=1) == (2, 2)


def test_a_quiet_tenants_rescued_job_starts_on_the_express_lane_too(store: errands.App) -> None:
    """The quiet tenant's job was claimed by a worker that died (a lease of 0.05 s, never
    renewed); the backlog fills both slots of a live worker with a lane. Once rescued,
    the quiet job is its key's next job, with nothing of the key running: it starts on
    the lane while both slots still run the backlog, as a fresh one would. Before, a
    rescued job never took the lane and waited for a slot: here, for the backlog's 30 s."""
    from errands.backends.base import QueueClaim

    queue = "lane_rescued"
    store.queue(queue, fair=True)
    store.backend.queue_declare(store.queues[queue], "test")
    started = threading.Event()
    lock = threading.Lock()
    noisy = {"running": 0, "beside": -1}

    @store.job(name=f"{queue}.work", queue=queue, fair_key="tenant:{tenant}")
    def work(tenant: str, n: int) -> None:
        if tenant == "quiet":
            with lock:
                noisy["beside"] = noisy["running"]
            started.set()
            return
        with lock:
            noisy["running"] += 1
        try:
            started.wait(30)
        finally:
            with lock:
                noisy["running"] -= 1

    work.enqueue(tenant="quiet", n=0)
    [lost] = store.backend.job_claim_limited(QueueClaim(queue, 1), "w-dead", 0.05)
    store.enqueue_many([work.bind(tenant="noisy", n=n) for n in range(6)])
    with workers([store], concurrency=2, express=1, queues=[queue]):
        wait_until(started.is_set, 30, "the rescued quiet job started")
        beside = noisy["beside"]
        started.set()
    assert beside == 2, "the rescued job waited for a slot"
    row = store.backend.job_get(lost.id)
    assert row is not None and row.rescues == 1 and row.state == "completed"


def test_a_worker_process_runs_a_rescued_job_on_its_lane_isolated_in_a_child(
    cluster: LimitsCluster,
) -> None:
    """`errands worker limits_app:app -c 2 --express 1` knows its app, so it runs rescued
    jobs in child processes. Its two slots run a noisy tenant's 10 s jobs; the quiet
    tenant's job, lost with a dead worker and rescued, starts on the lane (a lane thread
    waits for its child) while both noisy jobs still run, in another process."""
    from errands.backends.base import QueueClaim

    app = cluster.app("limits_app")
    work = app.registry["tenants.work"]
    app.backend.queue_declare(app.queues["tenants"], "test")
    quiet = work.enqueue(tenant="quiet", seconds=0.0)
    [lost] = app.backend.job_claim_limited(QueueClaim("tenants", 1), "w-dead", 0.05)
    assert lost.id == quiet.id
    app.enqueue_many([work.bind(tenant="noisy", seconds=10.0) for _ in range(4)])
    cluster.start_worker("-q", "tenants", "-c", "2", "--express", "1", app="limits_app:app")
    wait_until(
        lambda: app.get_job(quiet.id).state == "completed",
        9,
        "the rescued quiet job completed while the noisy jobs ran",
    )
    starts = cluster.query_effects("SELECT job_id, pid, at FROM effects WHERE kind = 'start'")
    pids = {job_id: pid for job_id, pid, _ in starts}
    at = {job_id: when for job_id, _, when in starts}
    noisy = [job_id for job_id in pids if job_id != quiet.id]
    assert len([n for n in noisy if at[n] < at[quiet.id]]) == 2, "both slots ran the noisy jobs"
    assert pids[quiet.id] not in {pids[n] for n in noisy}, "the rescued job ran isolated"
    assert app.get_job(quiet.id).rescues == 1


def test_without_an_express_lane_the_quiet_job_waits_for_a_slot(store: errands.App) -> None:
    assert _quiet_behind_full_slots(store, express=0) == (None, 2)


def test_the_express_lane_keeps_a_queues_per_worker_cap(store: errands.App) -> None:
    """``-q lane=2`` on a worker of 4 slots and a lane: the queue runs 2 jobs at most,
    the lane's included (it waits while the cap is reached, slots free or not)."""
    assert _quiet_behind_full_slots(store, express=1, cap=2) == (None, 2)


def test_the_express_lane_serves_a_fair_queue_with_a_cluster_wide_limit_too(
    store: errands.App,
) -> None:
    """A limited queue's claim takes free slots only (never the prefetch room), so with
    every slot busy only the lane's own claim can start the quiet job."""
    assert _quiet_behind_full_slots(store, express=1, limit=100) == (2, 2)


def test_a_fair_key_in_a_queue_without_fairness_is_stored_and_ignored(
    store: errands.App,
) -> None:
    """A job type's fair_key template in a queue that is not fair: the key is stored (for
    when the queue is made fair) and ignored: no worker time is folded for it, so its
    completions take the lean write of a plain queue. It was folded (a heavier write per
    batch and a usage row per key), though the docs said ignored."""

    @store.job(name="plainq.work", queue="plainq", fair_key="tenant:{tenant}")
    def work(tenant: str) -> str:
        return tenant

    handles = store.enqueue_many([work.bind(tenant=f"t{i}") for i in range(20)])
    with workers([store], concurrency=4):
        assert [h.result(timeout=30) for h in handles] == [f"t{i}" for i in range(20)]
    assert {store.backend.job_get(h.id).fair_key for h in handles} == {  # type: ignore[union-attr]
        f"tenant:t{i}" for i in range(20)
    }
    assert [f for f in store.backend.fair_figures("plainq") if f.attempts] == []


def test_a_fair_queue_with_a_rate_limited_job_type_claims_for_free_slots_only(
    store: errands.App,
) -> None:
    """A fair queue without a limit claims for the prefetch room too; one whose job types
    have a rate must not: a rate counts starts at the claim, and prefetched jobs start
    later, so two claims' batches could start closer together than the rate allows."""
    from errands.worker.claiming import Claimer

    store.queue("tenants", fair=True)
    store.queue("rated_tenants", fair=True)

    @store.job(name="t.work", queue="tenants", fair_key="{tenant}")
    def work(tenant: str) -> None: ...

    @store.job(name="t.rated", queue="rated_tenants", fair_key="{tenant}", rate="10/s")
    def rated(tenant: str) -> None: ...

    claimer = Claimer(store, "w-test", ["tenants", "rated_tenants"], poll_interval=1.0)
    assert claimer.prefetching == {"tenants"}


def test_the_leaders_prune_forgets_the_usage_of_keys_idle_past_the_retention(
    store: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queue fair by user keeps no row per user ever seen: once a key ended no attempt
    for the retention (and at least ten half-lives, when its usage is nothing) and has
    nothing running or pending, the maintenance leader's prune deletes its usage. A key
    with a job pending keeps its row."""
    store.queue("byuser", fair=True)

    @store.job(name="byuser.work", queue="byuser", fair_key="user:{user}")
    def work(user: str) -> str:
        return user

    handles = store.enqueue_many([work.bind(user=f"u{i}") for i in range(3)])
    with workers([store], concurrency=2):
        assert [h.result(timeout=30) for h in handles] == ["u0", "u1", "u2"]
    work.enqueue(user="u0", delay=3600)  # u0 comes back later: its row stays
    store.retention = 0.5
    time.sleep(1.0)
    assert Maintenance(store, "test").prune() == 3  # the finished jobs
    figures = {f.key: f.attempts for f in store.backend.fair_figures("byuser")}
    assert figures == {"user:u0": 1, "user:u1": 1, "user:u2": 1}  # not ten half-lives yet
    monkeypatch.setattr(service, "FAIR_FORGET_MIN", 0.5)
    Maintenance(store, "test").prune()
    figures = {f.key: f.attempts for f in store.backend.fair_figures("byuser")}
    assert figures == {"user:u0": 1}
