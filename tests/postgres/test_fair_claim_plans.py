"""A fair claim on PostgreSQL runs its window read on a cached plan, not planned anew.

PostgreSQL re-plans a prepared statement at each run while its generic plan's estimate is
higher than the custom plans', and for fair_heads (a recursive skip over the keys) it
always is: planning cost more than running it (2.9 ms a claim against 1.1 with the
generic plan, 1,000 keys). The limited claim switches its transaction to generic plans
for the statements that gain (queries.sql, plan_generic). Counted by PostgreSQL itself
(pg_prepared_statements: how often each prepared statement ran a generic or a custom
plan), not timed.
"""

from __future__ import annotations

from typing import Any

import psycopg

import errands
from errands.backends.limits import claim_limited
from errands.backends.postgres.backend import _LimitedStore
from tests.pg import fresh_pg_url

from .counting import statements

CLAIMS = 12


def _plans(conn: psycopg.Connection[Any], marker: str) -> tuple[int, int]:
    """(generic, custom) runs of this session's prepared statement containing ``marker``."""
    row = conn.execute(
        "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement LIKE %s",
        [f"%{marker}%"],
    ).fetchone()
    names = conn.execute("SELECT left(statement, 60) FROM pg_prepared_statements").fetchall()
    assert row is not None, f"no prepared statement holds {marker!r}: {names}"
    return int(row[0]), int(row[1])


def test_a_fair_claim_runs_its_window_read_on_the_generic_plan_not_replanned_each_claim() -> None:
    for url in fresh_pg_url():
        app = errands.App(url)
        app.queue("tenants", fair=True)

        @app.job(name="plans.job", queue="tenants", fair_key="tenant:{n}")
        def job(n: int) -> None: ...

        try:
            app.enqueue_many([job.bind(n=n % 200) for n in range(600)])
            backend: Any = app.backend
            backend.queue_declare(app.queues["tenants"], "test")  # as a worker does
            prefix = f"errands:{backend.schema}:"
            with psycopg.connect(
                backend.config.conninfo, autocommit=True, prepare_threshold=5
            ) as conn:
                conn.execute(f'SET search_path TO "{backend.schema}"')
                cursors: dict[str, str] = {}
                claimed = 0
                for n in range(CLAIMS):
                    with conn.transaction():
                        params = {"worker_id": "w", "token": f"t{n}", "lease_default": 30.0}
                        rows = claim_limited(
                            _LimitedStore(conn, backend.q, prefix), "tenants", 4, params,
                            cursors=cursors,
                        )  # fmt: skip
                        claimed += len(rows)
                    mode = conn.execute("SHOW plan_cache_mode").fetchone()
                    assert mode == ("auto",)  # SET LOCAL: the claim's transaction only
                assert claimed == 4 * CLAIMS
                generic, custom = _plans(conn, "WHERE (n.step = 0 OR l.n <")  # fair_heads
                assert generic >= CLAIMS - 5 and custom == 0, (generic, custom)
        finally:
            app.close()


def test_a_fair_claim_takes_its_lock_settings_and_rates_in_one_statement(pg_url: str) -> None:
    """The claim's first statement serialises the queue's claims (its advisory lock) and
    reads the queue's settings and rate-limited job types at once: a fair claim that
    needs no deeper read is five statements (with the plan switch, the window, the
    lookahead and the claim), not seven. Counted on the client."""
    from errands.backends.base import QueueClaim

    app = errands.App(pg_url)
    app.queue("tenants", fair=True)

    @app.job(name="plans.counted", queue="tenants", fair_key="tenant:{n}")
    def job(n: int) -> None: ...

    try:
        app.enqueue_many([job.bind(n=n % 50) for n in range(100)])
        backend: Any = app.backend
        backend.queue_declare(app.queues["tenants"], "test")
        rows, sent = statements(
            lambda: backend.job_claim_limited(QueueClaim("tenants", 8), "w", 30.0)
        )
        assert len(rows) == 8
        assert sent[0].startswith("-- A limited claim's first statement"), sent
        assert len(sent) <= 5, sent
    finally:
        app.close()
