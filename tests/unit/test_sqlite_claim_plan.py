"""The SQLite statements a limited (or fair) claim runs find their rows through the index
meant for them, on a database without statistics: errands never runs ANALYZE, and without
it SQLite's planner guesses."""

from __future__ import annotations

import sqlite3
from contextlib import closing

from errands.backends.sqlite.statements import MIGRATIONS, Q


def _plan(sql: str, params: dict[str, object]) -> str:
    with closing(sqlite3.connect(":memory:")) as conn:
        for _version, _name, migration in MIGRATIONS:
            conn.executescript(migration)
        rows = conn.execute(f"EXPLAIN QUERY PLAN {sql}", params).fetchall()
    return "\n".join(str(row[-1]) for row in rows)


def test_a_limited_claim_updates_its_chosen_rows_by_id_not_by_walking_the_pending_rows() -> None:
    """job_claim_ids (the write of a limited or fair claim) looks its rows up by primary
    key: through the state index it read every pending row to find 20 (3.7 ms among
    40,000 pending, 0.55 ms by id)."""
    plan = _plan(
        Q["job_claim_ids"],
        {"worker_id": "w", "token": "t", "lease_default": 30.0, "ids": "[1, 2, 3]"},
    )
    assert "INTEGER PRIMARY KEY" in plan, plan
    assert "errands_jobs_state" not in plan, plan


def test_a_prefetched_release_finds_its_claims_rate_starts_by_token_not_by_reading_the_window() -> (
    None
):
    """rate_log_unstart (a prefetched job given back at a stop) finds its claim's row of
    each bucket through errands_rate_log_token: through (bucket, at) it read the bucket's
    whole window (a '100000/d' bucket's 100,000 rows) for each job, under the write lock."""
    plan = _plan(Q["rate_log_unstart"], {"id": 1, "token": "t"})
    assert "errands_rate_log_token (token=? AND bucket=?)" in plan, plan
    assert "errands_rate_log_bucket" not in plan, plan


def test_a_fair_window_reads_the_running_rows_of_its_own_keys_only() -> None:
    """fair_heads reads the running rows of the window's keys, one probe per key: it read
    every running row of the queue (its prefetched jobs among them) at each claim, 6 ms a
    claim of 68 with 15,000 running."""
    plan = _plan(
        Q["fair_heads"],
        {"queue": "q", "after": None, "before": None, "limit": 84, "per_key": 1,
         "suspects": 0, "blocked": "[]", "names": None},
    )  # fmt: skip
    assert "SEARCH r USING INDEX errands_jobs_fair_running (queue=? AND fair_key=?)" in plan, plan
    assert "errands_jobs_fair_running (queue=? AND fair_key>?)" not in plan, plan
