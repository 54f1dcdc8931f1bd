"""An app whose handlers hold ``ctx.transaction()`` open (the connection budget tests).

The handler writes its effect row *inside* the completion transaction (so the row exists
iff the job completed: effect once, RELIABILITY I3), then keeps the transaction open for
``hold`` seconds, longer than a heartbeat interval (lease 4 s: a heartbeat every 1.3 s,
which a loaded 2-core machine answers in time; at 2 s it sometimes did not),
watching ``ctx.cancelled``: a worker that cannot renew its leases stops it, and the
attempt fails with the reason, which the test then finds on the job.
"""

from __future__ import annotations

import os
import time

import errands
from errands.backends.postgres.config import parse_postgres_url

LEASE = 4.0

app = errands.App(lease=LEASE, poison_after=20)


def _effects_table() -> str:
    return f'"{parse_postgres_url(os.environ["ERRANDS_URL"]).schema}".effects'


@app.job(name="hold_tx", retries=2, backoff=0.1)
def hold_tx(ctx: errands.Context, n: int = 0, hold: float = 0.0) -> int:
    tx = ctx.transaction()
    tx.execute(
        f"INSERT INTO {_effects_table()} (job_id, attempt, pid, worker) VALUES (%s, %s, %s, %s)",
        (ctx.job_id, ctx.attempt, os.getpid(), ctx.worker_id),
    )
    deadline = time.monotonic() + hold
    while time.monotonic() < deadline:
        if ctx.cancelled:
            raise RuntimeError(f"stopped: {ctx.cancel_reason}")
        time.sleep(0.02)
    return n
