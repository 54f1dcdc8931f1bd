"""The app for the kill -9 storm: many short jobs, and enough retries and poison headroom
that only a real loss (never the storm itself) can keep a job from completing."""

from __future__ import annotations

import random
import time

from acc_support import record

import errands

app = errands.App(lease=2.0, poison_after=50)


@app.job(name="chaos_work", retries=50, backoff=0.2)
def chaos_work(ctx: errands.Context, n: int) -> int:
    record(ctx)
    time.sleep(random.uniform(0.02, 0.12))
    return n
