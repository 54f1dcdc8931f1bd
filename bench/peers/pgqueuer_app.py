"""pgqueuer's side of the benchmark: one async no-op entrypoint; payload = the int."""

import os

import _probe
import asyncpg
from pgqueuer import PgQueuer
from pgqueuer.db import AsyncpgDriver
from pgqueuer.models import Job


async def create() -> PgQueuer:
    connection = await asyncpg.connect(os.environ["BENCH_PG_URL"])
    pgq = PgQueuer(AsyncpgDriver(connection))

    @pgq.entrypoint("noop")
    async def noop(job: Job) -> None:
        _probe.hit(int(job.payload or b"-1"))
        await _probe.awork()

    return pgq


async def _run(batch_size: int) -> None:
    pgq = await create()
    await pgq.run(batch_size=batch_size)


if __name__ == "__main__":
    # ``pgq run`` of pgqueuer 1.6.0 crashes while configuring its logger ('str' object
    # has no attribute 'name'), so the worker runs PgQueuer.run() itself, as pgq would.
    import asyncio
    import sys

    asyncio.run(_run(int(sys.argv[1]) if len(sys.argv) > 1 else 10))
