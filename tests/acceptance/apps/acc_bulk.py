"""The app for the many-processes test: the default 30 s lease, so only a real double
claim (never a lease lost to an overloaded CI machine) could run a job twice."""

from __future__ import annotations

from acc_support import record

import errands

app = errands.App()


@app.job(name="bulk_noop")
def bulk_noop(ctx: errands.Context, n: int) -> int:
    record(ctx)
    return n
