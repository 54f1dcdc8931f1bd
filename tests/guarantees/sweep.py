"""The store-fault sweep's harness: a small workload on one App behind a
:class:`~.faults.FaultyStore`, a worker that runs it under faults, one that drains what is
left, and the checks in SQL (see test_store_fault_sweep for what they prove).

The workload: plain jobs (one with an idempotency key), a limited queue, jobs with a
concurrency key, a transactional handler that fails twice after writing, a ``ctx.step``,
a job failing once then succeeding, one failing for good (its ``on_dead`` hook reads it),
a job reading a signal sent before its wait, one whose first wait times out,
a periodic job, a job whose worker died (rescued), and a held job still running when the
worker stops (released).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from typing import Any

import errands
from tests.integration.helpers import WorkerThread, claim_as_dead_worker

from .faults import Fault, FaultyStore, job_ids
from .helpers import adapt, execute, expire_lease, query, wait_until

LEASE = 1.5
RETRIES = 20  # faults charge attempts: never run out of them here
BACKOFF = 0.05
DEADLINE = 60.0  # seconds to wait for any condition: generous for a loaded 2-core machine
GRACE = 0.1  # the held job is still running then: it is released
QUEUES = ["default", "limited", "keyed", "lost", "parked"]  # "parked" is paused at first
TERMINAL = ("completed", "dead", "cancelled")
LOSSES = ("worker_lost", "poison")  # a rescue's record: an attempt charged without a run


class Sweep:
    """One App on a fresh store, the workload enqueued, the backend behind a FaultyStore;
    worker A runs the workload under the faults, worker B drains what is left."""

    def __init__(self, url: str) -> None:
        app = self.app = errands.App(url, lease=LEASE, poison_after=10)
        app.queue("limited", limit=1)
        self.runs: list[tuple[int, int]] = []  # (job id, attempt) of every handler run
        self.charged: Counter[int] = Counter()  # the step's effect, per job
        self.hooked: list[int] = []  # jobs the on_dead hook saw
        self.hold = threading.Event()  # while set, the held job runs until stopped
        self.hold.set()
        self._define()
        app.migrate()
        app.pause("parked")  # a due job waits there for the leader's promotion
        execute(app, "CREATE TABLE errands_sweep_effects (job_id integer)")
        self._insert_effect = adapt(app, "INSERT INTO errands_sweep_effects (job_id) VALUES (?)")
        self._enqueue()
        self.store = FaultyStore.install(app, spare=threading.current_thread())
        self.a: WorkerThread | None = None

    # -- the workload ----------------------------------------------------------------------
    def _ran(self, ctx: errands.Context) -> None:
        self.runs.append((ctx.job_id, ctx.attempt))

    def _define(self) -> None:
        app, options = self.app, {"retries": RETRIES, "backoff": BACKOFF}

        @app.job(name="sweep.plain", **options)
        def plain(ctx: errands.Context, n: int) -> int:
            self._ran(ctx)
            return n

        @app.job(name="sweep.limited", queue="limited", **options)
        def limited(ctx: errands.Context, n: int) -> int:
            self._ran(ctx)
            return n

        @app.job(
            name="sweep.keyed",
            queue="keyed",
            concurrency_key="account:{account}",
            concurrency_limit=1,
            **options,
        )
        def keyed(ctx: errands.Context, account: int) -> None:
            self._ran(ctx)

        @app.job(name="sweep.tx", **options)
        def transactional(ctx: errands.Context) -> None:
            self._ran(ctx)
            ctx.transaction().execute(self._insert_effect, (ctx.job_id,))
            if ctx.attempt <= 2:  # each failure rolls the write back (tx_rollback)
                raise RuntimeError(f"attempt {ctx.attempt} fails after writing")

        @app.job(name="sweep.step", **options)
        def step(ctx: errands.Context) -> None:
            self._ran(ctx)
            ctx.step("charge", self.charged.update, [ctx.job_id])

        @app.job(name="sweep.flaky", **options)
        def flaky(ctx: errands.Context) -> None:
            self._ran(ctx)
            if ctx.attempt == 1:
                raise RuntimeError("the first attempt fails")

        @app.job(name="sweep.permanent", **options)
        def permanent(ctx: errands.Context) -> None:
            self._ran(ctx)
            raise errands.Permanent("this job dies at once (its on_dead hook reads it)")

        @app.job(name="sweep.held", **options)
        def held(ctx: errands.Context) -> None:
            self._ran(ctx)
            # Rescued (its lease lost to failing heartbeats), it runs as a suspect, alone in
            # an embedded worker: held, it would keep every other rescued job waiting.
            sql = "SELECT rescues FROM errands_jobs WHERE id = ?"
            rescued = query(app, sql, (ctx.job_id,))[0][0]
            while self.hold.is_set() and not rescued and not ctx.cancelled:
                time.sleep(0.01)

        @app.periodic("* * * * *", name="sweep.cron", **options)
        def cron(ctx: errands.Context) -> None:
            self._ran(ctx)

        @app.job(name="sweep.signal", **options)
        def signalled(ctx: errands.Context) -> int:
            self._ran(ctx)  # its signal was sent before the wait: read at once (signal_get)
            payload = ctx.wait_for_signal("go", timeout=DEADLINE)
            return int(payload["n"])

        @app.job(name="sweep.expires", **options)
        def expires(ctx: errands.Context) -> None:
            self._ran(ctx)  # the first wait times out (the leader's job_expire_waits)
            if ctx.attempt == 1:
                ctx.wait_for_signal("never", timeout=0.1)

        @app.job(name="sweep.after", **options)
        def after(ctx: errands.Context) -> int:
            self._ran(ctx)  # a workflow member: reads its parent's result
            return sum(p.result for p in ctx.parent_results())

        @app.job(name="sweep.parked", queue="parked", **options)
        def parked(ctx: errands.Context) -> None:
            self._ran(ctx)

        app.on_dead(lambda job: self.hooked.append(job.id))
        self.jobs = {d.name: d for d in app.registry.values()}

    def _enqueue(self) -> None:
        jobs = self.jobs
        for n in range(3):
            jobs["sweep.plain"].enqueue(n=n)
        jobs["sweep.plain"].enqueue(n=3, key="sweep:idempotent")
        for n in range(2):
            jobs["sweep.limited"].enqueue(n=n)
            jobs["sweep.keyed"].enqueue(account=1)
            jobs["sweep.tx"].enqueue()
        for name in ("sweep.step", "sweep.flaky", "sweep.permanent", "sweep.expires"):
            jobs[name].enqueue()
        self.app.signal(jobs["sweep.signal"].enqueue().id, "go", {"n": 1})
        workflow = errands.Workflow("sweep")  # its fan-in runs in job_finish_many
        first = workflow.add(jobs["sweep.plain"].bind(n=20))
        workflow.add(jobs["sweep.after"].bind(), after=[first])
        self.app.enqueue_workflow(workflow)
        self.held = jobs["sweep.held"].enqueue().id
        # A job whose worker died (its lease runs out at once), and one held for the check
        # that the leader still rescues after the faults heal.
        self.rescued = jobs["sweep.plain"].enqueue(n=10, queue="lost").id
        claim_as_dead_worker(self.app, self.rescued, lease=0.3)
        self.liveness = jobs["sweep.plain"].enqueue(n=11, queue="lost").id
        claim_as_dead_worker(self.app, self.liveness, lease=600)
        # The cron job's last slot two minutes ago: the first tick inserts the latest one.
        self._seed_cron()

    def _seed_cron(self) -> float:
        backend, slot = self.app.backend, self.app.backend.db_now() - 120
        execute(self.app, "DELETE FROM errands_cron WHERE name = ?", ("sweep.cron",))
        backend.cron_save("sweep.cron", "* * * * *", "UTC", slot, None, None)
        return slot

    # -- reading the store (raw SQL) ---------------------------------------------------------
    def rows(self) -> list[dict[str, Any]]:
        found = query(
            self.app,
            "SELECT id, name, state, attempt, errors, lease_owner, lease_token FROM errands_jobs",
        )
        keys = ("id", "name", "state", "attempt", "errors", "owner", "token")
        rows = [dict(zip(keys, r, strict=True)) for r in found]
        for row in rows:
            if isinstance(row["errors"], str):
                row["errors"] = json.loads(row["errors"])
        return rows

    def pending(self, *, but: tuple[int, ...] = ()) -> list[dict[str, Any]]:
        return [r for r in self.rows() if r["state"] not in TERMINAL and r["id"] not in but]

    def state(self, job_id: int) -> str:
        return str(query(self.app, "SELECT state FROM errands_jobs WHERE id = ?", (job_id,))[0][0])

    # -- the phases ----------------------------------------------------------------------------
    def start(self) -> Any:
        self.a = WorkerThread(self.app, queues=QUEUES, concurrency=4, grace=GRACE).start()
        return self.a.worker

    def run_workload(self) -> None:
        """Worker A runs every job of the workload but the held one (and the liveness one)."""
        wait_until(
            lambda: not self.pending(but=(self.held, self.liveness)),
            timeout=DEADLINE,
            what="every job of the workload terminal",
        )
        held_states = ("running", *TERMINAL)  # rescued, it runs to its end: see its handler
        wait_until(
            lambda: self.held in dict(self.runs) and self.state(self.held) in held_states,
            timeout=DEADLINE,
            what="the held job running",
        )

    def check_leader_after_healing(self) -> None:
        """The faults have healed: the leader rescues, promotes and schedules again."""
        assert self.a is not None
        maintenance = self.a.worker.maintenance
        assert maintenance is not None
        wait_until(lambda: maintenance.is_leader, timeout=DEADLINE, what="worker A leader")
        expire_lease(self.app, self.liveness)
        parked = self.jobs["sweep.parked"].enqueue(delay=0.1).id
        slot = self._seed_cron()
        wait_until(
            lambda: self.state(self.liveness) == "completed",
            timeout=DEADLINE,
            what="the dead worker's job rescued and run",
        )
        wait_until(
            lambda: self.state(parked) == "available", timeout=DEADLINE, what="a due job promoted"
        )
        self.app.resume("parked")
        wait_until(
            lambda: any(
                s.name == "sweep.cron" and (s.last_slot or 0) > slot
                for s in self.app.backend.cron_states()
            ),
            timeout=DEADLINE,
            what="the cron schedule moved on",
        )
        assert maintenance._thread.is_alive()

    def check_no_orphans(self) -> None:
        """No job runs under worker A's lease without a live attempt in worker A, unless a
        fault explains it (a claim whose reply was lost). A row just claimed may not have
        its attempt yet: only one still running under the same token a moment later,
        still unknown to the worker, is an orphan."""
        assert self.a is not None
        worker = self.a.worker
        explained = _claims_lost(self.store.faults)

        def unknown() -> set[tuple[int, str]]:
            running = {(r["id"], r["token"]) for r in self.rows()
                       if r["state"] == "running" and r["owner"] == worker.id
                       and r["id"] not in explained}  # fmt: skip
            return running - {(a.id, a.token) for a in worker.attempts()}

        suspects = unknown()
        if suspects:  # look again within the lease: an orphan is not rescued before then
            time.sleep(LEASE * 2 / 3)
            orphans = suspects & unknown()
            assert not orphans, f"running in the store, unknown to worker A: {orphans}"

    def stop(self) -> None:
        """Stop worker A (the held job is released); nothing stays running unless its
        release failed, or a claim whose reply was lost took it (the worker never knew
        it had it: its lease and the leader's rescue end it, as check_no_orphans allows;
        a claim made as the stop began, under the stop's faults, left one so)."""
        assert self.a is not None
        self.a.stop()
        failed = self.store.faulted("job_release_many")
        unreleased = job_ids(f for f in failed if f.kind == "request")
        lost = _claims_lost_leases(self.store.faults)  # the very claim: its token
        rows = self.rows()
        running = {r["id"] for r in rows if r["state"] == "running"
                   and r["id"] not in unreleased and (r["id"], r["token"]) not in lost}  # fmt: skip
        assert not running, (
            f"running after worker A stopped: {running}: {[r for r in rows if r['id'] in running]}"
        )

    def drain(self) -> None:
        """Worker B, without faults, runs what is left: every job ends terminal."""
        self.store.plan = None
        self.hold.clear()
        self.app.schedules.clear()  # no new cron slot while it drains
        if not self.pending():
            return
        worker = WorkerThread(self.app, queues=QUEUES, concurrency=4).start()
        try:
            wait_until(lambda: not self.pending(), timeout=DEADLINE, what="every job terminal")
        finally:
            worker.stop()
        assert not self.pending(), "a job became pending again after the drain"

    # -- the accounts ------------------------------------------------------------------------
    def check_accounts(self) -> None:
        rows = self.rows()
        runs = Counter(self.runs)
        faults = self.store.faults
        worker_a = self.a.worker.id if self.a is not None else None
        problems: list[str] = []
        for row in rows:
            job, errors = row["id"], row["errors"]
            expected = "dead" if row["name"] == "sweep.permanent" else "completed"
            if row["state"] != expected:
                problems.append(f"job {job} ({row['name']}) ended {row['state']}: {errors}")
            for n in range(1, row["attempt"] + 1):
                lost = [e for e in errors if e.get("attempt") == n and e.get("kind") in LOSSES]
                if not runs[(job, n)] and not lost:
                    problems.append(f"job {job}: attempt {n} charged without a run or a loss")
            kinds = [(e.get("attempt"), e.get("kind")) for e in errors]
            for (ran, n), times in runs.items():
                if ran == job and times > 1 + kinds.count((n, "released")):
                    problems.append(f"job {job}: attempt {n} ran {times} times: {errors}")
            for entry in errors:
                mine = entry.get("kind") in LOSSES and entry.get("worker") == worker_a
                if mine and job not in _lost_track(faults):
                    problems.append(
                        f"job {job}: rescued from the live worker A (left running with no "
                        f"live attempt, no fault explains it): {entry['message']}"
                    )
        assert not problems, "\n".join(problems)

    def check_effects(self) -> None:
        rows = self.rows()
        effects = Counter(
            job for (job,) in query(self.app, "SELECT job_id FROM errands_sweep_effects")
        )
        for row in rows:
            if row["name"] == "sweep.tx":
                assert effects[row["id"]] == 1, f"job {row['id']}: {effects[row['id']]} effects"
        unstored = Counter(
            job
            for f in self.store.faulted("step_store")
            if f.kind == "request"
            for job in job_ids([f])
        )
        for row in rows:
            if row["name"] == "sweep.step":
                job = row["id"]
                assert 1 <= self.charged[job] <= 1 + unstored[job], (
                    f"job {job}: the step's effect ran {self.charged[job]} times, "
                    f"{unstored[job]} of its results lost before they were stored"
                )
        dead = {r["id"] for r in rows if r["state"] == "dead"}
        assert dead <= set(self.hooked), f"dead jobs whose on_dead hook never ran: {dead}"

    def close(self) -> None:
        self.hold.clear()
        self.store.plan = None
        if self.a is not None and self.a.thread.is_alive():
            self.a.stop()
        self.app.close()


def _claims_lost_leases(faults: list[Fault]) -> set[tuple[int, str | None]]:
    """(job id, lease token) of each row a claim whose reply was lost took."""
    claims = ("job_claim", "job_claim_limited")
    return {
        (row.id, row.lease_token)
        for f in faults
        if f.method in claims and f.kind == "reply"
        for row in f.lost
    }


def _claims_lost(faults: list[Fault]) -> set[int]:
    """Jobs claimed by a call whose reply was lost: running under worker A's lease, unknown
    to it, until the leader rescues them."""
    return {job_id for job_id, _ in _claims_lost_leases(faults)}


def _lost_track(faults: list[Fault]) -> set[int]:
    """Jobs a fault may have made worker A lose (the leader then rescued them): a claim
    whose reply was lost, a release that failed, heartbeats that failed while they ran
    (their leases ran out)."""
    renewals = ("job_release_many", "job_heartbeat_many")
    return _claims_lost(faults) | job_ids(f for f in faults if f.method in renewals)


def run_through(sweep: Sweep, *, stopping: Any = None, release: bool = True) -> None:
    """The workload (under the faults armed), the checks after they heal, the stop (under
    ``stopping``'s faults; with ``release``, the held job is still running and released),
    the drain and the accounts."""
    sweep.run_workload()
    sweep.store.plan = None
    sweep.check_leader_after_healing()
    sweep.check_no_orphans()
    if not release:
        sweep.hold.clear()
        wait_until(lambda: not sweep.pending(), timeout=DEADLINE, what="worker A done")
    sweep.store.plan = stopping
    sweep.stop()
    sweep.drain()
    sweep.check_accounts()
    sweep.check_effects()
