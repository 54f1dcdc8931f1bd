"""Item 4, the test of scale: claim throughput with 1,000,000 finished rows in the jobs
table against an empty table (a benchmark, never a timed test).

Finished rows are bulk-loaded (COPY on PostgreSQL, executemany on SQLite), then the table
is vacuumed and analysed as autovacuum would. The figure is errands' own
claim-and-complete SQL in a tight loop (see :mod:`bench.limit`), and on PostgreSQL also a
real ``errands worker`` draining a pre-filled queue. The ratio full/empty should stay
above 0.9: retention and partial indexes keep finished rows out of the claim's way.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from . import limit

FINISHED_ROWS = 1_000_000
SCALE_BATCH = 10  # the claim batch of the scale loop


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _pg_reset(url: str, base_id: int) -> None:
    """Back to the loaded state: drop every job added after the bulk load."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DELETE FROM errands_jobs WHERE id > %s", (base_id,))
        conn.execute("VACUUM ANALYZE errands_jobs")


def pg_scale(
    url_for: Callable[[str], str],
    clone: Callable[[str], None],
    jobs: int,
    runs: int,
    finished: int,
    worker: Callable[[str], float] | None,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """``clone(db)`` makes a fresh migrated errands database, ``url_for(db)`` its URL.

    Both tables are made first and then measured in turns (empty, full, empty, ...), so
    a change of load on the machine hits both sides alike.
    """
    import psycopg

    out: dict[str, Any] = {"finished_rows": finished, "batch": SCALE_BATCH}
    urls, base = {}, {}
    for label in ("empty", "full"):
        db = f"bench_scale_{label}"
        clone(db)
        urls[label] = url = url_for(db)
        if label == "full":
            t = time.perf_counter()
            limit.pg_copy_available(url, finished, state="completed")
            out["load_seconds"] = time.perf_counter() - t
            log(f"scale: loaded {finished:,} finished rows in {out['load_seconds']:.1f} s")
        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute("SELECT coalesce(max(id), 0) FROM errands_jobs").fetchone()
            base[label] = row[0] if row else 0
        _pg_reset(url, base[label])
    for label in ("empty", "full"):
        out[f"loop_{label}_runs"] = []
        if worker is not None:
            out[f"worker_{label}_runs"] = []
    for run in range(runs):
        for label in ("empty", "full"):
            out[f"loop_{label}_runs"].append(limit.pg_claim_loop(urls[label], jobs, SCALE_BATCH))
            _pg_reset(urls[label], base[label])
        if worker is not None:
            for label in ("empty", "full"):
                out[f"worker_{label}_runs"].append(worker(urls[label]))
                _pg_reset(urls[label], base[label])
        log(
            f"scale: postgres run {run + 1}: loop empty {out['loop_empty_runs'][-1]:,.0f}, "
            f"full {out['loop_full_runs'][-1]:,.0f} jobs/s"
        )
    for kind in ("loop", "worker") if worker is not None else ("loop",):
        for label in ("empty", "full"):
            out[f"{kind}_{label}"] = _median(out[f"{kind}_{label}_runs"])
        out[f"{kind}_ratio"] = out[f"{kind}_full"] / out[f"{kind}_empty"]
    return out


def sqlite_scale(
    folder: str, jobs: int, runs: int, finished: int, log: Callable[[str], None]
) -> dict[str, Any]:
    out: dict[str, Any] = {"finished_rows": finished, "batch": SCALE_BATCH}
    paths = {label: os.path.join(folder, f"scale-{label}.db") for label in ("empty", "full")}
    for label, path in paths.items():
        limit.sqlite_fresh(path)
        if label == "full":
            limit.sqlite_bulk_insert(path, finished, state="completed")
        conn = limit.sqlite_connect(path)
        conn.execute("ANALYZE")
        conn.close()
        out[f"loop_{label}_runs"] = []
    for run in range(runs):
        for label, path in paths.items():
            conn = limit.sqlite_connect(path)
            row = conn.execute("SELECT coalesce(max(id), 0) FROM errands_jobs").fetchone()
            conn.close()
            out[f"loop_{label}_runs"].append(limit.sqlite_claim_loop(path, jobs, SCALE_BATCH))
            conn = limit.sqlite_connect(path)
            conn.execute("DELETE FROM errands_jobs WHERE id > ?", (row[0],))
            conn.close()
        log(
            f"scale: sqlite run {run + 1}: loop empty {out['loop_empty_runs'][-1]:,.0f}, "
            f"full {out['loop_full_runs'][-1]:,.0f} jobs/s"
        )
    for label, path in paths.items():
        out[f"loop_{label}"] = _median(out[f"loop_{label}_runs"])
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(path + suffix):
                os.remove(path + suffix)
    out["loop_ratio"] = out["loop_full"] / out["loop_empty"]
    return out
