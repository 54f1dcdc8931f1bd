"""awa-pg's side of the benchmark: one async no-op task; runs as a worker process."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from dataclasses import dataclass

import _probe
import awa

SCHEMA = "awa_bench"  # the queue-storage schema (awa's fast path), made by the adapter


@dataclass
class Noop:
    n: int


async def _run(concurrency: int) -> None:
    connections = int(os.environ.get("BENCH_AWA_CONNECTIONS", "10"))
    client = awa.AsyncClient(os.environ["BENCH_PG_URL"], max_connections=connections)

    @client.task(Noop, queue="bench")
    async def noop(job: awa.Job[Noop]) -> None:
        _probe.hit(job.args.n)
        await _probe.awork()

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    poll = int(os.environ.get("BENCH_AWA_POLL_MS", "200"))
    await client.start([("bench", concurrency)], queue_storage_schema=SCHEMA, poll_interval_ms=poll)
    await stop.wait()
    await client.shutdown(timeout_ms=5000)
    await client.close()


if __name__ == "__main__":
    asyncio.run(_run(int(sys.argv[1])))
