"""A heartbeat on PostgreSQL is a HOT update: no index entry, a small WAL record.

Schema version 12 indexes running rows by id (errands_jobs_running), not by
lease_expires_at: the heartbeat's columns (lease_expires_at, progress) are then in no
index, and with the table's fillfactor the new row version fits on its page, so
PostgreSQL updates it in place of a new entry in every index (232 -> 95 B of WAL per
heartbeat measured). A later index on one of those columns would silently undo that.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import errands
from tests.pg import fresh_pg_url


@pytest.fixture
def pg_app() -> Iterator[errands.App]:
    for url in fresh_pg_url():
        app = errands.App(url)
        try:
            app.migrate()
            yield app
        finally:
            app.close()


def test_a_heartbeat_of_running_jobs_is_a_hot_update(pg_app: errands.App) -> None:
    """Given 10 running jobs (vacuumed since their claim, as autovacuum keeps this table),
    the worker's heartbeat statement updates all 10 rows, each as a HOT update."""
    import psycopg

    job = pg_app.job(name="hot.job", queue="hot")(lambda n: None)
    pg_app.enqueue_many([job.bind(n=i) for i in range(10)])
    backend: Any = pg_app.backend
    with psycopg.connect(backend.config.conninfo) as conn:
        conn.execute(f'SET search_path TO "{backend.schema}"')
        ids = [
            r[0]
            for r in conn.execute(
                "UPDATE errands_jobs SET state = 'running', lease_token = 't' || id, "
                "lease_owner = 'w', lease_expires_at = now() + interval '30 seconds', "
                "attempted_at = now(), attempt = 1 RETURNING id"
            ).fetchall()
        ]
        conn.commit()
        conn.autocommit = True
        conn.execute("VACUUM errands_jobs")
        conn.autocommit = False
        counted = (
            "SELECT pg_stat_get_xact_tuples_updated('errands_jobs'::regclass), "
            "pg_stat_get_xact_tuples_hot_updated('errands_jobs'::regclass)"
        )
        before = conn.execute(counted).fetchone()
        beats = conn.execute(
            backend.q["job_heartbeat_many"],
            {"ids": ids, "tokens": [f"t{i}" for i in ids], "leases": [60.0] * len(ids),
             "progress": [0.5] * len(ids), "messages": ["half"] * len(ids)},
        ).fetchall()  # fmt: skip
        after = conn.execute(counted).fetchone()
        conn.commit()
    updated, hot = after[0] - before[0], after[1] - before[1]
    assert len(beats) == 10
    assert (updated, hot) == (10, 10), (
        "a heartbeat wrote index entries: is a column it changes (lease_expires_at, "
        "progress, progress_message) in an index again?"
    )
