"""Every write that ends or extends attempts finds its rows by id on PostgreSQL, whatever
the statistics say.

A completion batch, a heartbeat, a release and a rescue each name their rows by id (and
lease token). Written with ``j.state = 'running'`` as a restriction of errands_jobs, a
table with no statistics (filled before autovacuum's first ANALYZE: a fresh database, a
bulk load) or analysed while nothing ran made the planner expect one running row: it
read every running row and compared each with the whole batch. A batch of 500
completions beside 2,000 running jobs took 150-480 ms, and two workers ran 2,000 jobs a
second where they ran 16,000 once analysed. So each statement runs here under EXPLAIN
ANALYZE against 2,000 running rows the statistics do not know, ending 200 of them, and
must read errands_jobs by primary key alone, one probe per row of its batch: never the
running rows' index, a bitmap of heap pages or a sequential scan. The plan's shape, not
time: a loaded machine cannot fail it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from psycopg import sql

from tests.pg import fresh_schema_conn, plan_nodes

pytestmark = pytest.mark.xdist_group("write_plans")

ROWS = 20_000
RUNNING = 2_000  # the rows claimed (the statistics never saw them running)
BATCH = 200  # the rows each write ends (or extends)
TOKEN = "claim-1"

FILL = """
INSERT INTO errands_jobs (name, queue, args, state, run_at, attempt, max_attempts,
                          finished_at)
SELECT 'bulk.job', 'bulk', '{}'::jsonb, %(state)s, now(), 0, 3,
       CASE WHEN %(state)s = 'completed' THEN now() END
FROM generate_series(1, %(rows)s)
"""
# The first RUNNING rows, claimed by one worker, their leases expired (a rescue may take
# them; the other writes do not look at the lease's end).
CLAIM = """
UPDATE errands_jobs
SET state = 'running', attempt = 1, lease_owner = 'w', lease_token = %(token)s,
    lease_expires_at = now() - interval '1 minute', attempted_at = now(), finished_at = NULL
WHERE id IN (SELECT id FROM errands_jobs ORDER BY id LIMIT %(running)s)
"""


@pytest.fixture(scope="module")
def never_analysed() -> Iterator[tuple[Any, dict[str, str]]]:
    """20,000 due rows in a table no ANALYZE has seen, 2,000 of them running."""
    for conn, queries in fresh_schema_conn():
        conn.execute("ALTER TABLE errands_jobs SET (autovacuum_enabled = false)")
        conn.execute(FILL, {"state": "available", "rows": ROWS})
        conn.execute(CLAIM, {"token": TOKEN, "running": RUNNING})
        yield conn, queries


@pytest.fixture(scope="module")
def analysed_while_idle() -> Iterator[tuple[Any, dict[str, str]]]:
    """20,000 finished rows analysed while none ran (as autovacuum does between bursts),
    then 2,000 of them running again: the statistics say no row is."""
    for conn, queries in fresh_schema_conn():
        conn.execute("ALTER TABLE errands_jobs SET (autovacuum_enabled = false)")
        conn.execute(FILL, {"state": "completed", "rows": ROWS})
        conn.execute("VACUUM ANALYZE errands_jobs")
        conn.execute(CLAIM, {"token": TOKEN, "running": RUNNING})
        yield conn, queries


def _ends(ids: list[int]) -> dict[str, dict[str, Any]]:
    """Each write's parameters for the rows ``ids`` (as the backend binds them)."""
    n = len(ids)
    tokens = [TOKEN] * n
    error = json.dumps({"type": "Boom", "message": "boom", "kind": "transient", "attempt": 1})
    complete = {"ids": ids, "tokens": tokens, "results": [None] * n, "rans": [0.01] * n}
    finish = {
        "ids": ids,
        "tokens": tokens,
        "states": ["retryable"] * n,
        "results": [None] * n,
        "errors": [error] * n,
        "delays": [2.0] * n,
        "rans": [0.01] * n,
        "members": False,
    }
    release = {"ids": ids, "tokens": tokens, "delays": [0.0] * n, "message": "stopping"}
    release |= {"unrun": False, "prefetched": False}
    rescue = {
        "ids": ids,
        "tokens": tokens,
        "states": ["retryable"] * n,
        "errors": [error] * n,
        "delays": [2.0] * n,
    }
    heartbeat = {
        "ids": ids,
        "tokens": tokens,
        "leases": [30.0] * n,
        "progress": [None] * n,
        "messages": [None] * n,
    }
    return {
        "job_complete_many": complete,
        "job_finish_many": finish,
        "job_release_many": release,
        "job_rescue_many": rescue,
        "job_heartbeat_many": heartbeat,
    }


WRITES = [
    "job_complete_many",
    "job_complete_many_plain",
    "job_finish_many",
    "job_finish_many_plain",
    "job_release_many",
    "job_release_many_plain",
    "job_rescue_many",
    "job_rescue_many_plain",
    "job_heartbeat_many",
]


def _explain(state: tuple[Any, dict[str, str]], write: str, *, generic: bool) -> dict[str, Any]:
    """EXPLAIN ANALYZE of ``write`` ending BATCH of the running rows (rolled back): with a
    plan made for its values, or a generic one (prepared, as a worker's connection runs
    it from its sixth execution on)."""
    conn, queries = state
    rows = conn.execute(
        # from the middle of the running rows: a merge over the primary key from its start
        # would read the rows below them too
        "SELECT id FROM errands_jobs WHERE lease_token = %s ORDER BY id OFFSET %s LIMIT %s",
        (TOKEN, (RUNNING - BATCH) // 2, BATCH),
    )
    running = [r[0] for r in rows]
    assert len(running) == BATCH
    params = {**_ends(running)[write.removesuffix("_plain")], "half_life": 3600.0}
    if generic:
        order: list[str] = []

        def number(match: re.Match[str]) -> str:
            if match[1] not in order:
                order.append(match[1])
            return f"${order.index(match[1]) + 1}"

        text = re.sub(r"%\((\w+)\)[sb]", number, queries[write]).replace("%%", "%")
        conn.execute(f"PREPARE write_plan AS {text}")
        values = ", ".join(sql.Literal(params[k]).as_string(conn) for k in order)
        sent, bound = f"EXECUTE write_plan({values})", None
    else:
        sent, bound = queries[write], params
    try:
        with conn.transaction(force_rollback=True):
            if generic:
                conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            explain = "EXPLAIN (ANALYZE, VERBOSE, FORMAT JSON) " + sent
            return conn.execute(explain, bound).fetchone()[0][0]["Plan"]
    finally:
        if generic:
            conn.execute("DEALLOCATE write_plan")


def _check(state: tuple[Any, dict[str, str]], write: str, *, generic: bool) -> None:
    plan = _explain(state, write, generic=generic)
    nodes = list(plan_nodes(plan))
    if generic:
        assert re.search(r"\$\d", json.dumps(plan)), f"{write}: not a generic plan"
    (modify,) = [
        n
        for n in nodes
        if n["Node Type"] == "ModifyTable" and n.get("Relation Name") == "errands_jobs"
    ]
    assert modify["Actual Rows"] == BATCH, f"{write}: wrote {modify['Actual Rows']} rows"
    reads = [n for n in nodes if n.get("Relation Name") == "errands_jobs" and n is not modify]
    shown = [f"{n['Node Type']} {n.get('Index Name', '')}".strip() for n in reads]
    bitmaps = [n["Index Name"] for n in nodes if n["Node Type"] == "Bitmap Index Scan"]
    assert not bitmaps, f"{write}: reads errands_jobs through a bitmap of {bitmaps}"
    # never every running row (the planner's one), nor each compared with the batch
    assert not any(n.get("Index Name") == "errands_jobs_running" for n in reads), shown
    compared = max(n.get("Rows Removed by Join Filter", 0) for n in nodes)
    assert compared == 0, f"{write}: {compared} rows compared pairwise and dropped ({shown})"
    probes = [n for n in reads if n.get("Index Name") == "errands_jobs_pkey"]
    if generic:  # planned for any batch: one probe of the primary key per row
        assert probes == reads, f"{write}: {shown}"
    else:  # for this batch: by primary key, or (a small table) read once and hashed
        assert all(n in probes or n["Node Type"] == "Seq Scan" for n in reads), shown
    for probe in probes:  # each a probe by id of one row of the batch, not a walk
        assert probe["Node Type"] == "Index Scan", f"{write}: {shown}"
        assert re.fullmatch(r"\(\w+\.id = .+\)", probe.get("Index Cond", "")), probe
    # the batch's rows found by one probe each (fair_due's probe of a row with a fair key
    # never runs here: none has one)
    if any(n["Node Type"] == "Seq Scan" for n in reads):
        return  # the table read once (its rows matched in a hash of the batch)
    loops = sum(n["Actual Loops"] for n in probes if n["Actual Rows"])
    assert loops == BATCH, f"{write}: {loops} probes for {BATCH} rows ({shown})"


@pytest.mark.parametrize("generic", [False, True], ids=["planned_for_its_values", "generic"])
@pytest.mark.parametrize("write", WRITES)
def test_an_attempts_write_finds_its_rows_by_id_in_a_table_never_analysed(
    never_analysed: tuple[Any, dict[str, str]], write: str, generic: bool
) -> None:
    _check(never_analysed, write, generic=generic)


@pytest.mark.parametrize("generic", [False, True], ids=["planned_for_its_values", "generic"])
@pytest.mark.parametrize("write", WRITES)
def test_an_attempts_write_finds_its_rows_by_id_after_an_analyse_while_nothing_ran(
    analysed_while_idle: tuple[Any, dict[str, str]], write: str, generic: bool
) -> None:
    _check(analysed_while_idle, write, generic=generic)
