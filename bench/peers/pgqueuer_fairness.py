"""The noisy-neighbour benchmark's peer run (issue 19): pgqueuer, in its own venv.

The same traffic as bench/fairness.py's dwell runs: tenant ``noisy`` dumps a backlog of
``backlog`` jobs, then ``quiet`` tenants each send one job a second for ``seconds``, all
jobs of ``work`` seconds, into one entrypoint run ``concurrency`` at a time
(``concurrency_limit``, enforced by pgqueuer in SQL) by one in-process worker. pgqueuer
has no fair claiming (it orders by priority, then id), so this is what its users get:
the quiet tenants wait behind the backlog. Dwell is enqueue to the handler's start, one
clock (this process). Prints one JSON document.

pgqueuer runs at its default batch size (10; at most ``concurrency``), not the 100 its
performance guide gives for throughput: the quiet tenants' wait comes from its claim order
(priority, then id), which no batch size changes; a larger batch only claims more of the
backlog ahead of them. The result shape mirrors bench/fairness.py's ``quiet_dwell`` (this
script runs in pgqueuer's venv and cannot import the bench package).

    python pgqueuer_fairness.py '{"url": "postgresql://...", "backlog": 20000, ...}'
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from typing import Any

import asyncpg
from pgqueuer import PgQueuer
from pgqueuer.db import AsyncpgDriver
from pgqueuer.models import Job
from pgqueuer.queries import Queries

CHUNK = 1000


def _pct(values: list[float], pct: float) -> float | None:
    if not values:
        return None
    index = min(len(values) - 1, max(0, math.ceil(pct / 100 * len(values)) - 1))
    return round(values[index], 4)


async def _run(spec: dict[str, Any]) -> dict[str, Any]:
    url, work = spec["url"], float(spec["work"])
    setup = await asyncpg.connect(url)
    queries = Queries(AsyncpgDriver(setup))
    await queries.install()
    await setup.execute("ANALYZE")
    dwell: dict[str, list[float]] = {}
    started: set[int] = set()

    worker_conn = await asyncpg.connect(url)
    pgq = PgQueuer(AsyncpgDriver(worker_conn))

    @pgq.entrypoint("job", concurrency_limit=int(spec["concurrency"]))
    async def job(job: Job) -> None:
        start = time.time()
        body = json.loads(job.payload or b"{}")
        dwell.setdefault(body["tenant"], []).append(start - body["sent"])
        started.add(body["seq"])
        await asyncio.sleep(work)

    now = time.time()
    backlog = int(spec["backlog"])
    for first in range(0, backlog, CHUNK):
        seqs = range(first, min(backlog, first + CHUNK))
        payloads = [json.dumps({"tenant": "noisy", "sent": now, "seq": n}).encode() for n in seqs]
        await queries.enqueue(["job"] * len(payloads), payloads, [0] * len(payloads))
    await setup.execute("ANALYZE")

    producer_conn = await asyncpg.connect(url)
    producer = Queries(AsyncpgDriver(producer_conn))
    sent: list[tuple[int, float]] = []

    async def quiet_traffic() -> None:
        seq, t0, tick = 1_000_000_000, time.time(), 0
        while time.time() - t0 < spec["seconds"]:
            for i in range(spec["quiet"]):
                pause = t0 + tick + i / spec["quiet"] - time.time()
                if pause > 0:
                    await asyncio.sleep(pause)
                seq += 1
                at = time.time()
                body = json.dumps({"tenant": f"quiet{i}", "sent": at, "seq": seq}).encode()
                await producer.enqueue("job", body)
                sent.append((seq, at))
            tick += 1

    t0 = time.time()
    worker = asyncio.create_task(pgq.run(batch_size=min(10, int(spec["concurrency"]))))
    await quiet_traffic()
    grace = time.time() + spec["grace"]
    while time.time() < grace and not all(seq in started for seq, _ in sent):
        await asyncio.sleep(0.05)
    end = time.time()
    pgq.shutdown.set()
    await asyncio.wait_for(worker, timeout=60)
    for conn in (setup, worker_conn, producer_conn):
        await conn.close()
    dwells = [d for tenant, ds in dwell.items() if tenant != "noisy" for d in ds]
    waiting = [end - at for seq, at in sent if seq not in started]
    every = sorted(dwells + waiting)
    noisy = len(dwell.get("noisy", []))
    return {
        "queue": "pgqueuer",
        "backlog": backlog,
        "quiet_jobs": len(sent),
        "quiet_not_started": len(waiting),
        "quiet_dwell_p50": _pct(every, 50),
        "quiet_dwell_p99": _pct(every, 99),
        "quiet_dwell_p99_is_lower_bound": bool(waiting),
        "noisy_started": noisy,
        "throughput_per_s": (noisy + len(dwells)) / max(end - t0, 1e-9),
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(_run(json.loads(sys.argv[1])))))
