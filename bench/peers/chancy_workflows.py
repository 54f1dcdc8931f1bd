"""Chancy's side of ``bench.workflows``: the same shapes as Chancy workflows, on PostgreSQL.

Runs in Chancy's bench venv (``bench.systems.python_for``) from this folder, against a
database of its own (``BENCH_CHANCY_URL``, made afresh by ``bench.workflows``); starts one
Chancy worker process (this file with ``--serve``) and measures from this one, printing
what it measured as JSON (``bench.workflows`` makes the figures of it). Chancy 0.26's
workflows (``chancy.plugins.workflow``: a ``Workflow`` of steps with ``dependencies``,
advanced by the leader worker's ``WorkflowPlugin``) express every shape:

- **fan-in latency**: a workflow of ``--width`` no-op members and a callback step that
  depends on them all, one at a time, each after a random pause of up to one update
  period (below): from the last member's completion (its ``completed_at``, which
  Chancy's executor stamps when the handler returns) to the callback's handler starting
  (``time.time()`` in the worker; one machine);
- **fan-out/fan-in**: a root step, ``--fan`` members that depend on it, a last step that
  depends on them all: members per second from the push to the last step's completion;
- **chain**: ``--chain`` steps each depending on the one before (what Chancy's
  ``Sequence`` builds): steps per second, likewise.

The settings (bench.systems CHANCY): one queue with the ``AsyncExecutor`` (async no-op
jobs), ``concurrency=8`` (errands' and Celery's workflow workers run 8 too),
``eager_polling=True``; log level WARNING. Everything else is Chancy's default, including
the default plugins (leadership, workflows, recovery, pruner, metrics) and the worker's
job-update batching (``send_outgoing_interval`` 1 s), unless ``--send-outgoing-interval``
sets it: a finished job's state reaches the database, and so the workflow plugin, only
with the next batch.

    BENCH_CHANCY_URL=postgresql://postgres@127.0.0.1:5432/bench_chancy \
        python bench/peers/chancy_workflows.py --batches 20 --fan 200 --chain 50
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from chancy import Chancy, Job, Queue, Worker
from chancy.plugins.workflow import Workflow, WorkflowPlugin

HERE = Path(__file__).resolve().parent
URL = os.environ.get("BENCH_CHANCY_URL", "postgresql://postgres@127.0.0.1:5432/bench_chancy")
QUEUE = "bench_wf"
MODULE = "chancy_workflows"  # the name the worker imports this file by (cwd = bench/peers)


async def member() -> None:
    """A member that does nothing: what is measured is the queue's work."""


async def callback(tag: str) -> None:
    """The fan-in's callback: write when its handler started, for the driver to read."""
    started = time.time()
    with open(os.path.join(os.environ["BENCH_WF_DIR"], "callbacks"), "a") as out:
        out.write(f"{tag} {started!r}\n")


def _job(name: str, **kwargs: Any) -> Job:
    return Job(func=f"{MODULE}.{name}", queue=QUEUE, kwargs=kwargs)


def _app() -> Chancy:
    log = logging.getLogger("bench.chancy")
    log.setLevel(logging.WARNING)
    log.addHandler(logging.StreamHandler(sys.stderr))
    return Chancy(URL, log=log)


async def serve() -> None:
    async with _app() as chancy, Worker(chancy, worker_id=os.environ["BENCH_WORKER_ID"]) as worker:
        if os.environ.get("BENCH_SEND_OUTGOING_INTERVAL"):
            worker.send_outgoing_interval = float(os.environ["BENCH_SEND_OUTGOING_INTERVAL"])
        await worker.wait_for_shutdown()


class Driver:
    def __init__(self, chancy: Chancy, folder: Path) -> None:
        self.chancy = chancy
        self.callbacks = folder / "callbacks"
        self.seen = 0

    async def _one(self, sql: str, *params: Any) -> Any:
        async with self.chancy.pool.connection() as conn, conn.cursor() as cur:
            await cur.execute(sql, params)
            row = await cur.fetchone()
            return row[0] if row else None

    async def wait_leader(self, worker_id: str, timeout: float) -> None:
        """Until the worker leads: Chancy advances workflows on the leader only (the
        Leadership plugin's first attempt comes after its poll interval, 60 s)."""
        deadline = time.monotonic() + timeout
        while not await self._one(
            "SELECT count(*) FROM chancy_leader WHERE worker_id = %s", worker_id
        ):
            if time.monotonic() > deadline:
                raise TimeoutError("no Chancy worker became the leader")
            await asyncio.sleep(0.5)

    async def _callback_started(self, tag: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while True:
            if self.callbacks.exists():
                for line in self.callbacks.read_text().splitlines():
                    name, at = line.split()
                    if name == tag:
                        return float(at)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the callback of {tag} never started")
            await asyncio.sleep(0.005)

    async def fan_in_latency(
        self, batches: int, width: int, prefix: str, updates_s: float
    ) -> list[float]:
        waits = []
        for n in range(batches):
            # The worker writes finished jobs' states every ``updates_s``: a batch pushed
            # the moment the one before it ended would end just after such a write, every
            # time, and wait a whole period for the next. A random pause first samples
            # the timer's phase evenly, as work that arrives on its own would.
            await asyncio.sleep(random.uniform(0, updates_s))
            tag = f"{prefix}-{n}"
            wf = Workflow(tag)
            members = [f"m{i:05d}" for i in range(width)]
            for step in members:
                wf.add(step, _job("member"))
            wf.add("callback", _job("callback", tag=tag), members)
            workflow_id = await WorkflowPlugin.push(self.chancy, wf)
            started = await self._callback_started(tag, 120)
            last = await self._one(
                "SELECT extract(epoch FROM max(j.completed_at)) FROM chancy_workflow_steps s"
                " JOIN chancy_jobs j ON j.id = s.job_id"
                " WHERE s.workflow_id = %s AND s.step_id <> 'callback'",
                workflow_id,
            )
            waits.append(started - float(last))
        return waits

    async def _until_last(self, start: float, workflow_id: str, step: str) -> float:
        """Seconds from ``start`` to the completion of the workflow's step ``step``."""
        while True:
            done = await self._one(
                "SELECT extract(epoch FROM j.completed_at) FROM chancy_workflow_steps s"
                " JOIN chancy_jobs j ON j.id = s.job_id"
                " WHERE s.workflow_id = %s AND s.step_id = %s AND j.state = 'succeeded'",
                workflow_id,
                step,
            )
            if done is not None:
                return float(done) - start
            await asyncio.sleep(0.05)

    async def fan_out_fan_in(self, width: int) -> float:
        wf = Workflow("fan").add("root", _job("member"))
        middle = [f"m{i:05d}" for i in range(width)]
        for step in middle:
            wf.add(step, _job("member"), ["root"])
        wf.add("zlast", _job("member"), middle)
        start = time.time()
        workflow_id = await WorkflowPlugin.push(self.chancy, wf)
        return (width + 2) / await self._until_last(start, workflow_id, "zlast")

    async def chain(self, length: int) -> float:
        wf = Workflow("chain")
        for i in range(length):
            wf.add(f"s{i:05d}", _job("member"), [f"s{i - 1:05d}"] if i else [])
        start = time.time()
        workflow_id = await WorkflowPlugin.push(self.chancy, wf)
        return length / await self._until_last(start, workflow_id, f"s{length - 1:05d}")


def _worker(folder: Path, worker_id: str, updates_s: float | None) -> subprocess.Popen[bytes]:
    env = {**os.environ, "BENCH_WF_DIR": str(folder), "BENCH_CHANCY_URL": URL,
           "BENCH_WORKER_ID": worker_id,
           "BENCH_SEND_OUTGOING_INTERVAL": "" if updates_s is None else str(updates_s)}  # fmt: skip
    err = (folder / "worker.stderr").open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", MODULE, "--serve"],
        cwd=HERE, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
    )  # fmt: skip


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def run(
    batches: int, width: int, fan: int, length: int, updates_s: float | None
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-chancy-wf-") as tmp:
        folder = Path(tmp)
        async with _app() as chancy:
            await chancy.migrate()
            await chancy.declare(
                Queue(
                    QUEUE,
                    concurrency=8,
                    executor=Chancy.Executor.Async,
                    eager_polling=True,
                ),
                upsert=True,
            )
            worker_id = str(uuid.uuid4())
            proc = _worker(folder, worker_id, updates_s)
            try:
                driver = Driver(chancy, folder)
                await driver.wait_leader(worker_id, 300)
                period = 1.0 if updates_s is None else updates_s  # Chancy's default: 1 s
                await driver.fan_in_latency(2, width, "warm", period)  # warm up
                waits = await driver.fan_in_latency(batches, width, "latency", period)
                fan_rate = await driver.fan_out_fan_in(fan)
                chain_rate = await driver.chain(length)
            except BaseException:
                log = folder / "worker.stderr"
                if log.exists():
                    print(log.read_text()[-4000:], file=sys.stderr)
                raise
            finally:
                _stop(proc)
    return {"waits": waits, "fan_rate": fan_rate, "chain_rate": chain_rate}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", action="store_true", help="run the worker")
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--width", type=int, default=10)
    parser.add_argument("--fan", type=int, default=10_000)
    parser.add_argument("--chain", type=int, default=1_000)
    parser.add_argument(
        "--send-outgoing-interval", type=float, help="the worker's update batching, seconds"
    )
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve())
        return 0
    figures = asyncio.run(
        run(args.batches, args.width, args.fan, args.chain, args.send_outgoing_interval)
    )
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
