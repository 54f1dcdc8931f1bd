"""Bulk dead-letter actions over many dead jobs: how long they take, and what the rest of
the application can do meanwhile.

    python -m bench.dlq_bulk                     # 100,000 dead jobs, PostgreSQL and SQLite
    python -m bench.dlq_bulk --count 1000000 --backend sqlite

For each backend: a fresh store (PostgreSQL: a scratch schema, dropped after; SQLite: a
file in a temporary directory) with ``--count`` dead jobs (inserted, then made dead by
one UPDATE: the death trigger records their on_dead hooks as a worker's finish would),
then, each timed, ``app.replay(all=True, dry_run=True)``, ``app.replay(all=True)`` and,
once they are dead again, ``app.discard(all=True, reason=...)``. Meanwhile another
process enqueues one job every 20 ms through its own App: the figures are how many of
its enqueues overlapping the action went through, how many failed (DatabaseBusy, a
timeout), and the slowest one.

The machine is shared: the figures are one run's, to compare an old and a new version of
the same code on the same machine, not absolute.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import secrets
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import errands

PG_URL_DEFAULT = "postgresql://postgres@127.0.0.1:5432/postgres"
SEED_CHUNK = 10_000
ERRORS = '[{"attempt": 1, "type": "ValueError", "message": "boom"}]'


def _app(url: str) -> errands.App:
    app = errands.App(url)
    _apps_jobs.clear()

    @app.job(name="bench.dlq", queue="bench", retries=0)
    def doomed(n: int) -> None:
        raise ValueError(n)

    @app.job(name="bench.side", queue="side")
    def side(n: int) -> None:
        pass

    _apps_jobs.update(dlq=doomed, side=side)
    return app


_apps_jobs: dict[str, Any] = {}


def _enqueuer(url: str, ready: Any, stop: Any, out: Any) -> None:
    """Another process of the application: one enqueue every 20 ms until ``stop``; each
    one's start, end (wall clock) and whether it failed, put on ``out``."""
    app = _app(url)
    side = _apps_jobs["side"]
    side.enqueue(n=-1)
    ready.set()
    calls: list[tuple[float, float, bool]] = []
    n = 0
    while not stop.is_set():
        started = time.time()
        try:
            side.enqueue(n=n)
            ok = True
        except Exception:  # counted: DatabaseBusy, a timeout
            ok = False
        calls.append((started, time.time(), ok))
        n += 1
        time.sleep(0.02)
    out.put(calls)
    app.close()


def _seed(app: errands.App, count: int, pg: bool) -> None:
    backend = app.backend
    for start in range(0, count, SEED_CHUNK):
        n = min(SEED_CHUNK, count - start)
        app.enqueue_many([_apps_jobs["dlq"].bind(n=start + i) for i in range(n)])
    _make_dead(backend, pg)


def _make_dead(backend: Any, pg: bool) -> None:
    if pg:
        import psycopg

        with psycopg.connect(backend.config.conninfo, autocommit=True) as conn:
            conn.execute(
                f"UPDATE \"{backend.schema}\".errands_jobs SET state = 'dead', attempt = 1, "
                "finished_at = now(), errors = %s::jsonb WHERE queue = 'bench'",
                (ERRORS,),
            )
            conn.execute(f'VACUUM ANALYZE "{backend.schema}".errands_jobs')
    else:
        import sqlite3

        conn = sqlite3.connect(backend.path, isolation_level=None)
        conn.execute(
            "UPDATE errands_jobs SET state = 'dead', attempt = 1, "
            "finished_at = (julianday('now') - 2440587.5) * 86400.0, errors = ? "
            "WHERE queue = 'bench'",
            (ERRORS,),
        )
        conn.execute("ANALYZE")
        conn.close()


def _timed(url: str, action: Callable[[], Any]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    side = ctx.Process(target=_enqueuer, args=(url, ready, stop, out), daemon=True)
    side.start()
    try:
        if not ready.wait(120):
            raise RuntimeError("the enqueueing process did not start")
        time.sleep(0.2)
        started = time.time()
        result = action()
        ended = time.time()
    finally:
        stop.set()
    calls = out.get(timeout=600)
    side.join(30)
    during = [(s, e, ok) for s, e, ok in calls if e >= started and s <= ended]
    return {
        "seconds": round(ended - started, 2),
        "matched": len(result.matched),
        "enqueues_meanwhile": sum(ok for _, _, ok in during),
        "failed": sum(not ok for _, _, ok in during),
        "slowest_enqueue_s": round(max((e - s for s, e, _ in during), default=0.0), 3),
    }


def run(url: str, count: int, pg: bool) -> dict[str, Any]:
    app = _app(url)
    app.migrate()
    started = time.monotonic()
    _seed(app, count, pg)
    print(f"  seeded {count} dead jobs in {time.monotonic() - started:.1f} s", flush=True)
    figures: dict[str, Any] = {}
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("dry_run", lambda: app.replay(all=True, queue="bench", dry_run=True, actor="bench")),
        ("replay", lambda: app.replay(all=True, queue="bench", actor="bench")),
        ("discard", lambda: app.discard(all=True, queue="bench", reason="bench", actor="bench")),
    ]
    for label, action in steps:
        if label == "discard":
            _make_dead(app.backend, pg)
        figures[label] = _timed(url, action)
        print(f"  {label}: {json.dumps(figures[label])}", flush=True)
    app.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--backend", choices=("both", "postgres", "sqlite"), default="both")
    parser.add_argument("--pg-url", default=os.environ.get("BENCH_PG_URL", PG_URL_DEFAULT))
    args = parser.parse_args()
    results: dict[str, Any] = {"count": args.count}
    if args.backend in ("both", "postgres"):
        import psycopg

        schema = f"bench_dlq_{secrets.token_hex(4)}"
        print(f"PostgreSQL ({schema}):", flush=True)
        try:
            results["postgres"] = run(f"{args.pg_url}?schema={schema}", args.count, pg=True)
        finally:
            with psycopg.connect(args.pg_url, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    if args.backend in ("both", "sqlite"):
        with tempfile.TemporaryDirectory() as tmp:
            print("SQLite:", flush=True)
            results["sqlite"] = run(f"sqlite:///{Path(tmp) / 'dlq.db'}", args.count, pg=False)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
