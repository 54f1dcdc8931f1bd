"""The chaos soak's app: every kind of job the soak mixes, each leaving rows to count.

Worker processes import this module (``errands worker soak_app:app``) with:

- ``ERRANDS_URL``: errands' store. On PostgreSQL it points at the worker's own TCP fault
  proxy and carries the soak's ``application_name``, so the chaos driver can cut this
  worker off or terminate exactly its sessions;
- ``SOAK_EFFECTS_URL``: the same store, reached directly (never through the proxy), for
  the rows the handlers append to the soak's tables (see :mod:`soak_tables`).

Every handler first appends one ``run`` row (one per execution) carrying its attempt and
lease token, and returns ``{"attempt", "token"}`` so the checker can tell which attempt's
completion was recorded (a stale write that landed would show up as a mismatch, I6).
Retries and poison headroom are generous: under the chaos a job may lose its lease a few
times, and only a real bug — never the chaos itself — may keep a job from its expected end.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from soak_tables import dialect

import errands

LEASE = float(os.environ.get("SOAK_LEASE", "2"))
RETRIES = 25
QUICK = 0.05  # backoff seconds: retries come back at once, the run stays short
CRON = "*/5 * * * * *"  # every 5 s (cronsim's optional seconds field)
CRON_STEP = 5.0
CANARY_PRIORITY = 1000

# Hooks: the slow one takes HOOK_SLOW s and its effect write may wait seconds for a busy
# store, within the default 10 s limit (one past it is interrupted, counted as run, and
# would show as a hook that never ran); the leader runs the hooks of a death no worker
# marked done within 12 s (a worker killed before it ran them).
app = errands.App(lease=LEASE, poison_after=20, retention=None, dead_hooks_grace=12.0)


# -- the soak's tables, through connections of their own ------------------------------------
class Effects:
    def __init__(self, url: str) -> None:
        self.sqlite = url.startswith("sqlite:")
        self._local = threading.local()
        if self.sqlite:
            from errands.backends.sqlite.backend import parse_sqlite_url

            self.path = os.path.abspath(parse_sqlite_url(url)[0])
            self.q = ""
        else:
            from psycopg_pool import ConnectionPool

            from errands.backends.postgres.config import parse_postgres_url

            config = parse_postgres_url(url)
            self.q = f'"{config.schema}".'
            self.pool = ConnectionPool(
                config.conninfo,
                min_size=1,
                max_size=12,
                kwargs={"autocommit": True, "application_name": f"soak_fx_{config.schema}"},
                check=ConnectionPool.check_connection,  # the server may have restarted
                open=True,
                name="soak-effects",
                timeout=30.0,
            )

    def _sqlite(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=120, isolation_level=None)
            conn.execute("PRAGMA busy_timeout = 120000")
            self._local.conn = conn
        return conn

    def sql(self, text: str) -> str:
        return dialect(self.sqlite, text.replace("{q}", self.q))

    @contextmanager
    def transaction(self) -> Iterator[Any]:
        """A connection in a transaction (committed at the end, rolled back on error)."""
        if self.sqlite:
            conn = self._sqlite()
            try:  # BEGIN inside: an interrupt (a hook's time limit) right after it rolls back
                conn.execute("BEGIN IMMEDIATE")
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        else:
            with self.pool.connection() as conn, conn.transaction():
                yield conn


_effects: Effects | None = None
_effects_lock = threading.Lock()


def effects() -> Effects:
    global _effects
    with _effects_lock:
        if _effects is None:
            _effects = Effects(os.environ["SOAK_EFFECTS_URL"])
        return _effects


INSERT_EFFECT = (
    "INSERT INTO {q}soak_effects (job_id, attempt, token, kind, name, pid, worker, at, run_at, "
    "claimed_at, detail) VALUES (%s, %s, %s, %s, %s, %s, %s, NOW(), %s, %s, %s)"
)


def claim_of(ctx: errands.Context) -> tuple[str | None, float | None, float | None]:
    """(lease token, run_at, claim time) of the row this attempt claimed.

    The public Context does not carry them; the soak reads the claimed row from the
    attempt behind it (a private attribute, fine for a test of errands itself).
    """
    runtime = getattr(ctx, "_runtime", None)
    row = getattr(getattr(runtime, "attempt", None), "row", None)
    if row is None:
        return None, None, None
    return row.lease_token, row.run_at, row.attempted_at


def effect_params(ctx: errands.Context, kind: str, detail: str | None) -> tuple[Any, ...]:
    token, run_at, claimed_at = claim_of(ctx)
    return (ctx.job_id, ctx.attempt, token, kind, ctx.name, os.getpid(), ctx.worker_id,
            run_at, claimed_at, detail)  # fmt: skip


def record(ctx: errands.Context, kind: str = "run", detail: str | None = None) -> str | None:
    """Append one row (its own transaction); raises when the store is away, which fails
    the attempt like any handler error (the checker then explains the row by that error)."""
    fx = effects()
    with fx.transaction() as conn:
        conn.execute(fx.sql(INSERT_EFFECT), effect_params(ctx, kind, detail))
    return claim_of(ctx)[0]


def done(ctx: errands.Context, token: str | None, **extra: Any) -> dict[str, Any]:
    return {"attempt": ctx.attempt, "token": token, **extra}


# -- the job kinds -----------------------------------------------------------------------------
@app.job(name="soak.fast", retries=RETRIES, backoff=QUICK)
def fast(ctx: errands.Context, n: int) -> dict[str, Any]:
    return done(ctx, record(ctx))


@app.job(name="soak.slow", queue="slow", retries=RETRIES, backoff=QUICK)
def slow(ctx: errands.Context, n: int, seconds: float) -> dict[str, Any]:
    """Work for ``seconds`` (reporting ctx.progress), stopping early (with an error) when
    the worker asks: lease lost, lease not renewable (self-fencing), operator cancel,
    shutdown. Records how it ended."""
    token = record(ctx)
    stopped = _work(ctx, seconds)
    # "end" rows carry the moment the handler stopped (the row's own time is when the
    # insert landed, later when the store is slow).
    _end(ctx, stopped)
    if stopped:
        raise RuntimeError(f"stopped: {ctx.cancel_reason}")
    return done(ctx, token)


@app.job(name="soak.flaky", retries=RETRIES, backoff=QUICK)
def flaky(ctx: errands.Context, n: int, fail_times: int) -> dict[str, Any]:
    """Fails its first ``fail_times`` attempts, then succeeds."""
    token = record(ctx)
    if ctx.attempt <= fail_times:
        raise RuntimeError(f"flaky: failing attempt {ctx.attempt} of the first {fail_times}")
    return done(ctx, token)


@app.job(name="soak.doomed", retries=RETRIES, backoff=QUICK)
def doomed(ctx: errands.Context, n: int) -> None:
    """Permanently failing: dead at once, before its last attempt (I5 allows it)."""
    record(ctx)
    # the markup checks that the dashboard shows error text escaped (dashboard_check.py)
    raise errands.Permanent(f"doomed job {n}: <script>alert({n})</script> can never succeed")


@app.job(name="soak.exhaust", retries=2, backoff=QUICK)
def exhaust(ctx: errands.Context, n: int) -> None:
    """Always raises a transient error: dead once its 3 attempts are spent."""
    record(ctx)
    raise ValueError(f"exhaust job {n}: failing attempt {ctx.attempt}")


def psp_charge(job_id: int, idem_key: str, amount: int, ctx: errands.Context) -> dict[str, Any]:
    """The fake payment provider: logs the call, creates at most one charge per key."""
    fx = effects()
    with fx.transaction() as conn:
        conn.execute(fx.sql(INSERT_EFFECT), effect_params(ctx, "psp_call", idem_key))
        conn.execute(
            fx.sql(
                "INSERT INTO {q}soak_charges (idem_key, job_id, amount, at) "
                "VALUES (%s, %s, %s, NOW()) ON CONFLICT (idem_key) DO NOTHING"
            ),
            (idem_key, job_id, amount),
        )
        row = conn.execute(
            fx.sql("SELECT id FROM {q}soak_charges WHERE idem_key = %s"), (idem_key,)
        ).fetchone()
    return {"charge_id": int(row[0]), "amount": amount}


@app.job(name="soak.pay", queue="payments", retries=RETRIES, backoff=QUICK, sensitive={"amount"})
def pay(ctx: errands.Context, order: int, amount: int) -> dict[str, Any]:
    """A step-protected payment: the charge is a durable step keyed by the job."""
    token = record(ctx)
    charge = ctx.step("charge", psp_charge, ctx.job_id, ctx.idempotency_key, amount, ctx)
    return done(ctx, token, charge_id=charge["charge_id"])


@app.job(name="soak.tx", queue="payments", retries=RETRIES, backoff=QUICK)
def tx(ctx: errands.Context, n: int) -> dict[str, Any]:
    """Writes its effect through ctx.transaction(): it commits with the completion."""
    token = record(ctx)  # before the transaction: on SQLite that holds the write lock
    conn = ctx.transaction()
    fx = effects()
    conn.execute(fx.sql(INSERT_EFFECT), effect_params(ctx, "tx", str(n)))
    return done(ctx, token)


@app.job(name="soak.order", retries=RETRIES, backoff=QUICK)
def order(ctx: errands.Context, order_id: int) -> dict[str, Any]:
    """Enqueued in the same transaction as its ``soak_orders`` row (or rolled back)."""
    return done(ctx, record(ctx, detail=str(order_id)))


@app.job(name="soak.unique", retries=RETRIES, backoff=QUICK)
def unique(ctx: errands.Context, group: int) -> dict[str, Any]:
    """Enqueued by many threads at once with one idempotency key (I8)."""
    return done(ctx, record(ctx))


@app.job(name="soak.canary", priority=CANARY_PRIORITY, retries=RETRIES, backoff=QUICK)
def canary(ctx: errands.Context, n: int) -> dict[str, Any]:
    """Enqueued when a fault heals: how soon it is picked up is the recovery time (I9)."""
    return done(ctx, record(ctx))


@app.periodic(CRON, catch_up=True, name="soak.cron", retries=RETRIES, backoff=QUICK)
def cron(ctx: errands.Context) -> dict[str, Any]:
    """One job per 5-second slot; catch_up=True, so no slot may be missing either (I7)."""
    return done(ctx, record(ctx, detail=ctx.key))


# -- issue 16 part B: the shapes the defects of part A lived in --------------------------------
# A slow stop idiom: between units of work a handler calls ctx.progress() and checks
# ctx.cancelled. "end" rows carry how the run stopped (see slow()).
def _work(ctx: errands.Context, seconds: float) -> bool:
    """Work for ``seconds`` (reporting progress) or until asked to stop; True if stopped."""
    started = time.monotonic()
    deadline = started + seconds
    while time.monotonic() < deadline and not ctx.cancelled:
        ctx.progress(min((time.monotonic() - started) / max(seconds, 0.001), 1.0), "working")
        time.sleep(0.02)
    return ctx.cancelled


def _end(ctx: errands.Context, stopped: bool) -> None:
    how = f"stopped:{ctx.cancel_reason}" if stopped else "finished"
    record(ctx, "end", f"{how}@{time.time():.3f}")


@app.job(name="soak.slow_return", queue="slow", retries=RETRIES, backoff=QUICK)
def slow_return(ctx: errands.Context, n: int, seconds: float) -> dict[str, Any]:
    """Like slow, but returns normally when asked to stop (``if ctx.cancelled: return``):
    errands must not record such a return as a completion (issue 16 A3). The result says
    whether the work was cut short, so a wrongly recorded completion shows."""
    token = record(ctx)
    stopped = _work(ctx, seconds)
    _end(ctx, stopped)
    return done(ctx, token, cut_short=stopped)


@app.job(name="soak.aslow", queue="slow", retries=RETRIES, backoff=QUICK)
async def aslow(ctx: errands.Context, n: int, seconds: float) -> dict[str, Any]:
    """An async handler: works in awaits, reports progress, is stopped with CancelledError."""
    token = await asyncio.to_thread(record, ctx)
    started = time.monotonic()
    try:
        while time.monotonic() - started < seconds:
            ctx.progress(min((time.monotonic() - started) / seconds, 1.0), "working")
            await asyncio.sleep(0.02)
    except asyncio.CancelledError:
        _end(ctx, True)  # blocking for a moment: the task is being torn down anyway
        raise
    await asyncio.to_thread(_end, ctx, False)
    return done(ctx, token)


@app.job(name="soak.tx_hold", queue="txwide", retries=RETRIES, backoff=QUICK)
def tx_hold(ctx: errands.Context, n: int, hold: float) -> dict[str, Any]:
    """Holds ``ctx.transaction()`` open for ``hold`` seconds. Enqueued in bursts of a
    whole cluster's slots, so every handler of a worker holds a transaction at once: as
    many as (or more than) the worker's pool has connections (issue 16 A2). Returns
    normally when asked to stop; the transaction must then roll back, not complete."""
    token = record(ctx)
    conn = ctx.transaction()
    fx = effects()
    conn.execute(fx.sql(INSERT_EFFECT), effect_params(ctx, "tx", str(n)))
    stopped = _work(ctx, hold) if hold > 0 else ctx.cancelled
    return done(ctx, token, cut_short=stopped)


KEY_ACCOUNTS = 8  # accounts the keyed jobs share: contention, yet room for their share
KEYED = {
    "concurrency_key": "acct:{account}",
    "concurrency_limit": 1,
    "retries": RETRIES,
    "backoff": QUICK,
}


def _keyed(ctx: errands.Context, account: int, seconds: float) -> dict[str, Any]:
    token = record(ctx, detail=f"acct:{account}")
    time.sleep(seconds)
    record(ctx, "end", f"acct:{account}")
    return done(ctx, token)


# Issue 19: a fair queue with a noisy tenant. The workload sends quiet tenants' jobs in
# the mix and, now and then, a burst of the noisy tenant's: a quiet job must not wait
# behind the burst (the checker's starvation bound), and every claim's worker time is
# folded into its key once (no fair slot leaked).
TENANTS_QUEUE = "tenants"
QUIET_TENANTS = 5
NOISY = "noisy"
app.queue(TENANTS_QUEUE, fair=True)


@app.job(
    name="soak.tenant",
    queue=TENANTS_QUEUE,
    fair_key="tenant:{tenant}",
    retries=RETRIES,
    backoff=QUICK,
)
def tenant(ctx: errands.Context, n: int, tenant: str, seconds: float) -> dict[str, Any]:
    token = record(ctx, detail=f"tenant:{tenant}")
    time.sleep(seconds)
    return done(ctx, token)


@app.job(name="soak.plain", queue="plain", retries=RETRIES, backoff=QUICK)
def plain(ctx: errands.Context, n: int) -> dict[str, Any]:
    """A job of a queue no keyed job type declares; keyed jobs are moved into it too."""
    return done(ctx, record(ctx))


@app.job(name="soak.keyed_a", queue="keys_a", **KEYED)  # type: ignore[arg-type]
def keyed_a(ctx: errands.Context, n: int, account: int, seconds: float) -> dict[str, Any]:
    """One job per account at a time, whatever its queue: keyed_a and keyed_b share the
    key template in different queues, and the workload moves some of each to the other's
    queue or to the ``plain`` queue (which no keyed job type declares) (issue 16 A5)."""
    return _keyed(ctx, account, seconds)


@app.job(name="soak.keyed_b", queue="keys_b", **KEYED)  # type: ignore[arg-type]
def keyed_b(ctx: errands.Context, n: int, account: int, seconds: float) -> dict[str, Any]:
    return _keyed(ctx, account, seconds)


UNIQUE_FOR = 0.5  # seconds the key of a uniq_retry job is unique
UNIQUE_RETRY_BACKOFF = 1.5  # > UNIQUE_FOR: the retry comes after the key was released


@app.job(name="soak.uniq_retry", retries=RETRIES, backoff=UNIQUE_RETRY_BACKOFF)
def uniq_retry(ctx: errands.Context, n: int) -> dict[str, Any]:
    """Enqueued with ``unique_for``; fails its first attempt, and its retry comes after
    the key expired, when the workload has enqueued the same key again (a second job).
    Records ``ctx.idempotency_key``: the same on every attempt, never another job's (A6)."""
    token = record(ctx, detail=ctx.idempotency_key)
    if ctx.attempt == 1:
        raise RuntimeError("uniq_retry: failing the first attempt")
    return done(ctx, token, idem=ctx.idempotency_key)


def raising_backoff(attempt: int) -> float:
    raise ZeroDivisionError(f"soak: a backoff policy that raises (attempt {attempt})")


@app.job(name="soak.bad_backoff", retries=RETRIES, backoff=raising_backoff)
def bad_backoff(ctx: errands.Context, n: int) -> dict[str, Any]:
    """Fails its first attempt with a backoff callable that raises: errands falls back to
    its default policy; the job must neither wedge nor stop the leader (A1)."""
    token = record(ctx)
    if ctx.attempt == 1:
        raise RuntimeError("bad_backoff: failing the first attempt")
    return done(ctx, token)


HOOK_SLOW = 1.5  # seconds the on_dead hook takes for soak.hooked jobs


@app.job(name="soak.hooked", retries=RETRIES, backoff=QUICK)
def hooked(ctx: errands.Context, n: int) -> None:
    """Dies at once; its on_dead hook is slow (A7: hooks run off the worker's threads)."""
    record(ctx)
    raise errands.Permanent(f"hooked job {n}: dies so that its slow on_dead hook runs")


@app.on_dead
def on_dead(job: errands.Job) -> None:
    """Every dead job's hook appends a ``hook`` row; soak.hooked's takes HOOK_SLOW s."""
    if job.name == "soak.hooked":
        time.sleep(HOOK_SLOW)
    fx = effects()
    with fx.transaction() as conn:
        conn.execute(
            fx.sql(INSERT_EFFECT),
            (job.id, job.attempt, None, "hook", job.name, os.getpid(), "hook", None, None,
             job.state),
        )  # fmt: skip


SIGNAL = "go"
SIGNAL_NEVER_TIMEOUT = 0.5


@app.job(name="soak.signalled", retries=RETRIES, backoff=QUICK)
def signalled(ctx: errands.Context, n: int) -> dict[str, Any]:
    """Waits for signal ``go``, which the workload sends (sometimes before the wait).
    Suspended runs write nothing: the ``run`` row comes after the wait returned."""
    payload = ctx.wait_for_signal(SIGNAL, timeout=600)
    token = record(ctx, detail=str(payload))
    return done(ctx, token, payload=payload)


@app.job(name="soak.signal_never", retries=1, backoff=QUICK)
def signal_never(ctx: errands.Context, n: int) -> None:
    """Waits for a signal nobody sends: each wait times out (kind signal_timeout), an
    attempt charged without a run; dead after its 2 attempts."""
    ctx.wait_for_signal("never", timeout=SIGNAL_NEVER_TIMEOUT)
    record(ctx)


# -- workflows (issue 18; tests/soak/workflows.py) ---------------------------------------------
@app.job(name="soak.wf_callback", retries=RETRIES, backoff=QUICK)
def wf_callback(ctx: errands.Context, event: str) -> dict[str, Any]:
    """A workflow's callback: records the workflow's status as it saw it (none of its
    members may still be pending when a callback runs: never early)."""
    status = ctx.workflow()
    seen = {"event": event, "state": status.state, "pending": status.pending}
    return done(ctx, record(ctx, detail=json.dumps(seen)))


@app.job(name="soak.wf_grow", retries=RETRIES, backoff=QUICK)
def wf_grow(ctx: errands.Context, n: int, adds: int) -> dict[str, Any]:
    """A member that adds ``adds`` members (``soak.fast``) to its own workflow, then fails
    its first attempt: a failed (or lost) attempt adds nothing, so the workflow must end
    with exactly ``adds`` added members, each completed before its callbacks (W7, W4)."""
    token = record(ctx)
    for i in range(adds):
        ctx.add_to_workflow(fast.bind(n=n * 100 + i))
    if ctx.attempt == 1:
        raise RuntimeError("wf_grow: failing the first attempt after adding its members")
    return done(ctx, token)
