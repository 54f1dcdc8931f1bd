"""The dashboard's and the CLI's job listings keep an index on PostgreSQL.

Migration 12 took the full listing indexes off errands_jobs (each job paid two entries in
every one of them: WAL per job, issue 17). What lists rare rows among many completed ones
now are partial indexes and a BRIN bloom index; a later schema change that loses one
turns a listing into a read of the whole table, which a test with a few rows never shows
by its time. So each listing runs under EXPLAIN (ANALYZE, BUFFERS) on 20,000 rows laid
out like a real table (completed rows in bulk, a few dead, pending, running, waiting and
cancelled and scheduled ones; a rare queue and a rare job name), once autovacuum's work is done
(VACUUM ANALYZE: statistics, BRIN ranges summarised), and must read a small share of the
table's pages, never by a sequential scan. Pages read, not time: a loaded machine cannot
fail it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from errands.backends.base import ListParams
from errands.backends.shared_admin import listing_query, listing_values
from tests.pg import fresh_schema_conn, plan_nodes

ROWS = 20_000
# A listing of rare rows may read this share of the table's pages at most (found through
# an index: a few dozen; a scan of the primary key or the table: all of them).
MAX_SHARE = 0.1

FILL = """
INSERT INTO errands_jobs (name, queue, args, state, run_at, attempt, max_attempts, finished_at,
                          lease_expires_at, parent_id)
SELECT CASE WHEN g %% 5000 = 11 THEN 'rare.job' WHEN g %% 5 = 0 THEN 'other.job'
            ELSE 'bulk.job' END,
       CASE WHEN g %% 4000 = 7 OR g %% 4000 = 8 THEN 'rare' WHEN g %% 4000 = 9 THEN 'stalled'
            WHEN g %% 5 = 1 THEN 'other' ELSE 'bulk' END,
       '{}'::jsonb,
       s.state, now(), 1, 3,
       CASE WHEN s.state IN ('completed', 'dead', 'cancelled') THEN now() END,
       CASE WHEN s.state = 'running' THEN now() + interval '1 minute' END,
       CASE WHEN g %% 9000 = 5 THEN 1 END
FROM generate_series(1, %(rows)s) AS g
CROSS JOIN LATERAL (SELECT CASE
    WHEN g > %(rows)s - 200 OR g %% 4000 = 9 THEN 'available'
    WHEN g > %(rows)s - 210 THEN 'running'
    WHEN g > %(rows)s - 220 THEN 'waiting'
    WHEN g > %(rows)s - 240 THEN 'scheduled'
    WHEN g %% 1000 = 0 OR g %% 4000 = 8 THEN 'dead'
    WHEN g %% 500 = 1 THEN 'cancelled'
    ELSE 'completed' END) AS s(state)
"""


@pytest.fixture(scope="module")
def listed() -> Iterator[tuple[Any, dict[str, str], int]]:
    """A migrated schema holding the 20,000 rows: its connection, the backend's queries,
    and the table's pages."""
    for conn, queries in fresh_schema_conn():
        conn.execute(FILL, {"rows": ROWS})
        conn.execute("VACUUM ANALYZE errands_jobs")
        pages = conn.execute(
            "SELECT relpages FROM pg_class WHERE oid = 'errands_jobs'::regclass"
        ).fetchone()[0]
        yield conn, queries, pages


def _listing(**filters: Any) -> tuple[str, dict[str, Any]]:
    params = ListParams(**{"limit": 51, **filters})
    return listing_query(params), listing_values(params)


# Rare rows only: a listing of a common state alone (completed, or the 1 % dead) pages
# newest first through the primary key, reading about limit / share rows, whatever the
# table holds; the planner may take either path there.
LISTINGS = {
    "every job": _listing(),
    "a rare queue": _listing(queue="rare"),
    "a queue no job has": _listing(queue="nosuch"),
    "a rare job name": _listing(name="rare.job"),
    "completed jobs of a rare queue": _listing(state="completed", queue="rare"),
    "completed jobs of a rare name": _listing(state="completed", name="rare.job"),
    "dead jobs of a queue": _listing(state="dead", queue="other"),
    "dead jobs of a rare queue": _listing(state="dead", queue="rare"),
    "dead jobs of a job name": _listing(state="dead", name="other.job"),
    "cancelled jobs": _listing(state="cancelled"),
    "pending jobs of a queue": _listing(state="available", queue="other"),
    "pending jobs of a rare queue": _listing(state="available", queue="rare"),
    # a queue whose available rows are old, under newer completed ones (paused, stalled)
    "pending jobs of a stalled queue": _listing(state="available", queue="stalled"),
    "the next page of a stalled queue": _listing(
        state="available", queue="stalled", after=(0, 0.0, 4009)
    ),
    "pending jobs of a rare job name": _listing(state="available", name="rare.job"),
    "pending jobs of a rare job name in a stalled queue": _listing(
        state="available", queue="stalled", name="rare.job"
    ),
    "scheduled jobs of a queue": _listing(state="scheduled", queue="other"),
    "running jobs": _listing(state="running"),
    "waiting jobs": _listing(state="waiting"),
    "a job's children": _listing(parent_id=1),
    "dead jobs to replay, by job name": (
        "job_ids_matching",
        {"state": "dead", "queue": None, "name": "rare.job"},
    ),
    "dead jobs counted per queue": ("job_count_by_queue", {"state": "dead"}),
    "pending jobs counted per job type": ("job_count_pending_by_name", {}),
}


@pytest.mark.parametrize("listing", list(LISTINGS))
def test_a_listing_reads_few_pages_through_an_index_among_many_completed_rows(
    listed: tuple[Any, dict[str, str], int], listing: str
) -> None:
    """Given 20,000 mostly completed rows, each listing the dashboard and the CLI page
    through reads at most a tenth of the table's pages and never scans it."""
    conn, queries, pages = listed
    query, params = LISTINGS[listing]
    explained = conn.execute(
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + queries[query], params
    ).fetchone()[0][0]
    plan = explained["Plan"]
    scans = [n for n in plan_nodes(plan) if n.get("Relation Name") == "errands_jobs"]
    read = plan.get("Shared Hit Blocks", 0) + plan.get("Shared Read Blocks", 0)
    shown = [f"{n['Node Type']} {n.get('Index Name', '')}".strip() for n in scans]
    assert scans, f"{listing}: no scan of errands_jobs in {shown}"
    assert all(n["Node Type"] != "Seq Scan" for n in scans), f"{listing}: {shown}"
    assert read <= MAX_SHARE * pages, (
        f"{listing}: read {read} pages of {pages} through {shown}: an index it needs is gone"
    )
