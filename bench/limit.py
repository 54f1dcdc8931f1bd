"""The limit: errands' own claim-and-complete SQL in a tight loop, and raw inserts.

The statements are read from errands' ``queries.sql`` through its backend modules (never
copied here), so the limit follows the SQL that errands actually runs:

- PostgreSQL: ``job_claim`` then ``job_finish_many`` (its variant for jobs without a fair
  key) over 4 connections (one process each, prepared statements, autocommit like the
  backend), batch sizes 1, 10 and 100; a single-row ``job_insert`` in autocommit (one
  insert-and-commit per job); the multi-row ``job_insert_many``; and ``COPY`` into the
  jobs table.
- SQLite: the raw in-process loop, one connection with errands' pragmas: ``job_claim``
  in one ``BEGIN IMMEDIATE`` transaction, then ``job_finish`` for each row in another,
  as the backend does; single-row ``job_insert`` + commit; ``executemany`` in one
  transaction.

No worker, no handler, no Python job objects: what is left is the database's cost plus
the least client work that can drive it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import secrets
import sqlite3
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from errands.backends.fair import HALF_LIFE

PG_CONNECTIONS = 4
BATCHES = (1, 10, 100)
# Rows per call (and per transaction) of every bulk enqueue measured: CHUNK in each
# bench/peers adapter. The chunked COPY limit commits as often, so it is the same work.
BULK_CHUNK = 1000
ARGS = json.dumps({"n": 1}, separators=(",", ":"))


def binder(sql: str) -> Any:
    """A function giving ``params`` plus None for every other parameter ``sql`` names.

    errands' SQL gains optional parameters as features land (the backend passes None for
    what a plain job does not use); the limit must keep running the current statement.
    """
    names = re.findall(r"%\((\w+)\)[sbt]", sql) + re.findall(r"(?<![:\w]):([A-Za-z_]\w*)", sql)
    base = dict.fromkeys(names)
    return lambda params: {**base, **params}


def pg_queries() -> dict[str, str]:
    from errands.backends.postgres.backend import filled_queries

    return filled_queries("public")


def sqlite_queries() -> dict[str, str]:
    from errands.backends.sqlite.backend import Q

    return dict(Q)


# -- PostgreSQL --------------------------------------------------------------------------


def pg_copy_available(
    url: str, n: int, state: str = "available", chunk: int | None = None
) -> float:
    """COPY ``n`` due rows (or finished ones) into errands_jobs, in one transaction or
    ``chunk`` rows a transaction; returns seconds taken."""
    import psycopg

    finished = state in ("completed", "cancelled", "discarded")
    cols = "name, queue, args, state, max_attempts, run_at" + (", finished_at" if finished else "")
    row: tuple[Any, ...] = ("bench.noop", "bench", ARGS, state, 4, "2020-01-01 00:00:00+00")
    if finished:  # an hour ago: inside any retention, so the pruner leaves them
        recent = datetime.now(UTC) - timedelta(hours=1)
        row = (*row, recent.isoformat())
    with psycopg.connect(url) as conn, conn.cursor() as cur:
        t = time.perf_counter()  # once connected, as every enqueue it is set against
        for start in range(0, n, chunk or n):
            with cur.copy(f"COPY errands_jobs ({cols}) FROM STDIN") as copy:
                for _ in range(min(chunk or n, n - start)):
                    copy.write_row(row)
            conn.commit()
        return time.perf_counter() - t


def _pg_claimer(url: str, batch: int, cap: float, barrier: Any, out: Any) -> None:
    try:
        out.put(_pg_claim(url, batch, cap, barrier))
    except BaseException as exc:
        barrier.abort()
        out.put(f"{type(exc).__name__}: {exc}")


def _pg_claim(url: str, batch: int, cap: float, barrier: Any) -> tuple[int, float, float]:
    import psycopg

    q = pg_queries()
    # the write of a worker's plain jobs (none with a fair key: no fold)
    claim_sql, finish_sql = q["job_claim"], q["job_finish_many_plain"]
    claim_params, finish_params = binder(claim_sql), binder(finish_sql)
    done = 0
    with psycopg.connect(url, autocommit=True, prepare_threshold=0) as conn:
        worker = f"limit-{os.getpid()}"
        barrier.wait()
        t0 = time.perf_counter()
        last = t0
        while last - t0 < cap:
            rows = conn.execute(
                claim_sql,
                claim_params(
                    {
                        "queues": ["bench"],
                        "limits": [batch],
                        "limit": batch,
                        "worker_id": worker,
                        "token": secrets.token_hex(8),
                        "lease_default": 30.0,
                    }
                ),
            ).fetchall()
            if not rows:
                break
            k = len(rows)
            conn.execute(
                finish_sql,
                finish_params(
                    {
                        "ids": [r[0] for r in rows],
                        "tokens": [r[17] for r in rows],
                        "states": ["completed"] * k,
                        "results": [None] * k,
                        "errors": [None] * k,
                        "delays": [0.0] * k,
                        "members": False,  # no workflow members: the plain jobs' write
                        "half_life": HALF_LIFE,
                    }
                ),
            ).fetchall()
            done += k
            last = time.perf_counter()
    return done, t0, last


def pg_claim_loop(
    url: str, n: int, batch: int, cap: float = 8.0, connections: int = PG_CONNECTIONS
) -> float:
    """Jobs/s of claim+complete over ``connections`` processes, until ``n`` due rows are
    gone or ``cap`` seconds have passed."""
    pg_copy_available(url, n)
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(connections)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_pg_claimer, args=(url, batch, cap, barrier, out))
        for _ in range(connections)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    errors = [r for r in results if isinstance(r, str)]
    if errors:
        raise RuntimeError(f"claim loop failed: {errors[0]}")
    done = sum(r[0] for r in results)
    elapsed = max(r[2] for r in results) - min(r[1] for r in results)
    return done / elapsed


def pg_single_insert(url: str, n: int) -> float:
    """errands' job_insert, one autocommit statement (insert + commit) per row."""
    import psycopg

    sql = pg_queries()["job_insert"]
    params = binder(sql)({
        "name": "bench.noop", "queue": "bench", "args": ARGS, "meta": "{}", "priority": 0,
        "max_attempts": 4, "run_at": None, "delay": 0.0, "key": None, "timeout": None,
        "lease_seconds": None, "channel": None,
    })  # fmt: skip
    with psycopg.connect(url, autocommit=True, prepare_threshold=0) as conn:
        conn.execute(sql, params).fetchone()
        t = time.perf_counter()
        for _ in range(n):
            conn.execute(sql, params).fetchone()
        return n / (time.perf_counter() - t)


def pg_multirow_insert(url: str, n: int, chunk: int = BULK_CHUNK) -> float:
    """errands' job_allocate_ids + job_insert_many, ``chunk`` rows per transaction."""
    import psycopg

    q = pg_queries()
    many = binder(q["job_insert_many"])
    with psycopg.connect(url, prepare_threshold=0) as conn:
        t = time.perf_counter()
        for start in range(0, n, chunk):
            k = min(chunk, n - start)
            ids = conn.execute(q["job_allocate_ids"], {"n": k}).fetchone()[0]  # type: ignore[index]
            conn.execute(
                q["job_insert_many"],
                many({
                    "ids": ids, "names": ["bench.noop"] * k, "queues": ["bench"] * k,
                    "args": [ARGS] * k, "metas": ["{}"] * k, "priorities": [0] * k,
                    "max_attempts": [4] * k, "run_ats": [None] * k, "delays": [0.0] * k,
                    "keys": [None] * k, "timeouts": [None] * k, "leases": [None] * k,
                }),
            ).fetchall()  # fmt: skip
            conn.commit()
        return n / (time.perf_counter() - t)


def pg_truncate(url: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE errands_jobs")
        conn.execute("VACUUM ANALYZE errands_jobs")


def pg_limit(url: str, jobs: int, single: int, cap: float = 8.0) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for batch in BATCHES:
        pg_truncate(url)
        out[f"claim_complete_b{batch}"] = pg_claim_loop(url, jobs, batch, cap)
    pg_truncate(url)
    out["insert_single"] = pg_single_insert(url, single)
    pg_truncate(url)
    out["insert_multirow"] = pg_multirow_insert(url, jobs)
    pg_truncate(url)
    out["copy"] = jobs / pg_copy_available(url, jobs)
    pg_truncate(url)
    out["copy_chunked"] = jobs / pg_copy_available(url, jobs, chunk=BULK_CHUNK)
    pg_truncate(url)
    return out


# -- SQLite --------------------------------------------------------------------------------


def sqlite_connect(path: str) -> sqlite3.Connection:
    """A connection set up as errands' SQLite backend sets its own up."""
    conn = sqlite3.connect(path, isolation_level=None, timeout=5.0)
    conn.execute("PRAGMA busy_timeout = 5000")
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    return conn


def sqlite_fresh(path: str) -> None:
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.remove(path + suffix)
    from errands.backends.sqlite.backend import SQLiteBackend

    SQLiteBackend(f"sqlite:///{path}").close()  # errands' own migrations


def _sqlite_params() -> dict[str, Any]:
    return {
        "name": "bench.noop", "queue": "bench", "args": ARGS, "meta": "{}", "priority": 0,
        "max_attempts": 4, "run_at": None, "delay": 0.0, "key": None, "timeout": None,
        "lease_seconds": None,
    }  # fmt: skip


def sqlite_bulk_insert(path: str, n: int, state: str = "available") -> float:
    """``n`` rows in one transaction with executemany; returns rows/s."""
    conn = sqlite_connect(path)
    finished = state in ("completed", "cancelled", "discarded")
    recent = time.time() - 3600  # finished an hour ago: inside any retention
    t = time.perf_counter()
    conn.execute("BEGIN IMMEDIATE")
    conn.executemany(
        "INSERT INTO errands_jobs (name, queue, args, meta, state, priority, max_attempts, "
        "run_at, inserted_at, finished_at) VALUES (?, ?, ?, '{}', ?, 0, 4, ?, ?, ?)",
        (
            ("bench.noop", "bench", ARGS, state, 1.0e9, 1.0e9, recent if finished else None)
            for _ in range(n)
        ),
    )
    conn.execute("COMMIT")
    elapsed = time.perf_counter() - t
    conn.close()
    return n / elapsed


def sqlite_single_insert(path: str, n: int) -> float:
    q = sqlite_queries()
    conn = sqlite_connect(path)
    params = binder(q["job_insert"])(_sqlite_params())
    t = time.perf_counter()
    for _ in range(n):
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(q["job_insert"], params).fetchone()
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - t
    conn.close()
    return n / elapsed


def sqlite_claim_loop(path: str, n: int, batch: int, cap: float = 8.0) -> float:
    q = sqlite_queries()
    claim_params, finish_params = binder(q["job_claim"]), binder(q["job_finish"])
    sqlite_bulk_insert(path, n)
    conn = sqlite_connect(path)
    done = 0
    t = time.perf_counter()
    while time.perf_counter() - t < cap:
        conn.execute("BEGIN IMMEDIATE")
        rows = conn.execute(
            q["job_claim"],
            claim_params(
                {
                    "worker_id": "limit",
                    "token": secrets.token_hex(8),
                    "lease_default": 30.0,
                    "queue": "bench",
                    "limit": batch,
                }
            ),
        ).fetchall()
        conn.execute("COMMIT")
        if not rows:
            break
        conn.execute("BEGIN IMMEDIATE")
        for r in rows:
            conn.execute(
                q["job_finish"],
                finish_params(
                    {"id": r[0], "token": r[17], "state": "completed", "result": None,
                     "error": None, "delay": 0.0}
                ),
            )  # fmt: skip
        conn.execute("COMMIT")
        done += len(rows)
    elapsed = time.perf_counter() - t
    conn.close()
    return done / elapsed


def sqlite_limit(path: str, jobs: int, single: int, cap: float = 8.0) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for batch in BATCHES:
        sqlite_fresh(path)
        out[f"claim_complete_b{batch}"] = sqlite_claim_loop(path, jobs, batch, cap)
    sqlite_fresh(path)
    out["insert_single"] = sqlite_single_insert(path, single)
    sqlite_fresh(path)
    out["insert_multirow"] = sqlite_bulk_insert(path, jobs)
    return out
