"""Every claim keeps its btree index on PostgreSQL, whatever the statistics say.

A claim reads a queue's due rows in claim order through errands_jobs_due (or, in a fair
queue, errands_jobs_fair). The planner chose otherwise for a queue it had no statistics
for (a queue newer than the last ANALYZE, or outside its most common values: estimated at
one row): the BRIN bloom index over (queue, name) looked cheaper, and a claim read every
page range not yet summarised, then sorted: 160 ms a claim on 440,000 rows, 170 jobs a
second where the worker does 9,000 (migration 15 made that index usable by the listings
only). Then, for a job type the statistics had not seen, errands_jobs_state_name (state,
name, id; until schema version 16 it held available rows): every due row of the type
read and sorted, to claim 40 (the job types are now tested in a form no index serves).
So each claim statement runs under EXPLAIN ANALYZE on a new queue's rows enqueued after
the ANALYZE of 20,000 rows since processed (whose ranges no vacuum has summarised), and
must find its rows through its own btree index:
never a listing's index, a bitmap of heap pages or a sequential scan. The plan's shape,
not time: a loaded machine cannot fail it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.pg import fresh_schema_conn, plan_nodes

# One process runs the module: its fixtures fill tables of 20,000 to 200,000 rows, made
# once a process; spread over six, the backlog's was made four times (18 s each, the
# machine busy) in a CI run.
pytestmark = pytest.mark.xdist_group("claim_plans")

ROWS = 20_000
NEW = 300  # due rows of the new queue, enqueued after the statistics were taken

FILL = """
INSERT INTO errands_jobs (name, queue, args, state, run_at, attempt, max_attempts, finished_at)
SELECT CASE WHEN g %% 3 = 0 THEN 'other.job' ELSE 'bulk.job' END,
       CASE WHEN g %% 3 = 0 THEN 'other' ELSE 'bulk' END,
       '{}'::jsonb, 'available', now(), 0, 3, NULL
FROM generate_series(1, %(rows)s) AS g
"""

# The backlog analysed, then processed: the statistics say due rows are common, and the
# indexes hold the processed rows' dead entries (no vacuum ran since).
PROCESSED = "UPDATE errands_jobs SET state = 'completed', attempt = 1, finished_at = now()"

NEW_ROWS = """
INSERT INTO errands_jobs (name, queue, args, state, run_at, attempt, max_attempts, fair_key,
                          rescues)
SELECT 'fresh.job', 'fresh', '{}'::jsonb, 'available', now() - interval '1 second', 0, 3,
       'tenant:' || (g %% 30), CASE WHEN g %% 50 = 0 THEN 1 ELSE 0 END
FROM generate_series(1, %(rows)s) AS g
"""


@pytest.fixture(scope="module")
def claimed_from() -> Iterator[tuple[Any, dict[str, str]]]:
    """A migrated schema: 20,000 completed rows of two queues, analysed (never vacuumed:
    no BRIN range summarised), then 300 due rows of a queue the statistics never saw."""
    for conn, queries in fresh_schema_conn():
        conn.execute(FILL, {"rows": ROWS})
        conn.execute("ANALYZE errands_jobs")
        conn.execute(PROCESSED)
        conn.execute(NEW_ROWS, {"rows": NEW})
        yield conn, queries


BACKLOG = 200_000  # due rows the statistics saw, in the queue claimed


@pytest.fixture(scope="module")
def claimed_behind_a_backlog() -> Iterator[tuple[Any, dict[str, str]]]:
    """A migrated schema: 20,000 completed rows, then a backlog of 200,000 due rows of
    the queue claimed (30 keys), analysed: a generic plan estimates a queue's rows and a
    LIMIT's from the statistics alone, and might read the backlog and sort it."""
    for conn, queries in fresh_schema_conn():
        conn.execute(FILL, {"rows": ROWS})
        conn.execute(PROCESSED)
        conn.execute(NEW_ROWS, {"rows": BACKLOG})
        conn.execute("ANALYZE errands_jobs")
        yield conn, queries


# The nodes a claim may read errands_jobs with (its update, a row by its primary key).
BTREE_SCANS = {"Index Scan", "Index Only Scan", "ModifyTable"}
# The listings' indexes: through them a claim reads every due row of its queue or job
# type and sorts them, to take 40.
LISTING_INDEXES = {"errands_jobs_listing_bloom", "errands_jobs_bloom",
                   "errands_jobs_listed_name", "errands_jobs_listed_queue"}  # fmt: skip

_CLAIM = {"queues": ["fresh"], "limits": [40], "limit": 40, "names": ["fresh.job"],
          "worker_id": "w", "token": "t", "lease_default": 30.0}  # fmt: skip
_LIMITED = {
    "queue": "fresh",
    "blocked": [],
    "names": ["fresh.job"],
    "limit": 400,
    "full": [],
    "taken": [],
}
_FAIR = {"queue": "fresh", "blocked": [], "names": ["fresh.job"], "suspects": False}

CLAIMS = {
    "the claim of plain queues": ("job_claim", _CLAIM),
    "the claim of rescued jobs": ("job_claim_suspect", _CLAIM),
    "a limited queue's candidates": ("claim_candidates", _LIMITED),
    "a limited queue's rescued candidates": ("claim_candidates_suspect", _LIMITED),
    "a limited claim's start": ("limited_claim_start", {"queue": "fresh", "lock": "x"}),
    "a fair queue's window of keys": (
        "fair_heads",
        {**_FAIR, "after": None, "before": None, "limit": 56, "per_key": 1},
    ),
    "a fair queue's window after its cursor": (
        "fair_heads",
        {**_FAIR, "after": "tenant:1", "before": None, "limit": 56, "per_key": 1},
    ),
    "a fair queue's lookahead": ("fair_lookahead", {**_FAIR, "lookahead": 56, "above": 0}),
    "more of a fair queue's keys": (
        "fair_more",
        {**_FAIR, "keys": [f"tenant:{k}" for k in range(30)], "per_key": 10},
    ),
    "which queues are limited": ("queues_with_limits", {"queues": ["fresh"]}),
    "a fair queue's standings": (
        "fair_states",
        {"queue": "fresh", "keys": [f"tenant:{k}" for k in range(30)]},
    ),
    "a limited queue's running jobs": ("queue_running_count", {"queue": "fresh"}),
    "a limited claim's write": (
        "job_claim_ids",
        {
            "ids": list(range(ROWS + 1, ROWS + 41)),
            "worker_id": "w",
            "token": "t",
            "lease_default": 30.0,
            "queue": "fresh",
            "keys": [],
        },
    ),
}
# The statements a limited claim runs with generic plans (planned once per connection,
# not per claim: see _LimitedStore in the PostgreSQL backend).
GENERIC = ("limited_claim_start", "fair_heads", "fair_lookahead")
LIMITED = [name for name, (query, _) in CLAIMS.items() if query in GENERIC]


@pytest.mark.parametrize("claim", list(CLAIMS))
def test_a_claim_of_a_queue_the_statistics_never_saw_finds_its_rows_through_a_btree(
    claimed_from: tuple[Any, dict[str, str]], claim: str
) -> None:
    """Given 20,000 completed rows analysed and 300 due rows of a new queue, each claim
    statement finds the rows by btree index scans: never the listings' bloom index, a
    bitmap of heap pages or a scan of the table."""
    _check_plan(claimed_from, claim, generic=False)


@pytest.mark.parametrize(
    "table", ["claimed_from", "claimed_behind_a_backlog", "analysed_while_empty"]
)
@pytest.mark.parametrize("claim", LIMITED)
def test_a_limited_claims_generic_plan_finds_its_rows_through_a_btree(
    request: pytest.FixtureRequest, table: str, claim: str
) -> None:
    """The same for the plan a limited claim runs: one made without its parameters'
    values (plan_cache_mode force_generic_plan), so it cannot lean on them, for a new
    queue, for a backlog of 200,000 rows the statistics saw and for 20,000 rows enqueued
    after an ANALYZE of the empty table."""
    _check_plan(request.getfixturevalue(table), claim, generic=True)


def _check_plan(
    claimed_from: tuple[Any, dict[str, str]],
    claim: str,
    *,
    generic: bool,
    bitmaps: frozenset[str] = frozenset(),
) -> None:
    from errands.backends.postgres.batches import Prepared

    conn, queries = claimed_from
    query, params = CLAIMS[claim]
    prepared = Prepared(queries, [query])
    if generic:
        prepared.ensure(conn)  # as a claim prepares it: by name, outside its transaction
    try:
        with conn.transaction(force_rollback=True):  # the claims' updates are undone
            if generic:
                conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
                sent, values = prepared.execute(conn, query, params), None
            else:
                sent, values = queries[query], params
            explained = conn.execute(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sent, values
            ).fetchone()[0][0]
    finally:
        conn.execute("DEALLOCATE ALL")
        prepared.forget(conn)
    plan = explained["Plan"]
    if generic:  # a generic plan compares with the parameters, not with their values
        assert re.search(r"\$\d", json.dumps(plan)), f"{claim}: not a generic plan"
    scans = [n for n in plan_nodes(plan) if n.get("Relation Name") == "errands_jobs"]
    shown = [f"{n['Node Type']} {n.get('Index Name', '')}".strip() for n in scans]
    assert scans, f"{claim}: no scan of errands_jobs in {shown}"
    for scan in scans:
        if scan["Node Type"] == "Bitmap Heap Scan":  # allowed through the indexes named
            read = {n["Index Name"] for n in plan_nodes(scan) if "Index Name" in n}
            assert read and read <= bitmaps, f"{claim}: a bitmap of {read} in {shown}"
        else:
            assert scan["Node Type"] in BTREE_SCANS, f"{claim}: {shown}"
    assert not any(n.get("Index Name") in LISTING_INDEXES for n in scans), f"{claim}: {shown}"


@pytest.fixture(scope="module")
def planned_on_an_empty_table() -> Iterator[tuple[Any, dict[str, str], Any]]:
    """A migrated schema whose claim statements were prepared and run once (generic
    plans made, as a worker's first claims make them) while errands_jobs was empty, then
    given 20,000 due rows of the queue claimed: the plans made then are the ones kept."""
    from errands.backends.postgres.batches import Prepared

    for conn, queries in fresh_schema_conn():
        # No autovacuum: its ANALYZE of the rows inserted below would throw the plans away
        conn.execute("ALTER TABLE errands_jobs SET (autovacuum_enabled = false)")
        prepared = Prepared(queries, [*GENERIC, "job_claim_ids"])
        prepared.ensure(conn)
        with conn.transaction(force_rollback=True):
            conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            for name in [*LIMITED, "a limited claim's write"]:
                query, params = CLAIMS[name]
                conn.execute(prepared.execute(conn, query, params))
        conn.execute(NEW_ROWS, {"rows": ROWS})
        made = conn.execute(
            "SELECT count(*) FROM pg_prepared_statements WHERE generic_plans > 0"
        ).fetchone()[0]
        assert made == len(GENERIC) + 1  # every plan made on the empty table, and kept
        yield conn, queries, prepared


@pytest.mark.parametrize("claim", LIMITED)
def test_a_generic_plan_made_on_an_empty_table_still_finds_its_rows_through_a_btree(
    planned_on_an_empty_table: tuple[Any, dict[str, str], Any], claim: str
) -> None:
    """A worker that starts before its jobs come makes its generic plans on an empty
    table and keeps them: the statements a limited claim runs with generic plans reach
    20,000 due rows through btree indexes all the same."""
    conn, _, prepared = planned_on_an_empty_table
    query, params = CLAIMS[claim]
    with conn.transaction(force_rollback=True):
        conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        plan = conn.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + prepared.execute(conn, query, params)
        ).fetchone()[0][0]["Plan"]
    _btree_only(claim, plan)


def test_a_claims_write_is_planned_with_its_ids_whatever_plan_was_made_on_an_empty_table(
    planned_on_an_empty_table: tuple[Any, dict[str, str], Any],
) -> None:
    """The claim's write, whose generic plan made on the empty table read its ids
    through the due rows' index (every due row, 16 ms a claim at 100,000), is planned
    with its ids (plans_with_values): by primary key."""
    conn, queries, prepared = planned_on_an_empty_table
    query, params = CLAIMS["a limited claim's write"]
    with conn.transaction(force_rollback=True):
        conn.execute(queries["plans_with_values"])
        plan = conn.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + prepared.execute(conn, query, params)
        ).fetchone()[0][0]["Plan"]
    # every index the plan names (a bitmap index scan names no relation)
    indexes = {n.get("Index Name") for n in plan_nodes(plan)} - {None}
    assert indexes <= {"errands_jobs_pkey"}, indexes


def _btree_only(claim: str, plan: dict[str, Any]) -> None:
    scans = [n for n in plan_nodes(plan) if n.get("Relation Name") == "errands_jobs"]
    shown = [f"{n['Node Type']} {n.get('Index Name', '')}".strip() for n in scans]
    assert scans, f"{claim}: no scan of errands_jobs in {shown}"
    assert all(n["Node Type"] in BTREE_SCANS for n in scans), f"{claim}: {shown}"
    assert not any(n.get("Index Name") in LISTING_INDEXES for n in scans), f"{claim}: {shown}"


@pytest.fixture(scope="module")
def analysed_while_empty() -> Iterator[tuple[Any, dict[str, str]]]:
    """A migrated schema whose errands_jobs was vacuumed and analysed while empty (as
    autovacuum does to a table a drained queue left empty), then given 20,000 due rows:
    the statistics say the table and each index hold no row until the next ANALYZE."""
    for conn, queries in fresh_schema_conn():
        conn.execute("ALTER TABLE errands_jobs SET (autovacuum_enabled = false)")
        conn.execute("VACUUM ANALYZE errands_jobs")
        conn.execute(NEW_ROWS, {"rows": ROWS})
        yield conn, queries


# The indexes a bitmap scan of a claim may read: its rows by id, or the running rows.
BY_ID_OR_RUNNING = frozenset({"errands_jobs_pkey", "errands_jobs_running"})


@pytest.mark.parametrize("claim", list(CLAIMS))
def test_a_claim_after_the_table_was_analysed_empty_finds_its_rows_through_a_btree(
    analysed_while_empty: tuple[Any, dict[str, str]], claim: str
) -> None:
    """Each claim statement, planned with its values, reaches 20,000 due rows the
    statistics say are none through btree index scans (or a bitmap of the primary key or
    of the running rows' index: it reads those rows alone)."""
    _check_plan(analysed_while_empty, claim, generic=False, bitmaps=BY_ID_OR_RUNNING)


def test_a_claims_write_after_the_table_was_analysed_empty_reads_its_rows_by_id(
    analysed_while_empty: tuple[Any, dict[str, str]],
) -> None:
    """The claim's write, planned with its ids, finds them by primary key. Statistics
    taken on the empty table say every partial index is empty: the planner read the ids
    through errands_jobs_due, every due row of the queue (7 ms a fair claim of 70 jobs at
    15,000 due rows, the fair queue's claims 3 x slower than their read), until the next
    ANALYZE."""
    conn, queries = analysed_while_empty
    query, params = CLAIMS["a limited claim's write"]
    ids = [r[0] for r in conn.execute("SELECT id FROM errands_jobs ORDER BY id DESC LIMIT 40")]
    params = {**params, "ids": ids}  # rows that are there: each one claimed by the plan
    with conn.transaction(force_rollback=True):
        conn.execute(queries["plans_with_values"])
        plan = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + queries[query], params).fetchone()[
            0
        ][0]["Plan"]
    # every index the plan names (a bitmap index scan names no relation)
    indexes = {n.get("Index Name") for n in plan_nodes(plan)} - {None}
    assert indexes <= {"errands_jobs_pkey"}, indexes


BIG_CLAIM = 1_000  # a worker's claim under a backlog: its free slots and its prefetch


@pytest.fixture(scope="module", params=[20_000, 50_000])
def a_table_a_few_claims_deep(request: pytest.FixtureRequest) -> Iterator[tuple[Any, int]]:
    """A migrated schema whose errands_jobs holds 20,000 (or 50,000) due rows, analysed:
    a hot table a few claims of 1,000 deep."""
    for conn, queries in fresh_schema_conn():
        conn.execute(NEW_ROWS, {"rows": request.param})
        conn.execute("ANALYZE errands_jobs")
        yield conn, queries


def test_a_claim_of_a_thousand_rows_updates_them_by_primary_key_not_by_reading_the_table(
    a_table_a_few_claims_deep: tuple[Any, dict[str, str]],
) -> None:
    """The claim's update finds the 1,000 rows it picked by primary key. Joined with
    them, it was planned as a hash join over a sequential read of the whole table (20,000
    or 50,000 rows for 1,000: 23.7 -> 18.9 ms and 31.3 -> 18.9 ms a claim)."""
    conn, queries = a_table_a_few_claims_deep
    params = {**_CLAIM, "limits": [BIG_CLAIM], "limit": BIG_CLAIM}
    with conn.transaction(force_rollback=True):
        plan = conn.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + queries["job_claim"], params
        ).fetchone()[0][0]["Plan"]
    assert plan["Node Type"] == "ModifyTable" and plan["Actual Rows"] == BIG_CLAIM
    scans = [n for n in plan_nodes(plan) if n.get("Relation Name") == "errands_jobs"]
    shown = [f"{n['Node Type']} {n.get('Index Name', '')} {n.get('Actual Rows')}" for n in scans]
    assert not any(n["Node Type"] == "Seq Scan" for n in scans), shown
    by_id = [n for n in scans if n.get("Index Name") == "errands_jobs_pkey"]
    assert by_id and sum(n["Actual Rows"] * n.get("Actual Loops", 1) for n in by_id) == BIG_CLAIM, (
        shown
    )
