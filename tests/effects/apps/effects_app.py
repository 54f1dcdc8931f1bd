"""The app the effects tests run in real ``errands worker`` processes.

The job store comes from ``ERRANDS_URL``; the fake payment provider's tables from
``EFFECTS_URL`` (on SQLite a separate file, on PostgreSQL the test's own schema), always
through a connection of their own. The lease is short so that killed workers' jobs come
back within a second or two, and retries and poison headroom are generous so that only a
real loss — never the storm itself — can keep a job from completing.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

from effects_store import EffectsStore

import errands

app = errands.App(lease=1.0, poison_after=1000)

_effects: EffectsStore | None = None


def effects() -> EffectsStore:
    global _effects
    if _effects is None:
        _effects = EffectsStore(os.environ["EFFECTS_URL"])
    return _effects


def psp_charge(order_id: int, idempotency_key: str, attempt: int) -> dict[str, Any]:
    """A payment provider that honours idempotency keys: one call, one transaction that logs
    the call and creates the charge unless this key already has one; returns the charge."""
    store = effects()
    with store.transaction() as tx:
        tx.execute(
            "INSERT INTO psp_calls (order_id, idempotency_key, attempt, pid) "
            "VALUES (%s, %s, %s, %s)",
            (order_id, idempotency_key, attempt, os.getpid()),
        )
        tx.execute(
            "INSERT INTO charges (order_id, idempotency_key, amount) VALUES (%s, %s, %s) "
            "ON CONFLICT (idempotency_key) DO NOTHING",
            (order_id, idempotency_key, 100 + order_id),
        )
        (charge_id,) = tx.execute(
            "SELECT id FROM charges WHERE idempotency_key = %s", (idempotency_key,)
        )[0]
    return {"charge_id": charge_id, "order_id": order_id}


@app.job(name="pay", retries=1000, backoff=0.05)
def pay(ctx: errands.Context, order_id: int) -> dict[str, Any]:
    """Charge an order once: the charge is a durable step keyed by ctx.idempotency_key."""
    charge = ctx.step("charge", psp_charge, order_id, ctx.idempotency_key, ctx.attempt)
    # Between the step and the completion: the after_step fault point and random SIGKILLs
    # both land here too.
    time.sleep(random.uniform(0.0, 0.01))
    return dict(charge)


@app.job(name="wf_step", retries=1000, backoff=0.05)
def wf_step(ctx: errands.Context, n: int, grow: int = 0) -> int:
    """A workflow member: records its run and any parent not completed (none may be),
    and with ``grow`` adds one more member to its own workflow, which adds the next."""
    early = [p.node for p in ctx.parent_results(limit=1000) if p.state != "completed"]
    effects().execute(
        "INSERT INTO wf_runs (job_id, workflow_id, early) VALUES (%s, %s, %s)",
        (ctx.job_id, ctx.workflow_id, ",".join(early)),
    )
    if grow:
        ctx.add_to_workflow(wf_step.bind(n=n + 1, grow=grow - 1))
    time.sleep(random.uniform(0.0, 0.005))
    return n


@app.job(name="wf_callback", retries=1000, backoff=0.05)
def wf_callback(ctx: errands.Context, event: str) -> None:
    """A workflow callback: records its run and the members still pending (must be 0)."""
    status = ctx.workflow()
    effects().execute(
        "INSERT INTO wf_callbacks (job_id, workflow_id, event, pending) VALUES (%s, %s, %s, %s)",
        (ctx.job_id, status.id, event, status.pending),
    )


@app.job(name="tx_write", retries=1000, backoff=0.05)
def tx_write(ctx: errands.Context, n: int) -> int:
    """Write the effect row through ctx.transaction(): it commits with the completion."""
    conn = ctx.transaction()
    table = EffectsStore.qualified(os.environ["ERRANDS_URL"], "tx_effects")
    sql = f"INSERT INTO {table} (job_id, n, attempt) VALUES (%s, %s, %s)"
    params = (ctx.job_id, n, ctx.attempt)
    if EffectsStore.is_sqlite(os.environ["ERRANDS_URL"]):
        conn.execute(sql.replace("%s", "?"), params)
    else:
        conn.execute(sql, params)
    return n
