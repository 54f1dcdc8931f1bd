"""An app whose job touches nothing outside errands: for tests that run a worker in the
test process with child processes (forked from a forkserver that may have started, with
the environment of its time, before the test set any)."""

from __future__ import annotations

import os

import errands

app = errands.App()


@app.job(name="plain_pid", retries=3, backoff=0.05)
def plain_pid(n: int) -> dict[str, int]:
    return {"n": n, "pid": os.getpid()}
