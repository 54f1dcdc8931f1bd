"""The connections a worker process needs, and what it refuses (docs/postgres.md,
"Sizing connections").

Each open ``ctx.transaction()`` keeps one connection checked out from the attempt's
first use of it to the job's completion. Those connections come from a pool of their
own, sized from the worker's concurrency, so the worker's own path (claims, heartbeats,
outcomes, maintenance) never waits behind handlers that hold one. A worker whose
settings cannot work (more connections than the server allows) is refused at start-up
with one line naming the setting and the fix.
"""

from __future__ import annotations

import secrets

import pgacc_tx
import psycopg
import pytest

import errands
from errands.backends.postgres import PostgresBackend

from .harness import PgCluster, pg_base_url, wait_until, with_params

pytestmark = pytest.mark.acceptance

HOLD = 5.0  # seconds each handler keeps its transaction open: longer than the 4 s lease
JOBS = 20


def _open_transactions(pgc: PgCluster) -> int:
    return int(
        pgc.query(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
            "AND state = 'idle in transaction'",
            (pgc.tag,),
        )[0][0]
    )


def test_ten_handlers_holding_transactions_past_their_lease_keep_every_lease_at_default_settings(
    pgc: PgCluster,
) -> None:
    """Default pool_size (10) and concurrency (10): ten handlers each hold ctx.transaction()
    for 5 s (lease 4 s, a heartbeat every 1.3 s). Heartbeats and claims still get a
    connection, so no lease is lost or self-fenced and every job completes on its first
    attempt, its effect row committed with the completion."""
    url = with_params(pgc.url, application_name=pgc.tag)  # no pool_size: the defaults
    worker = pgc.start_worker(app="pgacc_tx:app", ERRANDS_URL=url)
    app = pgc.app("pgacc_tx")
    ids = [
        h.id for h in app.enqueue_many([pgacc_tx.hold_tx.bind(n=i, hold=HOLD) for i in range(JOBS)])
    ]

    peak = wait_until(
        lambda: (n := _open_transactions(pgc)) >= 10 and n,
        30,
        "ten handlers to hold a transaction at once",
        describe=lambda: pgc.report(),
    )
    wait_until(
        lambda: pgc.states().get("completed", 0) + pgc.states().get("dead", 0) >= JOBS,
        60,
        f"{JOBS} jobs to finish",
        interval=0.2,
        describe=lambda: f"{pgc.states()}\n{pgc.report()}",
    )
    rows = pgc.query("SELECT id, state, attempt, errors FROM {s}.errands_jobs ORDER BY id")
    assert [(r[0], r[1], r[2], list(r[3])) for r in rows] == [
        (job_id, "completed", 1, []) for job_id in ids
    ], pgc.report()
    assert sorted(j for j, *_ in pgc.effects()) == ids  # one committed effect per job
    log = worker.stderr()
    for sign in ("heartbeat failed", "cannot renew the lease", "lease of job"):
        assert sign not in log, f"{sign!r} in the worker's log:\n{log[-4000:]}"
    assert peak >= 10


def _max_connections(pgc: PgCluster) -> int:
    return int(pgc.query("SELECT current_setting('max_connections')::int")[0][0])


def test_worker_needing_more_connections_than_the_server_allows_is_refused_naming_the_fix(
    pgc: PgCluster,
) -> None:
    """-c above what max_connections leaves room for: the worker exits 1 at start-up with
    one line naming pool_size, -c, max_connections and the fixes, before it claims
    anything; with tx_pool_size= (few handlers use ctx.transaction() at once) the same
    -c starts."""
    too_many = _max_connections(pgc) + 50
    url = with_params(pgc.url, application_name=pgc.tag)
    pgc.app("pgacc_tx").enqueue_many([pgacc_tx.hold_tx.bind(n=1)])
    refused = pgc.start_worker(
        "-c", str(too_many), app="pgacc_tx:app", ready=False, ERRANDS_URL=url
    )
    assert refused.wait_exit(30) == 1
    lines = [line for line in refused.stderr().splitlines() if line.strip()]
    assert len(lines) == 1, refused.stderr()
    message = lines[0]
    for part in (
        f"this worker may open {10 + too_many + 1} connections",
        f"pool_size=10 + {too_many} for handlers' ctx.transaction(), one per handler "
        f"(-c {too_many})",
        "+ 1 LISTEN connection",
        "but the server lets it open at most",
        "lower -c (--concurrency) to at most",
        "add tx_pool_size=N",
        "or raise max_connections",
    ):
        assert part in message, message
    assert pgc.states() == {"available": 1}  # nothing claimed

    capped = with_params(url, tx_pool_size="4")
    worker = pgc.start_worker("-c", str(too_many), app="pgacc_tx:app", ERRANDS_URL=capped)
    wait_until(lambda: pgc.states().get("completed") == 1, 30, "the job to complete")
    assert worker.alive


def test_role_connection_limit_refuses_a_worker_it_cannot_serve(pg_url: str) -> None:
    """A role limited to 5 connections (CONNECTION LIMIT) cannot serve a worker needing
    10 + 10 + 1: configure_worker refuses it, naming the role's limit and the fixes."""
    role = f"errands_limited_{secrets.token_hex(4)}"
    admin = psycopg.connect(pg_base_url(), autocommit=True)
    admin.execute(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT 5")
    try:
        url = pg_url.replace("postgres@", f"{role}@", 1).replace("auto_migrate=true", "")
        backend = PostgresBackend(url)
        try:
            with pytest.raises(errands.ConfigurationError) as refused:
                backend.configure_worker(10)
        finally:
            backend.close()
        message = str(refused.value)
        assert f"role '{role}' has CONNECTION LIMIT 5" in message, message
        assert "this worker may open 21 connections" in message, message
        assert "raise the role's CONNECTION LIMIT" in message, message
    finally:
        admin.execute(f"DROP ROLE {role}")
        admin.close()


def test_handler_pool_keeps_the_largest_concurrency_of_the_workers_started_on_the_backend(
    pg_url: str,
) -> None:
    """Two workers started on one backend (-c 12, then -c 5): twelve handlers can still
    hold ctx.transaction() at once; each transaction is a real open one on its own
    connection."""
    backend = PostgresBackend(pg_url)
    held = []
    try:
        backend.configure_worker(12)
        backend.configure_worker(5)
        for _ in range(12):
            held.append(backend.tx_begin())
        assert len({conn.info.backend_pid for conn in held}) == 12
        assert all(conn.info.transaction_status.name == "INTRANS" for conn in held)
    finally:
        for conn in held:
            backend.tx_rollback(conn)
        backend.close()
