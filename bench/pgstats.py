"""What a PostgreSQL database holds and has written: the harness's side of every system.

    python -m bench.pgstats analyze URL [--checkpoint]  # ANALYZE, a snapshot (one JSON line)
    python -m bench.pgstats snapshot URL   # WAL position, relation sizes, dead tuples

The adapters call these between the prefill and the workers (``after_prefill``) and
after the workers stopped (``after_run``), with the harness's own python, so every
PostgreSQL system gets the same ANALYZE and is measured by the same queries whatever
driver its venv has.

``pg_current_wal_lsn()`` is the cluster's WAL position: on a server other work shares,
a difference also counts that work's WAL (``bench.storage`` runs on a cluster of its own
for that reason, and splits the WAL by relation with ``pg_waldump``).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

RELATIONS = """
SELECT c.oid::regclass::text AS name, c.relkind, c.relfilenode,
       pg_relation_size(c.oid) AS bytes,
       coalesce(i.indrelid::regclass::text, c.oid::regclass::text) AS tbl
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_index i ON i.indexrelid = c.oid
WHERE n.nspname NOT IN ('pg_catalog', 'information_schema')
  AND n.nspname NOT LIKE 'pg_temp%' AND c.relkind IN ('r', 'i', 'p', 'm', 't')
"""
TABLE_STATS = """
SELECT relid::regclass::text, n_live_tup, n_dead_tup, n_tup_ins, n_tup_upd, n_tup_hot_upd,
       n_tup_del, autovacuum_count, autoanalyze_count
FROM pg_stat_user_tables
"""


def connect(url: str) -> Any:
    import psycopg

    return psycopg.connect(url, autocommit=True, connect_timeout=10)


def snapshot(url: str, wait_stats: float = 0.0) -> dict[str, Any]:
    """The WAL position, every user relation's size, and the per-table tuple counters.

    ``wait_stats``: seconds to wait first, so backends that just exited have flushed
    their statistics (PostgreSQL 15 flushes them at most once a second, and at exit).
    """
    if wait_stats:
        time.sleep(wait_stats)
    with connect(url) as conn:
        lsn, lsn_bytes, dbid = conn.execute(
            "SELECT pg_current_wal_lsn()::text, pg_current_wal_lsn() - '0/0'::pg_lsn, "
            "(SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchone()
        rels = [
            {"name": n, "kind": k, "filenode": f, "bytes": b, "table": t}
            for n, k, f, b, t in conn.execute(RELATIONS).fetchall()
        ]
        tables = {
            r[0]: dict(
                zip(
                    ("live", "dead", "ins", "upd", "hot_upd", "del", "autovacuum", "autoanalyze"),
                    r[1:],
                    strict=True,
                )
            )
            for r in conn.execute(TABLE_STATS).fetchall()
        }
        tablespace = conn.execute(
            "SELECT oid FROM pg_tablespace WHERE spcname = 'pg_default'"
        ).fetchone()[0]
    return {
        "at": time.time(),
        "lsn": lsn,
        "lsn_bytes": int(lsn_bytes),
        "db_oid": dbid,
        "tablespace_oid": tablespace,
        "relations": rels,
        "tables": tables,
        "bytes": sum(r["bytes"] for r in rels),
        "dead": sum(t["dead"] or 0 for t in tables.values()),
        "live": sum(t["live"] or 0 for t in tables.values()),
    }


def analyze(url: str, checkpoint: bool = False) -> dict[str, Any]:
    """ANALYZE the whole database (what autovacuum would do after a bulk load), then a
    snapshot: the WAL position the processing starts from. ``checkpoint``: a CHECKPOINT
    first, so the processing writes a full-page image of every page it touches first
    (what each checkpoint costs a run that spans many of them)."""
    with connect(url) as conn:
        conn.execute("ANALYZE")
        if checkpoint:
            conn.execute("CHECKPOINT")
    return snapshot(url)


def main(argv: list[str]) -> int:
    verb, url = argv[0], argv[1]
    if verb == "analyze":
        out = analyze(url, checkpoint="--checkpoint" in argv[2:])
    elif verb == "snapshot":
        out = snapshot(url, wait_stats=float(argv[2]) if len(argv) > 2 else 1.5)
    else:
        raise SystemExit(f"unknown verb {verb!r}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
