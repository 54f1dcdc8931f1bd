"""Issue 17, item 4: what a job costs the database, for errands and every PostgreSQL peer.

For each PostgreSQL system and configuration, on a fresh database: a snapshot
(``bench.pgstats``), ``jobs`` no-op jobs pre-filled in bulk, ANALYZE and a snapshot, one
worker process runs them all, a snapshot once its statistics are flushed. From these:

- **WAL bytes per job**, processing (``pg_current_wal_lsn()`` after the prefill to after
  the run) and enqueueing (before to after the prefill). The LSN is the cluster's: run
  this on a cluster nothing else writes to (``--storage-pg-url``, or ``--scratch-pg``
  for a throw-away cluster the harness makes), or other work's WAL is counted too.
- **Where the WAL went**, when the cluster's ``pg_wal`` is readable here: ``pg_waldump
  --stats=record`` over the processing range (record types, full-page images), and one
  more pass summed per table and index of the system's database.
- **Bytes per 1M finished jobs**: every user relation of the database after the run,
  less the freshly migrated schema's, per job, x 1,000,000 (finished rows a system keeps,
  plus whatever dead space the queue table was left with); and the same after VACUUM FULL
  (the finished rows alone, compactly).
- **Dead tuples** after the run (``pg_stat_user_tables``), per table.

:func:`finished_scale` is the separate, slow step: claims with N (10,000,000 in the
lead's run) finished rows in the system's own tables against an empty table.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .pgstats import connect, snapshot
from .systems import BENCH, System

STAT_ROW = re.compile(
    r"^(\S.*?)\s+(\d+)\s+\(\s*[\d.]+\)\s+(\d+)\s+\(\s*[\d.]+\)\s+(\d+)\s+\(\s*[\d.]+\)\s+(\d+)"
)
STAT_TOTAL = re.compile(r"^Total\s+(\d+)\s+(\d+)\s+\[[\d.]+%\]\s+(\d+)\s+\[[\d.]+%\]\s+(\d+)")


def waldump_bin(url: str) -> str | None:
    """pg_waldump of the server's major version, if it is on this machine."""
    with connect(url) as conn:
        major = conn.execute("SHOW server_version_num").fetchone()[0][:2]
    for path in (f"/usr/lib/postgresql/{major}/bin/pg_waldump", shutil.which("pg_waldump")):
        if path and os.path.exists(path):
            return path
    return None


def wal_dir(url: str) -> str | None:
    try:
        with connect(url) as conn:
            data = conn.execute("SHOW data_directory").fetchone()[0]
    except Exception:
        return None
    path = os.path.join(data, "pg_wal")
    return path if os.access(path, os.R_OK) else None


def waldump_stats(exe: str, wal: str, start: str, end: str) -> dict[str, Any]:
    """``pg_waldump --stats=record`` between two LSNs: per record type and the total
    (records, record bytes, full-page-image bytes, combined)."""
    argv = [exe, "-p", wal, "-s", start, "-e", end, "--stats=record"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    stats: dict[str, Any] = {"types": {}}
    for line in out.stdout.splitlines():
        t = STAT_TOTAL.match(line)
        if t:
            n, rec, fpi, comb = (int(x) for x in t.groups())
            stats["total"] = {"records": n, "record_bytes": rec, "fpi_bytes": fpi, "bytes": comb}
            continue
        m = STAT_ROW.match(line)
        if m and not line.startswith(("Type", "----")):
            name = m.group(1).strip()
            n, rec, fpi, comb = (int(x) for x in m.groups()[1:])
            if n:
                stats["types"][name] = {
                    "records": n,
                    "record_bytes": rec,
                    "fpi_bytes": fpi,
                    "bytes": comb,
                }
    if "total" not in stats:
        stats["error"] = (out.stderr or out.stdout).strip()[-300:]
    return stats


RECORD = re.compile(r"^rmgr: .*?len \(rec/tot\):\s*(\d+)/\s*(\d+),")
BLOCK_REL = re.compile(r"blkref #\d+: rel (\d+/\d+/\d+)")  # not a description's "rel"


def waldump_by_relation(
    exe: str, wal: str, start: str, end: str, specs: set[str]
) -> dict[str, dict[str, int]]:
    """One ``pg_waldump`` pass over the range, its records summed per relation of
    ``specs`` (``tablespace/database/filenode``) as ``--stats`` with ``--relation`` would
    (a record counts, whole, for each relation one of its blocks is in: records, record
    bytes, full-page-image bytes, both). One pass, not one per relation: an errands
    database has ~170 relations, and on a shared server under load (the suite's smoke
    test) 170 passes over everyone's WAL took minutes."""
    found: dict[str, dict[str, int]] = {}
    proc = subprocess.Popen(
        [exe, "-p", wal, "-s", start, "-e", end],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    timer = threading.Timer(600.0, proc.kill)  # as the --stats pass's timeout
    timer.start()
    try:
        with proc:
            for line in proc.stdout:
                m = RECORD.match(line)
                if not m:
                    continue
                rels = {r for r in BLOCK_REL.findall(line) if r in specs}
                if not rels:
                    continue
                rec, tot = int(m.group(1)), int(m.group(2))
                for rel in rels:
                    entry = found.setdefault(
                        rel, {"records": 0, "record_bytes": 0, "fpi_bytes": 0, "bytes": 0}
                    )
                    entry["records"] += 1
                    entry["record_bytes"] += rec
                    entry["fpi_bytes"] += tot - rec
                    entry["bytes"] += tot
    finally:
        timer.cancel()
    return found


def wal_breakdown(url: str, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Where the WAL between two snapshots went: record types, and each relation."""
    exe, wal = waldump_bin(url), wal_dir(url)
    if not exe or not wal:
        return {"error": "pg_waldump or the cluster's pg_wal is not reachable from here"}
    out: dict[str, Any] = {"range": waldump_stats(exe, wal, before["lsn"], after["lsn"])}
    by_spec = {
        f"{after['tablespace_oid']}/{after['db_oid']}/{rel['filenode']}": rel
        for rel in after["relations"]
        if rel["filenode"]
    }
    totals = waldump_by_relation(exe, wal, before["lsn"], after["lsn"], set(by_spec))
    out["relations"] = {
        by_spec[spec]["name"]: {
            "kind": by_spec[spec]["kind"], "table": by_spec[spec]["table"], **total
        }
        for spec, total in totals.items()
    }  # fmt: skip
    return out


def measure_one(
    runner: Any,
    system: System,
    label: str,
    jobs: int,
    log: Callable[[str], None],
    checkpoint: bool = False,
) -> dict[str, Any]:
    """One system, one configuration: the figures of the module docstring; with
    ``checkpoint``, a CHECKPOINT just before the workers start (full-page images)."""
    config = system.config(label)
    runner.fresh(system)
    url = runner.store_url(system)
    empty = snapshot(url)
    argv = [sys.executable, str(BENCH / "pgstats.py")]
    spec = {
        "jobs": jobs,
        "procs": 1,
        "cap": 300.0,
        "timeout": 600,
        "config": config.options,
        "before_prefill": [*argv, "snapshot", url, "0"],
        "after_prefill": [*argv, "analyze", url, *(["--checkpoint"] if checkpoint else [])],
        "after_run": [*argv, "snapshot", url, "2"],
    }
    out = runner.adapter(system, "throughput", spec)
    hooks = out["hooks"]
    before, ready, after = hooks["before_prefill"], hooks["after_prefill"], hooks["after_run"]
    done = out["done"]
    result: dict[str, Any] = {
        "config": label,
        "checkpoint": checkpoint,
        "jobs": done,
        "rate": out["rate"],
        "wal_bytes": after["lsn_bytes"] - ready["lsn_bytes"],
        "enqueue_wal_bytes": ready["lsn_bytes"] - before["lsn_bytes"],
        "bytes_empty": empty["bytes"],
        "bytes_after": after["bytes"],
        "dead_after": after["dead"],
        "live_after": after["live"],
        "tables": after["tables"],
        "relations": {r["name"]: r["bytes"] for r in after["relations"]},
    }
    result["wal_per_job"] = result["wal_bytes"] / done
    result["enqueue_wal_per_job"] = result["enqueue_wal_bytes"] / jobs
    result["bytes_per_1m"] = (after["bytes"] - empty["bytes"]) / done * 1_000_000
    try:
        result["wal"] = wal_breakdown(url, ready, after)
    except Exception as exc:  # a breakdown is evidence, not the figure
        result["wal"] = {"error": str(exc)}
    # What the finished rows take once dead space is gone (VACUUM FULL rewrites every
    # table and index compactly): the footprint a finished job leaves, bloat apart.
    with connect(url) as conn:
        conn.execute("VACUUM FULL")
    compact = snapshot(url)
    result["bytes_compact"] = compact["bytes"]
    result["bytes_per_1m_compact"] = (compact["bytes"] - empty["bytes"]) / done * 1_000_000
    result["relations_compact"] = {r["name"]: r["bytes"] for r in compact["relations"]}
    log(
        f"storage {system.name} [{label}{' after CHECKPOINT' if checkpoint else ''}]: "
        f"{result['wal_per_job']:,.0f} B WAL/job "
        f"(enqueue {result['enqueue_wal_per_job']:,.0f}), "
        f"{result['bytes_per_1m'] / 2**20:,.0f} MiB per 1M finished "
        f"({result['bytes_per_1m_compact'] / 2**20:,.0f} after VACUUM FULL), "
        f"{result['dead_after']:,} dead tuples"
    )
    return result


def run_storage(
    runner: Any,
    systems: list[System],
    jobs: int,
    log: Callable[[str], None],
    background_seconds: float = 3.0,
) -> dict[str, Any]:
    """Every PostgreSQL system and configuration, each on a fresh database."""
    url = runner.pg.url("postgres")
    out: dict[str, Any] = {"jobs": jobs, "pg_url": _safe(runner.pg.base), "systems": {}}
    # Other writers on the cluster: WAL per second with nothing of ours running.
    a = snapshot(url)
    time.sleep(background_seconds)
    b = snapshot(url)
    out["background_wal_per_s"] = (b["lsn_bytes"] - a["lsn_bytes"]) / (b["at"] - a["at"])
    log(f"storage: background WAL on this cluster {out['background_wal_per_s']:,.0f} B/s")
    with connect(url) as conn:
        out["settings"] = dict(
            conn.execute(
                "SELECT name, setting FROM pg_settings WHERE name IN ('full_page_writes', "
                "'wal_compression', 'checkpoint_timeout', 'max_wal_size', 'wal_level', "
                "'shared_buffers', 'synchronous_commit', 'autovacuum')"
            ).fetchall()
        )
    for system in systems:
        if system.store != "postgres":
            continue
        entry: dict[str, Any] = {}
        # Each configuration as it runs, then the tuned one again from a CHECKPOINT: the
        # first with no checkpoint in its window (no full-page images), the second with
        # one for every page it touches (a run spanning checkpoints lies between).
        cells = [(c.label, c.label, False) for c in system.configs]
        best = (system.best or (system.default,))[0].label
        cells.append((f"{best}+checkpoint", best, True))
        for key, label, checkpoint in cells:
            try:
                entry[key] = measure_one(runner, system, label, jobs, log, checkpoint)
            except Exception as exc:
                entry[key] = {"error": str(exc)[:500]}
                log(f"storage {system.name} [{key}]: FAILED: {str(exc)[:300]}")
        out["systems"][system.name] = entry
        with contextlib.suppress(Exception):
            runner.pg.drop(runner.db(system))
    return out


def _safe(url: str) -> str:
    return re.sub(r"//[^@/]*@", "//", url)


# -- claims against many finished rows ------------------------------------------------


def _columns(conn: Any, table: str) -> list[str]:
    """The columns a copy of a row may carry: not identity, generated or serial."""
    rows = conn.execute(
        "SELECT a.attname FROM pg_attribute a "
        "LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum "
        "WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped "
        "AND a.attidentity = '' AND a.attgenerated = '' "
        "AND coalesce(pg_get_expr(d.adbin, d.adrelid), '') NOT LIKE 'nextval(%%' "
        "ORDER BY a.attnum",
        (table,),
    ).fetchall()
    return [f'"{r[0]}"' for r in rows]


def replicate(url: str, tables: tuple[str, ...], rows: int, log: Callable[[str], None]) -> int:
    """Copy the finished rows a real run left in ``tables`` until the first holds ``rows``
    (each table multiplied alike, 1M rows a transaction), then VACUUM ANALYZE as
    autovacuum would. Returns the first table's row count."""
    with connect(url) as conn:
        base = conn.execute(f"SELECT count(*) FROM {tables[0]}").fetchone()[0]
        if not base:
            raise RuntimeError(f"the sample run left no rows in {tables[0]}")
        copies = max(math.ceil(rows / base) - 1, 0)
        for table in tables:
            cols = ", ".join(_columns(conn, table))
            n = conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
            if not n:
                continue
            conn.execute(f"CREATE TEMP TABLE src AS SELECT {cols} FROM {table}")
            per = max(1, 1_000_000 // n)
            done = 0
            t = time.perf_counter()
            while done < copies:
                k = min(per, copies - done)
                conn.execute(
                    f"INSERT INTO {table} ({cols}) SELECT {cols} FROM src, generate_series(1, {k})"
                )
                done += k
            conn.execute("DROP TABLE src")
            log(
                f"finished rows: {table} {n:,} -> {n * (copies + 1):,} rows "
                f"({time.perf_counter() - t:.0f} s)"
            )
        conn.execute("VACUUM ANALYZE")
        return int(conn.execute(f"SELECT count(*) FROM {tables[0]}").fetchone()[0])


def finished_scale(
    runner: Any,
    system: System,
    rows: int,
    jobs: int,
    runs: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Processing rate of the system's tuned worker (1 process, ``jobs`` pre-filled)
    with ``rows`` finished rows in its tables against an empty database, in turns."""
    if not system.finished_tables:
        return {"error": system.finished_note or "no finished-row tables declared (systems.py)"}
    label = system.best[0].label if system.best else system.default.label
    config = system.config(label).options
    full_db = runner.db(system) + "_full"
    template = runner.db(system) + "_tpl"
    runner.pg.recreate(full_db, template=template)
    full_url = runner.pg.url(full_db)
    argv = [sys.executable, str(BENCH / "pgstats.py"), "analyze"]
    sample = min(jobs, 20_000)
    base = {"procs": 1, "cap": 120.0, "timeout": 900, "config": config}
    runner.adapter(
        system, "throughput", {**base, "jobs": sample, "after_prefill": [*argv, full_url]},
        url=full_url,
    )  # fmt: skip
    t = time.perf_counter()
    loaded = replicate(full_url, system.finished_tables, rows, log)
    out: dict[str, Any] = {
        "config": label,
        "rows": loaded,
        "load_seconds": time.perf_counter() - t,
        "empty_runs": [],
        "full_runs": [],
    }
    for run in range(runs):
        runner.fresh(system)
        empty_url = runner.store_url(system)
        spec = {**base, "jobs": jobs, "after_prefill": [*argv, empty_url]}
        out["empty_runs"].append(runner.adapter(system, "throughput", spec)["rate"])
        with connect(full_url) as conn:
            conn.execute("VACUUM ANALYZE")
        spec = {**base, "jobs": jobs, "after_prefill": [*argv, full_url]}
        out["full_runs"].append(runner.adapter(system, "throughput", spec, url=full_url)["rate"])
        log(
            f"finished rows {system.name} run {run + 1}: empty {out['empty_runs'][-1]:,.0f}, "
            f"{loaded:,} finished {out['full_runs'][-1]:,.0f} jobs/s"
        )
    import statistics

    out["empty"] = statistics.median(out["empty_runs"])
    out["full"] = statistics.median(out["full_runs"])
    out["ratio"] = out["full"] / out["empty"]
    with contextlib.suppress(Exception):
        runner.pg.drop(full_db)
    return out
