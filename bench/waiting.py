"""Issue 20's figures: result wake-up latency, waiters per connection, async enqueue.

    python -m bench.waiting                 # PostgreSQL (BENCH_PG_URL) and SQLite
    python -m bench.waiting --quick         # small counts, a few seconds (preliminary)

- **wake-up latency**: a job's completion is committed (a claim and a fenced finish, as
  a worker writes it) while ``handle.result()`` waits in another thread; the figure is the
  time from the commit's return to the waiter's return, p50 and p99 over N jobs.
- **waiters per connection**: N asyncio tasks await ``aresult`` on N jobs at once; the
  figure is how many connections the process holds for *waiting* (PostgreSQL: sessions
  with application name ``errands-results:<pid>``), and how long all take to return once the
  jobs are completed in bulk.
- **async enqueue**: jobs per second from one event loop: ``aenqueue`` without ``conn=``
  (64 in flight), ``aenqueue(conn=AsyncConnection)`` in one transaction per job, beside
  the sync ``enqueue`` loop of the same process.

Writes ``bench/results/waiting.json`` (or ``--results DIR``). The machine is shared and
the figures come from short runs: treat them as preliminary. Peers (procrastinate's
``defer_async``, pgqueuer's async enqueue) are not measured here yet.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import errands
from errands.backends.base import ClaimParams, FinishParams, QueueClaim

RESULTS = Path(__file__).resolve().parent / "results"
PG_URL_DEFAULT = "postgresql://postgres@127.0.0.1:5432/postgres"


def _app(url: str) -> errands.App:
    app = errands.App(url)

    @app.job(name="bench.noop", queue="bench")
    def noop(n: int) -> int:
        return n

    app.migrate()
    return app


def _complete(app: errands.App, count: int) -> None:
    """Claim and complete up to ``count`` due jobs, as a worker's completer would."""
    backend = app.backend
    while count > 0:
        rows = backend.job_claim(
            ClaimParams([QueueClaim("bench", min(count, 500))], min(count, 500), "bench", 30.0)
        )
        if not rows:
            return
        backend.job_finish_many(
            [FinishParams(r.id, r.lease_token or "", "completed", result_json="1") for r in rows]
        )
        count -= len(rows)


def wake_latency(app: errands.App, jobs: int) -> dict[str, Any]:
    noop = app.registry["bench.noop"]
    assert app.results.ready(), "the store's watcher did not start listening"
    samples = []
    for n in range(jobs):
        handle = noop.enqueue(n=n)
        (row,) = app.backend.job_claim(ClaimParams([QueueClaim("bench", 1)], 1, "bench", 30.0))
        returned: list[float] = []
        waiting = threading.Event()
        thread = threading.Thread(target=_wait, args=(handle, waiting, returned))
        thread.start()
        waiting.wait()
        time.sleep(0.005)  # let the waiter read its job and block
        app.backend.job_finish_many(
            [FinishParams(row.id, row.lease_token or "", "completed", result_json="1")]
        )
        committed = time.perf_counter()
        thread.join(30)
        samples.append((returned[0] - committed) * 1000)
    samples.sort()
    return {
        "jobs": jobs,
        "p50_ms": round(statistics.median(samples), 3),
        "p99_ms": round(samples[min(len(samples) - 1, int(len(samples) * 0.99))], 3),
        "max_ms": round(samples[-1], 3),
    }


def _wait(handle: errands.JobHandle, waiting: threading.Event, returned: list[float]) -> None:
    waiting.set()
    handle.result(timeout=30, poll=60.0)  # a poll this long: only a wake-up returns it
    returned.append(time.perf_counter())


def many_waiters(app: errands.App, waiters: int) -> dict[str, Any]:
    noop = app.registry["bench.noop"]
    handles = app.enqueue_many([noop.bind(n=i) for i in range(waiters)])

    async def scenario() -> dict[str, Any]:
        tasks = [asyncio.create_task(h.aresult(timeout=300, poll=60.0)) for h in handles]
        while app.results.waiting() < waiters:  # every task registered
            await asyncio.sleep(0.05)
        listening = _waiting_connections(app)
        started = time.perf_counter()
        await asyncio.to_thread(_complete, app, waiters)
        await asyncio.gather(*tasks)
        return {
            "waiters": waiters,
            "waiting_connections": listening,
            "all_returned_s": round(time.perf_counter() - started, 3),
        }

    return asyncio.run(scenario())


def _waiting_connections(app: errands.App) -> int | None:
    if not app.url.startswith("postgres"):
        return None  # SQLite: one watcher thread, no server connection
    import psycopg

    with psycopg.connect(app.backend.config.conninfo, autocommit=True) as conn:  # type: ignore[attr-defined]
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
            (f"errands-results:{os.getpid()}",),
        ).fetchone()
    return int(row[0]) if row else 0


def enqueue_rates(app: errands.App, jobs: int) -> dict[str, Any]:
    noop = app.registry["bench.noop"]
    started = time.perf_counter()
    for n in range(jobs):
        noop.enqueue(n=n)
    sync_rate = jobs / (time.perf_counter() - started)

    async def many() -> float:
        gate = asyncio.Semaphore(64)

        async def one(n: int) -> None:
            async with gate:
                await noop.aenqueue(n=n)

        began = time.perf_counter()
        await asyncio.gather(*(one(n) for n in range(jobs)))
        return jobs / (time.perf_counter() - began)

    result: dict[str, Any] = {
        "jobs": jobs,
        "sync_enqueue_per_s": round(sync_rate),
        "aenqueue_per_s": round(asyncio.run(many())),
    }
    if app.url.startswith("postgres"):
        result["aenqueue_conn_per_s"] = round(asyncio.run(_with_conn(app, jobs)))
    return result


async def _with_conn(app: errands.App, jobs: int) -> float:
    import psycopg

    noop = app.registry["bench.noop"]
    conninfo = app.backend.config.conninfo  # type: ignore[attr-defined]
    async with await psycopg.AsyncConnection.connect(conninfo) as conn:
        began = time.perf_counter()
        for n in range(jobs):
            async with conn.transaction():
                await noop.aenqueue(n=n, conn=conn)
        return jobs / (time.perf_counter() - began)


def run_store(url: str, quick: bool) -> dict[str, Any]:
    app = _app(url)
    try:
        return {
            "wake_latency": wake_latency(app, 50 if quick else 500),
            "many_waiters": many_waiters(app, 1000 if quick else 10_000),
            "enqueue": enqueue_rates(app, 500 if quick else 5000),
        }
    finally:
        app.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts (seconds)")
    parser.add_argument("--pg-url", default=os.environ.get("BENCH_PG_URL", PG_URL_DEFAULT))
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--no-pg", action="store_true", help="SQLite only")
    args = parser.parse_args(argv)
    schema = f"bench_wait_{secrets.token_hex(4)}"
    out: dict[str, Any] = {"preliminary": True, "quick": args.quick}
    with tempfile.TemporaryDirectory() as folder:
        out["sqlite"] = run_store(f"sqlite:///{folder}/wait.db", args.quick)
    if not args.no_pg:
        sep = "&" if "?" in args.pg_url else "?"
        url = f"{args.pg_url}{sep}schema={schema}"
        try:
            out["postgres"] = run_store(url, args.quick)
        finally:
            import psycopg

            with psycopg.connect(args.pg_url, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "waiting.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
