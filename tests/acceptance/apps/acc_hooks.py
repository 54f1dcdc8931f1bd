"""An app with an on_dead hook that records each call in the effects table (kind
``hook``, the pid that ran it), a job that dies at once, and a short grace after which
the maintenance leader runs the hooks no worker marked done."""

from __future__ import annotations

import os
import time

from acc_support import _conn

import errands

app = errands.App(lease=2.0, hook_timeout=1.0, dead_hooks_grace=2.0)


@app.job(name="hooks_doomed", retries=0)
def doomed(n: int) -> None:
    raise errands.Permanent(f"job {n} dies at once")


@app.on_dead
def record_hook(job: errands.Job) -> None:
    _conn().execute(
        "INSERT INTO effects (job_id, attempt, pid, worker, kind, at) VALUES (?, ?, ?, ?, ?, ?)",
        (job.id, job.attempt, os.getpid(), "", "hook", time.time()),
    )
