"""The invariant checker: RELIABILITY I1-I10 in SQL plus the soak's effects table.

Reads every job row, every ``soak_effects`` row, the charges and the orders once, after
the run has drained, and checks them against the generator's ledger and the chaos
driver's records. Each broken invariant adds a line to
``violations``; the figures feed the report.

Execution accounting (I4): an *execution* is one ``run`` row (a handler started), and
carries the lease token of its claim. Each is explained by what the store recorded under
that token: the handler's own failure (kinds ``transient``, ``timeout``, ``retry``,
``permanent``, ``cancelled``), a lost lease (``worker_lost`` or ``poison``: rescued from a
killed, frozen or cut-off worker; ``lease_lost``: the worker stopped the handler because
its lease was lost; ``released``: a graceful stop or self-fencing gave the job back;
``crash``: the child process running it died), or the completion (the result names its
token). A job's *duplicate executions* are its executions beyond the first that no
failure of its own explains; I4 holds when each is matched by a recorded loss. A release
gives its attempt back (the next run has the same number); a wait for a signal does too,
but a suspended run writes no row (``soak.signalled`` records after the wait). Every
attempt the store charged has a run or a recorded loss (a rescue of a job claimed but
never begun, a ``signal_timeout``).
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter, defaultdict
from datetime import UTC, datetime
from typing import Any

from soak_app import CRON_STEP

from . import shapes, tenants, workflows
from .chaos import Chaos
from .records import (
    LOSS_KINDS,
    TERMINAL,
    Findings,
    JobInfo,
    Run,
    brief,
    load_effects,
    load_jobs,
    percentile,
)
from .store import Store
from .workload import Ledger

COMPLETING_KINDS = {
    "fast", "delayed", "slow", "flaky", "pay", "tx", "order", "unique", "canary", "cron",
    "slow_return", "aslow", "tx_hold", "keyed", "plain", "uniq_retry", "bad_backoff", "signalled",
    "tenant", "tenant_noisy",
}  # fmt: skip
TX_JOBS = ("soak.tx", "soak.tx_hold")
LONG_JOBS = ("soak.slow", "soak.slow_return", "soak.aslow")


def check(
    store: Store,
    ledger: Ledger,
    chaos: Chaos,
    *,
    quiesced_at: float,
    lease: float,
    poll_interval: float,
    enforce_i9: bool = True,
) -> Findings:
    """``enforce_i9``: a recovery or rescued-job wait past the I9 bound is a violation
    (the full-size run); otherwise it is reported under observations (the CI-sized run:
    a timing bound must not fail a test on a loaded 2-core machine)."""
    out = Findings()
    jobs = load_jobs(store)
    runs = load_effects(store)
    by_job: dict[int, list[Run]] = defaultdict(list)
    for run in runs:
        by_job[run.job_id].append(run)
    cancelled_by_chaos = {c.job_id: c for c in chaos.cancels if c.state}

    _states(out, jobs, ledger, quiesced_at)
    _outcomes(out, jobs, ledger, cancelled_by_chaos)
    _executions(out, jobs, by_job)
    _effects_once(out, store, jobs, by_job)
    _attempts(out, jobs)
    _fencing(out, jobs, by_job)
    _time(out, jobs, runs, poll_interval)
    _uniqueness(out, store, ledger)
    _phantoms(out, store, jobs, ledger, by_job)
    _liveness(out, chaos, lease, poll_interval, enforce_i9)
    _rescues(out, jobs, by_job, chaos)
    _cancels(out, jobs, by_job, chaos)
    _self_fencing(out, jobs, by_job, chaos)
    _health(out, store)
    _latency(out, jobs, runs, chaos, 2 * (lease + poll_interval), enforce_i9)
    shapes.check(out, jobs, by_job, ledger, chaos)
    tenants.check(out, store, jobs, runs, enforce=enforce_i9)
    workflows.check(out, store, ledger.workflows, by_job)
    return out


# -- I1 no loss -----------------------------------------------------------------------------------
def _states(out: Findings, jobs: dict[int, JobInfo], ledger: Ledger, quiesced_at: float) -> None:
    states = Counter(j.state for j in jobs.values())
    out.figures["states"] = dict(states)
    out.figures["enqueued"] = len(ledger.jobs)
    out.figures["enqueued by kind"] = dict(Counter(ledger.jobs.values()))
    out.figures["cron jobs"] = sum(1 for j in jobs.values() if j.name == "soak.cron")
    missing = [i for i in ledger.jobs if i not in jobs]
    stuck = [
        j.id
        for j in jobs.values()
        if j.state not in TERMINAL and (j.id in ledger.jobs or j.inserted_at <= quiesced_at)
    ]
    out.figures["lost"] = len(missing) + len(stuck)
    if missing:
        out.fail("I1", f"{len(missing)} acknowledged job(s) missing from the store", missing)
    if stuck:
        detail = [(i, jobs[i].name, jobs[i].state) for i in stuck]
        out.fail("I1", f"{len(stuck)} job(s) not terminal after the drain", detail)


# What a job's own store calls raise while the database restarts or its session is cut.
STORE_AWAY = frozenset({
    "AdminShutdown", "OperationalError", "ConnectionTimeout", "PoolTimeout", "InterfaceError",
})  # fmt: skip


def _outcomes(
    out: Findings, jobs: dict[int, JobInfo], ledger: Ledger, cancelled: dict[int, Any]
) -> None:
    """Each kind ends where it must (the chaos may add lease losses, never change ends)."""
    wrong = []
    for job in jobs.values():
        kind = ledger.jobs.get(job.id) or ("cron" if job.name == "soak.cron" else None)
        if kind is None or job.state not in TERMINAL:
            continue
        if job.id in cancelled:
            ok = job.state in ("cancelled", "completed")
        elif kind in COMPLETING_KINDS:
            ok = job.state == "completed"
        elif kind == "doomed":
            last_kind = job.errors[-1].get("kind") if job.errors else None
            ok = job.state == "dead" and last_kind in ("permanent", "poison")
        elif kind == "exhaust":
            ok = job.state == "dead" and job.attempt == job.max_attempts
        elif kind == "hooked":
            ok = job.state == "dead" and bool(job.errors) and job.errors[-1].get("kind") in (
                "permanent", "poison",
            )  # fmt: skip
        elif kind == "signal_never":
            last = job.errors[-1] if job.errors else {}
            # a rescue of its short run before the wait may end it instead, and so may the
            # store going away under its wait's own reads (a transient failure, retried:
            # with 2 attempts, two database restarts can use them up)
            ok = job.state == "dead" and (
                last.get("kind") in ("signal_timeout", "worker_lost", "poison")
                or (last.get("kind") == "transient" and last.get("type") in STORE_AWAY)
            )
        else:
            ok = True
        if not ok:
            last = job.errors[-1] if job.errors else {}
            wrong.append((job.id, kind, job.state, job.attempt, last.get("type"), last.get("kind")))
    out.figures["unexpected outcomes"] = len(wrong)
    if wrong:
        out.fail("outcomes", f"{len(wrong)} job(s) ended in an unexpected state", wrong)


# -- I4 accounted duplicates ----------------------------------------------------------------------
def _executions(out: Findings, jobs: dict[int, JobInfo], by_job: dict[int, list[Run]]) -> None:
    executions = duplicates = explained = 0
    losses: Counter[str] = Counter()
    twice, unexplained_rows, no_run, tokens_reused, uncharged = [], [], [], [], []
    for job in jobs.values():
        starts = [r for r in by_job.get(job.id, []) if r.kind == "run"]
        executions += len(starts)
        ends: dict[str, list[str]] = defaultdict(list)  # lease token -> error kinds
        for e in job.errors:
            kind = str(e.get("kind"))
            if kind in LOSS_KINDS:
                losses[kind] += 1
            if e.get("lease_token"):
                ends[str(e["lease_token"])].append(kind)
        tokens = [r.token for r in starts if r.token]
        if len(tokens) != len(set(tokens)):
            tokens_reused.append(job.id)
        completing = _completing_token(job, starts, ends)
        if job.state == "completed" and (completing is None or tokens.count(completing) != 1):
            no_run.append((job.id, job.attempt, completing, sorted(r.attempt for r in starts)))
        counted = lost_runs = 0
        for r in starts:
            kinds = ends.get(r.token or "", [])
            if r.token is not None and r.token == completing:
                counted += 1
            elif any(k in LOSS_KINDS for k in kinds):
                counted += 1
                lost_runs += 1
            elif not kinds:
                unexplained_rows.append((job.id, r.attempt, job.state, brief(job.errors)))
        dup = max(0, counted - 1)
        duplicates += dup
        explained += min(dup, lost_runs)
        # An attempt number runs once, unless a release gave it back.
        per_attempt = Counter(r.attempt for r in starts)
        released: Counter[Any] = Counter()  # (one entry may count releases in a row)
        for e in job.errors:
            if e.get("kind") == "released":
                released[e.get("attempt")] += int(e.get("times") or 1)
        again = {n: k for n, k in per_attempt.items() if k > 1 + released[n]}
        if again:
            twice.append((job.id, again, brief(job.errors)))
        # Every attempt charged ran, or its loss is recorded (a rescue, a signal timeout).
        recorded = {e.get("attempt") for e in job.errors}
        bare = [n for n in range(1, job.attempt + 1) if n not in per_attempt and n not in recorded]
        if bare:
            uncharged.append((job.id, job.name, job.state, bare, brief(job.errors)))
    out.figures["executions"] = executions
    out.figures["duplicate executions"] = duplicates
    out.figures["duplicates explained by lease losses"] = explained
    out.figures["explained share"] = 1.0 if duplicates == 0 else explained / duplicates
    out.figures["lease losses recorded (WorkerLost)"] = losses["worker_lost"] + losses["poison"]
    out.figures["runs ended by a loss, by kind"] = dict(losses)
    if twice:
        out.fail("I4", f"{len(twice)} job(s) ran one attempt number twice without a release",
                 twice)  # fmt: skip
    if tokens_reused:
        out.fail("I4", f"{len(tokens_reused)} job(s) ran twice under one lease token",
                 tokens_reused)  # fmt: skip
    if unexplained_rows:
        out.fail(
            "I4",
            f"{len(unexplained_rows)} execution(s) explained by no failure, lease loss, release "
            "or the completion",
            unexplained_rows,
        )
    if explained != duplicates:
        out.fail("I4", f"only {explained} of {duplicates} duplicate executions are explained")
    if no_run:
        out.fail("I4", f"{len(no_run)} completed job(s) whose completing attempt ran != 1 time",
                 no_run)  # fmt: skip
    if uncharged:
        out.fail("I5", f"{len(uncharged)} job(s) charged an attempt without a run or a "
                 "recorded loss", uncharged)  # fmt: skip


def _completing_token(job: JobInfo, starts: list[Run], ends: dict[str, list[str]]) -> str | None:
    """The lease token of the run whose completion the store recorded: the one its result
    names (every completing handler returns its token), else the run of the final attempt
    that recorded nothing else."""
    if job.state != "completed":
        return None
    if isinstance(job.result, dict) and job.result.get("token"):
        return str(job.result["token"])
    bare = [r.token for r in starts if r.attempt == job.attempt and not ends.get(r.token or "")]
    return bare[0] if len(bare) == 1 else None


# -- I3 effect once -------------------------------------------------------------------------------
def _effects_once(
    out: Findings, store: Store, jobs: dict[int, JobInfo], by_job: dict[int, list[Run]]
) -> None:
    bad_tx, tx_rows = [], 0
    for job in jobs.values():
        if job.name not in TX_JOBS:
            continue
        rows = [r for r in by_job.get(job.id, []) if r.kind == "tx"]
        tx_rows += len(rows)
        want = 1 if job.state == "completed" else 0
        if len(rows) != want or (want and rows[0].attempt != job.attempt):
            bad_tx.append((job.id, job.state, [r.attempt for r in rows]))
    charges: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for key, job_id, charge_id in store.query("SELECT idem_key, job_id, id FROM {s}soak_charges"):
        charges[key].append((int(job_id), int(charge_id)))
    bad_pay, calls = [], 0
    for job in jobs.values():
        if job.name != "soak.pay":
            continue
        calls += sum(1 for r in by_job.get(job.id, []) if r.kind == "psp_call")
        found = charges.get(f"soak.pay:{job.key if job.key is not None else job.id}", [])
        if job.state == "completed":
            charge_id = (job.result or {}).get("charge_id")
            if len(found) != 1 or found[0][1] != charge_id:
                bad_pay.append((job.id, job.state, found, charge_id))
        elif len(found) > 1:
            bad_pay.append((job.id, job.state, found, None))
    pay_jobs = sum(1 for j in jobs.values() if j.name == "soak.pay")
    out.figures["tx effect rows"] = tx_rows
    out.figures["payment charges"] = sum(len(v) for v in charges.values())
    out.figures["payment provider calls"] = calls
    out.figures["payment calls repeated (deduplicated by the provider)"] = calls - pay_jobs
    if bad_tx:
        out.fail("I3", f"{len(bad_tx)} ctx.transaction job(s) without exactly one effect", bad_tx)
    if bad_pay:
        out.fail("I3", f"{len(bad_pay)} ctx.step payment(s) without exactly one charge", bad_pay)


# -- I5 attempts ----------------------------------------------------------------------------------
def _attempts(out: Findings, jobs: dict[int, JobInfo]) -> None:
    over, early, bare = [], [], []
    for job in jobs.values():
        if job.attempt > job.max_attempts:
            over.append((job.id, job.attempt, job.max_attempts))
        if job.state != "dead":
            continue
        last = job.errors[-1] if job.errors else {}
        if not (last.get("type") and last.get("message")):
            bare.append(job.id)
        if job.attempt < job.max_attempts and last.get("kind") not in ("permanent", "poison"):
            early.append((job.id, job.attempt, job.max_attempts, last.get("kind")))
    dead_reasons = Counter(
        (j.errors[-1].get("kind") if j.errors else None) for j in jobs.values() if j.state == "dead"
    )
    out.figures["dead by reason"] = dict(dead_reasons)
    if over:
        out.fail("I5", f"{len(over)} job(s) ran more attempts than allowed", over)
    if early:
        out.fail("I5", f"{len(early)} job(s) dead before their last attempt", early)
    if bare:
        out.fail("I5", f"{len(bare)} dead job(s) without a reason and last error", bare)


# -- I6 fencing -----------------------------------------------------------------------------------
def _fencing(out: Findings, jobs: dict[int, JobInfo], by_job: dict[int, list[Run]]) -> None:
    """The recorded completion is the completing attempt's own (a stale write that landed
    would carry an older attempt or another token)."""
    wrong = []
    for job in jobs.values():
        if job.state != "completed" or not isinstance(job.result, dict):
            continue
        starts = {r.token: r.attempt for r in by_job.get(job.id, []) if r.kind == "run"}
        if job.result.get("attempt") != job.attempt or (
            job.result.get("token") and starts.get(job.result["token"]) != job.attempt
        ):
            wrong.append((job.id, job.attempt, job.result))
    if wrong:
        out.fail("I6", f"{len(wrong)} completion(s) written by a stale attempt", wrong)


# -- I7 time --------------------------------------------------------------------------------------
def _time(out: Findings, jobs: dict[int, JobInfo], runs: list[Run], poll: float) -> None:
    early = [
        (r.job_id, r.attempt, round(r.run_at - r.claimed_at, 3))
        for r in runs
        if r.kind == "run" and r.run_at is not None and r.claimed_at is not None
        and r.claimed_at < r.run_at - poll
    ]  # fmt: skip
    if early:
        out.fail("I7", f"{len(early)} execution(s) started before their run_at", early)
    slots: Counter[str] = Counter(
        j.key for j in jobs.values() if j.name == "soak.cron" and j.key is not None
    )
    twice = [k for k, n in slots.items() if n > 1]
    times = sorted(
        datetime.strptime(k, "cron:%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
        for k in slots
    )
    gaps = [
        (datetime.fromtimestamp(a, UTC).isoformat(), b - a)
        for a, b in itertools.pairwise(times)
        if abs(b - a - CRON_STEP) > 0.001
    ]
    out.figures["cron slots"] = len(slots)
    if twice:
        out.fail("I7", f"{len(twice)} cron slot(s) enqueued more than once", twice)
    if gaps:
        out.fail("I7", f"{len(gaps)} gap(s) between consecutive cron slots", gaps)
    if not slots:
        out.fail("I7", "no cron slot was enqueued at all")


# -- I8 uniqueness --------------------------------------------------------------------------------
def _uniqueness(out: Findings, store: Store, ledger: Ledger) -> None:
    bad = []
    for burst in ledger.bursts:
        rows = store.query(
            "SELECT count(*) FROM {s}errands_jobs WHERE name = 'soak.unique' "
            "AND idempotency_key = %s",
            (burst.key,),
        )
        fresh_ok = burst.fresh == 1 or (burst.retried and burst.fresh <= 1)
        if len(set(burst.ids)) != 1 or rows[0][0] != 1 or not fresh_ok:
            bad.append((burst.key, sorted(set(burst.ids)), rows[0][0], burst.fresh))
    out.figures["concurrent-enqueue bursts (24 callers, one key)"] = len(ledger.bursts)
    if bad:
        out.fail("I8", f"{len(bad)} burst(s) of one key gave more than one job", bad)


# -- I2 no phantoms -------------------------------------------------------------------------------
def _phantoms(
    out: Findings,
    store: Store,
    jobs: dict[int, JobInfo],
    ledger: Ledger,
    by_job: dict[int, list[Run]],
) -> None:
    orders = {int(r[0]) for r in store.query("SELECT order_id FROM {s}soak_orders")}
    order_jobs: dict[int, list[int]] = defaultdict(list)
    for job in jobs.values():
        if job.name == "soak.order":
            order_jobs[int(job.args.get("order_id", -1))].append(job.id)
    problems = []
    for order_id, job_id in ledger.orders_committed.items():
        if order_id not in orders or order_jobs.get(order_id) != [job_id]:
            problems.append(("committed", order_id, order_id in orders, order_jobs.get(order_id)))
    for order_id in ledger.orders_rolled_back:
        if order_id in orders or order_jobs.get(order_id):
            problems.append(("rolled back", order_id, order_id in orders, order_jobs.get(order_id)))
    for order_id in ledger.orders_unknown:
        if (order_id in orders) != bool(order_jobs.get(order_id)):
            problems.append(("unknown", order_id, order_id in orders, order_jobs.get(order_id)))
    ran_rolled_back = [
        r.job_id
        for rows in by_job.values()
        for r in rows
        if r.kind == "run" and r.detail is not None and r.detail.isdigit()
        and int(r.detail) in ledger.orders_rolled_back and r.job_id in jobs
        and jobs[r.job_id].name == "soak.order"
    ]  # fmt: skip
    phantom_runs = sorted({job_id for job_id in by_job if job_id not in jobs})
    out.figures["transactional enqueues committed / rolled back / unknown"] = (
        f"{len(ledger.orders_committed)} / {len(ledger.orders_rolled_back)} / "
        f"{len(ledger.orders_unknown)}"
    )
    if problems:
        out.fail("I2", f"{len(problems)} order(s) whose job exists iff its row does not",
                 problems)  # fmt: skip
    if ran_rolled_back:
        out.fail("I2", "jobs of rolled-back enqueues ran", ran_rolled_back)
    if phantom_runs:
        out.fail("I2", f"{len(phantom_runs)} execution(s) of jobs the store does not hold",
                 phantom_runs)  # fmt: skip


# -- I9 liveness ----------------------------------------------------------------------------------
def _liveness(out: Findings, chaos: Chaos, lease: float, poll: float, enforce: bool) -> None:
    bound = 2 * (lease + poll)
    out.figures["recovery bound (2 x (lease + poll)) s"] = bound
    by_kind: dict[str, list[float]] = defaultdict(list)
    slow, never, reconnects = [], [], []
    for ep in chaos.episodes:
        if ep.recovery is None:
            never.append((ep.kind, ep.detail))
            continue
        by_kind[ep.kind].append(ep.recovery)
        if ep.recovery > bound and ep.kind == "pg_restart":
            reconnects.append(round(ep.recovery, 2))
        elif ep.recovery > bound:
            slow.append((ep.kind, round(ep.recovery, 2), ep.detail))
    if reconnects:
        out.observations.append(
            f"I9 not met after {len(reconnects)} PostgreSQL restart(s): recovery {reconnects} s "
            f"past the {bound:g} s bound; the connection pool reconnects with a backoff of "
            "1, 2, 4 s, starting afresh after 5 s (psycopg_pool), not bounded by the lease "
            "(docs/reliability.md, known issues)"
        )
    every = [v for values in by_kind.values() for v in values]
    out.figures["recovery s (max, p99)"] = (max(every, default=None), percentile(every, 99))
    out.figures["recovery s by fault (max)"] = {k: round(max(v), 3) for k, v in by_kind.items()}
    if never:
        out.fail("I9", f"{len(never)} fault(s) after which the canary was never picked up", never)
    if slow and enforce:
        out.fail("I9", f"{len(slow)} recovery time(s) above {bound:g} s", slow)
    elif slow:
        out.observations.append(
            f"I9 (reported, not enforced at this size): {len(slow)} recovery time(s) above "
            f"{bound:g} s: {slow[:8]}"
        )


def _rescues(
    out: Findings, jobs: dict[int, JobInfo], by_job: dict[int, list[Run]], chaos: Chaos
) -> None:
    """How soon the jobs a killed, frozen or cut-off worker held when the fault began
    were rescued (F1, F5, F8: within the lease plus the rescue interval; a leader's own
    jobs wait for the next leader, up to its 5 s lease)."""
    claimed = {
        (r.job_id, r.attempt): r.claimed_at
        for rows in by_job.values()
        for r in rows
        if r.kind == "run" and r.claimed_at is not None
    }
    delays: dict[str, list[float]] = defaultdict(list)
    for ep in (ep for ep in chaos.episodes if ep.victim):
        for job in jobs.values():
            for err in job.errors:
                if err.get("type") != "WorkerLost" or err.get("worker") != ep.victim:
                    continue
                at = float(err.get("at", 0))
                held_since = claimed.get((job.id, err.get("attempt")))
                if held_since is not None and held_since <= ep.started <= at <= ep.healed + 30:
                    delays[ep.kind].append(at - ep.started)
    out.figures["rescue after the fault s (max) by fault"] = {
        k: round(max(v), 2) for k, v in delays.items()
    }


# -- F19: a cancelled job never runs again --------------------------------------------------------
def _cancels(
    out: Findings, jobs: dict[int, JobInfo], by_job: dict[int, list[Run]], chaos: Chaos
) -> None:
    bad, landed = [], 0
    for record in chaos.cancels:
        if not record.state:
            continue  # the job had ended before the cancel (it answered an error)
        landed += 1
        job = jobs.get(record.job_id)
        # A claim whose transaction began after the cancel had committed ran it again.
        later = [
            r.attempt
            for r in by_job.get(record.job_id, [])
            if r.kind == "run" and r.claimed_at is not None and r.claimed_at > record.committed_at
        ]
        allowed = ("cancelled", "completed") if record.state == "running" else ("cancelled",)
        if job is None or job.state not in allowed or later:
            bad.append((record.job_id, record.state, job.state if job else None, later))
    out.figures["cancels racing a rescue (landed / attempted)"] = f"{landed} / {len(chaos.cancels)}"
    out.figures["cancels answered (state then -> answer)"] = dict(
        Counter(f"{c.previous_state}->{c.state}" for c in chaos.cancels if c.state)
    )
    out.figures["cancelled jobs ended"] = dict(
        Counter(jobs[c.job_id].state for c in chaos.cancels if c.state and c.job_id in jobs)
    )
    if bad:
        out.fail("F19", f"{len(bad)} cancelled job(s) ran again or ended otherwise", bad)


# -- F8: self-fencing -----------------------------------------------------------------------------
def _self_fencing(
    out: Findings, jobs: dict[int, JobInfo], by_job: dict[int, list[Run]], chaos: Chaos
) -> None:
    """A worker cut off from the database stops its handlers before their leases run
    out: no slow handler of a cut-off worker may still be working when its attempt is
    rescued (its lease had expired)."""
    overran, fenced, silent = [], 0, []
    cuts = [ep for ep in chaos.episodes if ep.kind == "proxy_cut" and ep.victim]
    for ep in cuts:
        for job in jobs.values():
            if job.name not in LONG_JOBS:
                continue
            for err in job.errors:
                if err.get("type") != "WorkerLost" or err.get("worker") != ep.victim:
                    continue
                if not ep.started <= float(err.get("at", 0)) <= ep.healed + 1:
                    continue
                ends = [
                    r for r in by_job.get(job.id, [])
                    if r.kind == "end" and r.attempt == err["attempt"] and r.worker == ep.victim
                ]  # fmt: skip
                rescued_at = float(err["at"])
                if not ends:  # never reported: blocked in I/O, or its process died
                    silent.append((job.id, err["attempt"]))
                elif any(stopped_at(r) > rescued_at for r in ends):
                    overran.append(
                        (job.id, err["attempt"], rescued_at, [(r.detail, r.at) for r in ends])
                    )
                else:
                    fenced += 1
    out.figures["handlers stopped in time while cut off (F8)"] = fenced
    out.figures["handlers still running when their lease ran out (F8)"] = len(overran)
    out.figures["handlers that never reported how they ended (F8)"] = len(silent)
    if overran:
        out.fail("F8", f"{len(overran)} handler(s) of a cut-off worker outlived their lease",
                 overran)  # fmt: skip


def stopped_at(run: Run) -> float:
    """When a slow handler stopped: the time in its ``end`` row's detail (``reason@epoch``),
    else the row's own time."""
    _, _, when = (run.detail or "").rpartition("@")
    try:
        return float(when)
    except ValueError:
        return run.at


# -- I10 store health -----------------------------------------------------------------------------
def _health(out: Findings, store: Store) -> None:
    if store.sqlite:
        result = store.scalar("PRAGMA integrity_check")
        pages = store.scalar("PRAGMA page_count")
        free = store.scalar("PRAGMA freelist_count")
        out.figures["store health"] = f"integrity_check={result}, pages={pages}, free={free}"
        if result != "ok":
            out.fail("I10", f"SQLite integrity_check: {result}")
        return
    rows = store.query(
        "SELECT n_dead_tup, n_live_tup FROM pg_stat_user_tables "
        "WHERE schemaname = %s AND relname = 'errands_jobs'",
        (store.schema,),
    )
    oldest = store.scalar(
        "SELECT coalesce(extract(epoch FROM now() - min(xact_start)), 0)::float8 "
        "FROM pg_stat_activity WHERE datname = current_database() AND xact_start IS NOT NULL "
        "AND pid <> pg_backend_pid()"
    )
    dead, live = rows[0] if rows else (None, None)
    out.figures["store health"] = (
        f"errands_jobs dead tuples={dead}, live tuples={live}, "
        f"oldest open transaction={float(oldest or 0):.1f} s"
    )


# -- pickup latency and I9 for rescued jobs --------------------------------------------------------
def _passed_over(
    late: list[tuple[int, int, float]],
    jobs: dict[int, JobInfo],
    runs: list[Run],
    rescued_before: dict[int, list[int]],
) -> str:
    """How many of the late rescued claims a job of no higher priority, due no earlier and
    never rescued, was claimed ahead of (a claim round that could have taken the rescued
    job took a fresher one: the suspect path's delay), against those that waited with
    every claim of their time taken by jobs due before them or of higher priority (the
    cluster's slots were full)."""
    if not late:
        return "0 of 0"
    claims = sorted(
        (r.claimed_at, r.run_at, r.job_id)
        for r in runs
        if r.kind == "run" and r.claimed_at is not None and r.run_at is not None
        and not rescued_before.get(r.job_id)
    )  # fmt: skip
    times = [c for c, _, _ in claims]
    by_run = {
        (r.job_id, r.attempt): r
        for r in runs
        if r.kind == "run" and r.claimed_at is not None and r.run_at is not None
    }
    passed = 0
    for job_id, attempt, _ in late:
        mine = by_run.get((job_id, attempt))
        if mine is None or job_id not in jobs:
            continue
        due, claimed, priority = mine.run_at, mine.claimed_at, jobs[job_id].priority
        assert due is not None and claimed is not None
        lo, hi = bisect.bisect_right(times, due), bisect.bisect_left(times, claimed)
        if any(
            other_due >= due and other in jobs and jobs[other].priority <= priority
            for _, other_due, other in claims[lo:hi]
        ):
            passed += 1
    return f"{passed} of {len(late)}"


def _faults_around(episodes: list[Any], due: float, claimed: float, lease: float) -> str:
    """The faults in play while a rescued job waited: each episode from ``2 * lease``
    before it was due (the fault that lost its lease, at the latest) until its claim, as
    kind(victim)@start..heal in seconds relative to the due time ("-" for none)."""
    shown = [
        f"{ep.kind}{f'({ep.victim})' if ep.victim else ''}@{ep.started - due:+.1f}.."
        f"{(ep.healed or claimed) - due:+.1f}"
        for ep in episodes
        if ep.started <= claimed and (ep.healed or claimed) >= due - 2 * lease
    ]
    return ", ".join(shown) or "-"


def _passers(
    late: list[tuple[int, int, float]],
    jobs: dict[int, JobInfo],
    runs: list[Run],
    rescued_before: dict[int, list[int]],
    episodes: list[Any],
    lease: float,
) -> dict[str, Any]:
    """Who went ahead of the late rescued claims: for each, its queue and type, the worker
    that claimed it in the end, and the workers that claimed fresher jobs of its own queue
    (no higher priority) while it waited. A worker that claims fresh jobs of a queue while
    a rescued one of that queue is due passes it over; one that claims only other queues'
    jobs had no claim on it."""
    claims = sorted(
        (r.claimed_at, r.run_at, r.job_id, r.worker)
        for r in runs
        if r.kind == "run" and r.claimed_at is not None and r.run_at is not None
        and not rescued_before.get(r.job_id)
    )  # fmt: skip
    times = [c[0] for c in claims]
    by_run = {(r.job_id, r.attempt): r for r in runs if r.kind == "run" and r.claimed_at}
    details: list[str] = []
    by_worker: Counter[str] = Counter()
    for job_id, attempt, wait in late:
        mine, info = by_run.get((job_id, attempt)), jobs.get(job_id)
        if mine is None or info is None or mine.run_at is None or mine.claimed_at is None:
            continue
        lo = bisect.bisect_right(times, mine.run_at)
        hi = bisect.bisect_left(times, mine.claimed_at)
        ahead: Counter[str] = Counter(
            worker
            for _, due, other, worker in claims[lo:hi]
            if due >= mine.run_at and other in jobs and jobs[other].queue == info.queue
            and jobs[other].priority <= info.priority
        )  # fmt: skip
        by_worker.update(ahead)
        details.append(
            f"{job_id}/{attempt} {info.name.removeprefix('soak.')}@{info.queue} {wait:.1f}s "
            f"by {mine.worker}; ahead {dict(ahead.most_common(3)) or '-'}; faults "
            f"{_faults_around(episodes, mine.run_at, mine.claimed_at, lease)}"
        )
    shown = details[:LATE_SHOWN] + (
        [f"... and {len(details) - LATE_SHOWN} more"] if len(details) > LATE_SHOWN else []
    )
    return {"claims of fresher same-queue jobs by worker": dict(by_worker), "late": shown}


LATE_SHOWN = 20  # late rescued claims described one by one in the report


def _p(values: list[float], p: float) -> str:
    value = percentile(values, p)
    return "-" if value is None else f"{value:.3f}"


# Job types whose ``run`` row is written after a wait (a signal), not when the handler starts.
RUN_ROW_AFTER_A_WAIT = frozenset({"soak.signalled", "soak.signal_never"})


def _latency(
    out: Findings,
    jobs: dict[int, JobInfo],
    runs: list[Run],
    chaos: Chaos,
    settle: float,
    enforce: bool,
) -> None:
    """Claim time minus due time, over every claim; over the claims made away from any
    fault (not between a fault's start and ``settle`` seconds after its heal); and over
    the claims of rescued jobs (a lease of theirs was lost before): I9 says those start
    within the bound. Claims while PostgreSQL restarts are left out of the bound (its
    pool's reconnect backoff, a known issue) and counted apart."""
    windows = [(ep.started, ep.healed + settle) for ep in chaos.episodes]
    restarts = [
        (ep.started, ep.healed + settle) for ep in chaos.episodes if ep.kind == "pg_restart"
    ]
    rescued_before: dict[int, list[int]] = {
        j.id: [e["attempt"] for e in j.errors if e.get("type") == "WorkerLost"]
        for j in jobs.values()
        if j.errors
    }
    waits, calm, rescued, restart_rescued, rescued_started = [], [], [], [], []
    # claim -> handler start (its run row): rescued jobs (a child process each) vs the rest
    begun: dict[bool, list[float]] = {True: [], False: []}
    late: list[tuple[int, int, float]] = []
    late_types: Counter[str] = Counter()
    by_type: dict[str, list[float]] = defaultdict(list)
    for r in runs:
        if r.kind != "run" or r.claimed_at is None or r.run_at is None:
            continue
        wait = max(r.claimed_at - r.run_at, 0.0)
        waits.append(wait)
        by_type[r.name.removeprefix("soak.")].append(wait)
        was_rescued = any(a < r.attempt for a in rescued_before.get(r.job_id, ()))
        if r.name not in RUN_ROW_AFTER_A_WAIT:  # its run row is its handler's start
            begun[was_rescued].append(max(r.at - r.claimed_at, 0.0))
        if was_rescued:
            if any(a <= r.claimed_at <= b for a, b in restarts):
                restart_rescued.append(wait)
                continue
            rescued.append(wait)
            if r.name not in RUN_ROW_AFTER_A_WAIT:  # its run row is its handler's start
                rescued_started.append(max(r.at - r.run_at, 0.0))
            if wait > settle:
                late.append((r.job_id, r.attempt, round(wait, 2)))
                late_types[r.name.removeprefix("soak.")] += 1
        elif not any(a <= r.claimed_at <= b for a, b in windows):
            calm.append(wait)
    out.figures["pickup latency s (p50, p99)"] = (percentile(waits, 50), percentile(waits, 99))
    out.figures["pickup latency away from faults s (p50, p99)"] = (
        percentile(calm, 50),
        percentile(calm, 99),
    )
    out.figures["pickup latency of rescued jobs s (p50, p99, max)"] = (
        percentile(rescued, 50),
        percentile(rescued, 99),
        max(rescued, default=None),
    )
    out.figures["pickup latency s by job type (p50/p99)"] = {
        name: f"{percentile(v, 50):.3f}/{percentile(v, 99):.3f}"
        for name, v in sorted(by_type.items())
    }
    out.figures["rescued jobs claimed (past the I9 bound)"] = f"{len(rescued)} ({len(late)})"
    out.figures["rescued jobs past the bound passed over by a fresher job"] = _passed_over(
        late, jobs, runs, rescued_before
    )
    out.figures["rescued jobs past the I9 bound, by job type"] = dict(late_types.most_common())
    if late:
        out.figures["rescued jobs past the I9 bound, who went ahead"] = _passers(
            late,
            jobs,
            runs,
            rescued_before,
            chaos.episodes,
            settle / 2,  # lease + poll
        )
    # Claim to start is not in I9's bound (a claimed job holds its lease) but is what a
    # user waits: isolated suspects start in a child process of their own.
    out.figures["rescued jobs due to handler start s (p50, p99, max)"] = (
        percentile(rescued_started, 50),
        percentile(rescued_started, 99),
        max(rescued_started, default=None),
    )
    out.figures["claim to handler start s (p50, p99): rescued / others"] = (
        f"{_p(begun[True], 50)}, {_p(begun[True], 99)} / "
        f"{_p(begun[False], 50)}, {_p(begun[False], 99)}"
    )
    if restart_rescued:
        out.figures["rescued jobs claimed while PostgreSQL restarted s (n, max)"] = (
            len(restart_rescued),
            max(restart_rescued),
        )
    out.figures["I9 enforced"] = "yes (full size)" if enforce else "no: reported (CI size)"
    if not late:
        return
    message = (
        f"{len(late)} of {len(rescued)} claims of rescued jobs waited past the {settle:g} s "
        f"bound, up to {max(w for *_, w in late):.1f} s (p99 {percentile(rescued, 99):.1f} s)"
    )
    if enforce:
        out.fail("I9", message, sorted(late, key=lambda x: -x[2]))
    else:
        out.observations.append(f"I9 (reported, not enforced at this size): {message}")
