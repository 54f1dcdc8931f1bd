"""Celery's side of the benchmark (Redis broker, no result backend)."""

import os

import _probe
from celery import Celery

app = Celery("bench", broker=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/1"))
app.conf.task_default_queue = "bench"
app.conf.worker_hijack_root_logger = False


@app.task(name="noop", ignore_result=True)
def noop(n: int) -> None:
    _probe.hit(n)
    _probe.work()
