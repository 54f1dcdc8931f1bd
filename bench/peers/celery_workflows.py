"""Celery's side of ``bench.workflows``: the same shapes as Celery's canvas, on Redis.

Runs in Celery's bench venv (``bench.systems.python_for``) from this folder; starts a
``celery worker -P threads -c 8`` (errands' bench worker runs ``-c 8`` too) with Redis as
broker and result backend (a chord needs one), measures, and prints what it measured
as JSON (``bench.workflows`` makes the figures of it):

- **fan-in latency**: a ``chord`` of ``--width`` no-op members and a body, one at a
  time: from the last member's return (``time.time()`` at its end) to the body starting;
- **fan-out/fan-in**: ``chain(member, chord([member] * fan, body))``: members per second
  from ``apply_async`` to the body's result;
- **chain**: ``chain(step, step, ...)``: steps per second, likewise.

    BENCH_REDIS_URL=redis://127.0.0.1:6379/3 python bench/peers/celery_workflows.py \
        --batches 20 --fan 200 --chain 50
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _probe
from celery import Celery, chain, chord

HERE = Path(__file__).resolve().parent
URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/3")

app = Celery("bench_wf", broker=URL, backend=URL)
app.conf.task_default_queue = "bench_wf"
app.conf.worker_hijack_root_logger = False
app.conf.result_expires = 3600


@app.task(name="wf.member")
def member() -> float:
    """A member that does nothing: when it ended."""
    return time.time()


@app.task(name="wf.body")
def body(ends: list[float]) -> float:
    """The chord's body: seconds from the last member's end to this start."""
    return time.time() - max(ends)


@app.task(name="wf.done")
def done() -> None:
    """A body or step that does nothing."""


def fan_in_latency(batches: int, width: int) -> list[float]:
    return [
        float(chord([member.s() for _ in range(width)], body.s())().get(timeout=120))
        for _ in range(batches)
    ]


def fan_out_fan_in(width: int) -> float:
    start = time.monotonic()
    flow = chain(member.si(), chord([member.si() for _ in range(width)], done.si()))
    flow.apply_async().get(timeout=1800)
    return (width + 2) / (time.monotonic() - start)


def steps(length: int) -> float:
    start = time.monotonic()
    chain(*(done.si() for _ in range(length))).apply_async().get(timeout=1800)
    return length / (time.monotonic() - start)


def worker(folder: str) -> _probe.Workers:
    argv = [sys.executable, "-m", "celery", "-A", "celery_workflows", "worker", "-Q",
            "bench_wf", "-P", "threads", "-c", "8", "-l", "warning", "--without-gossip",
            "--without-mingle", "--without-heartbeat"]  # fmt: skip
    env = {"BENCH_REDIS_URL": URL, "BENCH_PROBE_DIR": folder}
    return _probe.Workers([argv], env, str(HERE))


def run(batches: int, width: int, fan: int, length: int) -> dict[str, Any]:
    import redis

    redis.Redis.from_url(URL).flushdb()
    with tempfile.TemporaryDirectory(prefix="bench-celery-wf-") as folder:
        workers = worker(folder)
        try:
            done.delay().get(timeout=120)  # the worker is up
            fan_in_latency(2, width)  # warm up
            waits = fan_in_latency(batches, width)
            fan_rate = fan_out_fan_in(fan)
            chain_rate = steps(length)
        except BaseException:
            print(workers.log_tail(), file=sys.stderr)
            raise
        finally:
            workers.stop()
    return {"waits": waits, "fan_rate": fan_rate, "chain_rate": chain_rate}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--width", type=int, default=10)
    parser.add_argument("--fan", type=int, default=10_000)
    parser.add_argument("--chain", type=int, default=1_000)
    args = parser.parse_args()
    print(json.dumps(run(args.batches, args.width, args.fan, args.chain)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
