"""The worker's batch writes find their rows by id on PostgreSQL, whatever the planner
believes of the table.

A completion batch, a heartbeat, a release and a rescue each join an array of job ids
to errands_jobs. A planner whose statistics were taken before any job ran (autovacuum
off, as on this machine's server, or a table analysed while idle) thought no row was
running, and read every running row through errands_jobs_running to hash the batch
against them: a completion batch of 100 with 3,560 rows running took 6.6 ms, 2.8 of
them in that scan, and the cost grew with every worker of the cluster. Each statement
now repeats its ids as `j.id = ANY(ids)`, an index condition the planner always has.
Counted from EXPLAIN ANALYZE (rows read from errands_jobs), not timed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.pg import fresh_schema_conn, plan_nodes

RUNNING = 3_000
BATCH = 100

FILL = """
INSERT INTO errands_jobs (name, queue, args, state, run_at, attempt, max_attempts,
                          attempted_at, lease_owner, lease_token, lease_expires_at)
SELECT 'batch.job', 'q', '{}'::jsonb, 'running', now(), 1, 3, now(), 'w', 't' || g,
       now() + interval '1 hour'
FROM generate_series(1, %(running)s) AS g
"""


@pytest.fixture
def running() -> Iterator[tuple[Any, dict[str, str], list[int], list[str]]]:
    for conn, queries in fresh_schema_conn():
        conn.execute("ANALYZE errands_jobs")  # statistics from before any job ran
        conn.execute(FILL, {"running": RUNNING})
        rows = conn.execute(
            "SELECT id, lease_token FROM errands_jobs ORDER BY id LIMIT %s", (BATCH,)
        ).fetchall()
        yield conn, queries, [r[0] for r in rows], [r[1] for r in rows]


def _rows_read(conn: Any, sql: str, params: dict[str, Any]) -> int:
    conn.execute("BEGIN")
    try:
        plan = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params).fetchone()[0][0]
    finally:
        conn.execute("ROLLBACK")
    return sum(
        (n.get("Actual Rows", 0) + n.get("Rows Removed by Filter", 0)) * n.get("Actual Loops", 1)
        for n in plan_nodes(plan["Plan"])
        if n.get("Relation Name") == "errands_jobs"
    )


def test_a_batch_write_reads_its_own_rows_not_every_running_one(
    running: tuple[Any, dict[str, str], list[int], list[str]],
) -> None:
    """Given 3,000 running rows and statistics from before any ran, a completion batch,
    a heartbeat and a release of 100 jobs each read about their 100 rows."""
    conn, queries, ids, tokens = running
    n = len(ids)
    writes = {
        "job_finish_many_plain": {
            "ids": ids, "tokens": tokens, "states": ["completed"] * n, "results": ["1"] * n,
            "errors": [None] * n, "delays": [0.0] * n, "rans": [0.001] * n, "members": False,
        },
        "job_heartbeat_many": {
            "ids": ids, "tokens": tokens, "leases": [30.0] * n, "progress": [None] * n,
            "messages": [None] * n,
        },
        "job_release_many_plain": {"ids": ids, "tokens": tokens, "message": "stopping"},
    }  # fmt: skip
    read = {name: _rows_read(conn, queries[name], params) for name, params in writes.items()}
    assert all(rows <= 3 * BATCH for rows in read.values()), read
