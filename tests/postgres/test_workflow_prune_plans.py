"""Pruning a workflow on PostgreSQL reads its own edges, not every edge kept.

The prune deletes a settled workflow's edges by workflow_id (wf_delete_edges), which no
index led with before schema version 20: each workflow pruned read every edge of every
workflow kept, inside the prune's transaction (34 s for a batch of 1,000 small workflows
beside 500,000 edges of live DAGs). Here the statements run under EXPLAIN (ANALYZE,
BUFFERS) beside 20,000 edges of live workflows, once autovacuum's work is done (VACUUM
ANALYZE), and must read a few pages through the index, never the table. Pages read, not
time: a loaded machine cannot fail it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from errands.backends.postgres.backend import MIGRATIONS, fill_markers
from tests.pg import fresh_schema_conn, plan_nodes

LIVE = 200  # live workflows of 100 edges each
PRUNED = LIVE + 1  # a settled workflow of one edge

FILL = [
    "INSERT INTO errands_workflows (id, name, kind, state, total) "
    "SELECT w, 'live', 'dag', 'running', 101 FROM generate_series(1, %(live)s) AS w",
    "INSERT INTO errands_workflow_edges (parent_id, child_id, workflow_id, policy) "
    "SELECT 10000000 + w * 1000 + k, 10000000 + w * 1000 + k + 1, w, 'cancel' "
    "FROM generate_series(1, %(live)s) AS w, generate_series(0, 99) AS k",
    "INSERT INTO errands_workflows (id, name, kind, state, total, settled_at) "
    "VALUES (%(pruned)s, 'old', 'dag', 'succeeded', 2, now() - interval '30 days')",
    "INSERT INTO errands_workflow_edges (parent_id, child_id, workflow_id, policy, outcome) "
    "VALUES (1, 2, %(pruned)s, 'cancel', 'completed')",
]


@pytest.fixture(scope="module")
def edges() -> Iterator[tuple[Any, dict[str, str], int]]:
    """A migrated schema holding the edges: its connection, the backend's queries, and
    the edges table's pages."""
    for conn, queries in fresh_schema_conn():
        for statement in FILL:
            conn.execute(statement, {"live": LIVE, "pruned": PRUNED})
        conn.execute("VACUUM ANALYZE errands_workflow_edges")
        pages = conn.execute(
            "SELECT relpages FROM pg_class WHERE oid = 'errands_workflow_edges'::regclass"
        ).fetchone()[0]
        yield conn, queries, pages


def _explained(conn: Any, sql: str, params: dict[str, Any]) -> dict[str, Any]:
    """The statement's plan with what it read; a write is rolled back."""
    with conn.transaction():
        plan = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, params).fetchone()
        raise psycopg.Rollback
    return plan[0][0]["Plan"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("query", "params"),
    [("wf_delete_edges", {"id": PRUNED}), ("wf_tree_rows", {"ids": [PRUNED]})],
)
def test_a_pruned_workflows_edges_are_found_through_an_index_not_by_reading_every_edge(
    edges: tuple[Any, dict[str, str], int], query: str, params: dict[str, Any]
) -> None:
    """Beside 20,000 edges of live workflows, deleting (and counting) the one edge of a
    settled workflow reads a few pages through an index, never the edges table."""
    conn, queries, pages = edges
    plan = _explained(conn, queries[query], params)
    nodes = list(plan_nodes(plan))
    read = plan.get("Shared Hit Blocks", 0) + plan.get("Shared Read Blocks", 0)
    shown = [f"{n['Node Type']} {n.get('Index Name', '')}".strip() for n in nodes]
    assert not any(
        n["Node Type"] == "Seq Scan" and n.get("Relation Name") == "errands_workflow_edges"
        for n in nodes
    ), shown
    assert any(n.get("Index Name") == "errands_workflow_edges_workflow" for n in nodes), shown
    assert read <= 0.1 * pages, f"{query}: read {read} pages of {pages} through {shown}"


def test_an_edges_index_left_invalid_by_a_concurrent_build_is_built_again() -> None:
    """An operator may build the index first with CREATE INDEX CONCURRENTLY (the
    migration then skips it); one such build that failed leaves an invalid index, which
    the migration drops and builds again."""
    [migration] = [text for version, _, text in MIGRATIONS if version == 20]
    for conn, _ in fresh_schema_conn():
        schema = conn.execute("SELECT current_schema()").fetchone()[0]
        conn.execute(
            "UPDATE pg_index SET indisvalid = false "
            "WHERE indexrelid = to_regclass('errands_workflow_edges_workflow')"
        )
        with conn.transaction():
            conn.execute(fill_markers(migration, schema).encode())
        valid = conn.execute(
            "SELECT indisvalid FROM pg_index "
            "WHERE indexrelid = to_regclass('errands_workflow_edges_workflow')"
        ).fetchone()
        assert valid == (True,)
