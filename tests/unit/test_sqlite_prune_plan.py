"""Pruning finds the rows past the retention through the index on ``finished_at``, and a
workflow's edges through the one on ``workflow_id``, on a database without statistics
(errands never runs ANALYZE), so each round holds the write lock for the rows it
deletes, not for every finished row or edge kept."""

from __future__ import annotations

from errands.backends.sqlite.statements import Q

from .test_sqlite_claim_plan import _plan


def test_prune_reads_the_rows_past_the_retention_by_finish_time_not_every_finished_row() -> None:
    """SQLite's planner chose errands_jobs_state (state IN (...)): every prune round read
    all the finished rows retained, under the write lock (0.05-0.09 s a round at 197,000
    rows, growing with them, to delete none)."""
    plan = _plan(Q["job_prunable"], {"older_than": 60.0, "limit": 1000})
    assert "USING INDEX errands_jobs_finished (finished_at<?)" in plan, plan
    assert "errands_jobs_state" not in plan and "SCAN j" not in plan, plan


def test_pruning_a_workflow_deletes_its_edges_through_an_index_not_by_reading_every_edge() -> None:
    """wf_delete_edges (DELETE ... WHERE workflow_id = ?) had no index to use: each
    workflow pruned read every edge of every workflow kept, under the write lock (24 s
    for a batch of 1,000 small workflows beside 500,000 edges of live DAGs, every enqueue
    waiting). The batch's count of its rows reads the same index."""
    plan = _plan(Q["wf_delete_edges"], {"id": 1})
    assert "USING INDEX errands_workflow_edges_workflow (workflow_id=?)" in plan, plan
    assert "SCAN" not in plan, plan
    counted = _plan(Q["wf_tree_rows"], {"ids": "[1, 2]"})
    assert "COVERING INDEX errands_workflow_edges_workflow (workflow_id=?)" in counted, counted
    assert "SCAN errands_workflow" not in counted, counted
