"""The PostgreSQL acceptance tests' app: a short lease so lost workers are noticed fast.

Job names are explicit, so the test process and the worker processes agree on them. The
store comes from ``ERRANDS_URL`` in the workers; the test process points ``app.url`` at
its own schema. Many retries with a quick backoff and a high poison threshold: during a
database restart or a storm of killed connections a job may fail or lose its lease more
than once, and the tests check that it still ends completed, not that it ran out of tries.
"""

from __future__ import annotations

import os
import time
from typing import Any

from pgacc_support import record

import errands

LEASE = 2.0
QUICK_BACKOFF = 0.1

app = errands.App(lease=LEASE, poison_after=20)


@app.job(name="touch", retries=20, backoff=QUICK_BACKOFF)
def touch(ctx: errands.Context, n: int = 0, ms: float = 0.0) -> int:
    """Record the execution, then work for ``ms`` milliseconds."""
    record(ctx)
    if ms:
        time.sleep(ms / 1000)
    return n


@app.job(name="bulk", lease=30)
def bulk(ctx: errands.Context, n: int = 0) -> int:
    """``touch`` with a 30 s lease: for runs that inject no fault, so even a CPU-starved
    machine cannot lose a lease and every job must run exactly once."""
    record(ctx)
    return n


@app.job(name="sleepy", retries=20, backoff=QUICK_BACKOFF)
def sleepy(ctx: errands.Context, seconds: float, first_only: bool = False) -> dict[str, Any]:
    """Sleep ``seconds`` ignoring cancellation (like a blocking call); with ``first_only``
    only on attempt 1, so a rescued retry finishes at once."""
    record(ctx)
    if not first_only or ctx.attempt == 1:
        time.sleep(seconds)
    return {"attempt": ctx.attempt, "pid": os.getpid(), "worker": ctx.worker_id}


@app.job(name="patient", retries=20, backoff=QUICK_BACKOFF)
def patient(ctx: errands.Context, wait: float = 30.0) -> dict[str, Any]:
    """On attempt 1, work until the worker asks it to stop (``ctx.cancelled``), then give
    up with an error; later attempts finish at once."""
    record(ctx)
    if ctx.attempt == 1:
        deadline = time.monotonic() + wait
        while not ctx.cancelled and time.monotonic() < deadline:
            time.sleep(0.02)
        raise RuntimeError(f"stopped: {ctx.cancel_reason or 'deadline'}")
    return {"attempt": ctx.attempt, "worker": ctx.worker_id}
