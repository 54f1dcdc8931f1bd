"""Pruning finds the rows past the retention through the index on ``finished_at``, on a
database without statistics (errands never runs ANALYZE), so each round holds the write
lock for the rows it deletes, not for every finished row kept."""

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
