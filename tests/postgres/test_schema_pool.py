"""The tests' PostgreSQL schemas are reused only when nothing tells them from fresh ones
(tests/pg.py, SchemaPool): a test never sees what an earlier test left, and a schema a
test changed, still used, or analysed is dropped instead."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

import errands
from tests.pg import SchemaPool, drop_schema, pg_base_url, require_pg, with_params


@pytest.fixture
def pool() -> Iterator[SchemaPool]:
    require_pg()
    made = SchemaPool()
    yield made
    made.close()


def _enqueue_one(schema: str) -> int:
    """Enqueue a job in ``schema`` (migrated on first use): its id."""
    app = errands.App(
        with_params(pg_base_url(), schema=schema, auto_migrate="true", application_name=schema)
    )
    try:

        @app.job(name="pool.noop")
        def noop() -> None:
            pass

        return noop.enqueue().id
    finally:
        app.close()


def _used(pool: SchemaPool) -> str:
    """A schema from the pool, migrated, with a job enqueued in it."""
    schema = pool.take()
    _enqueue_one(schema)
    return schema


def _exists(schema: str) -> bool:
    with psycopg.connect(pg_base_url(), autocommit=True) as conn:
        row = conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,)).fetchone()
    return row is not None


def _sql(schema: str, statement: str) -> None:
    with psycopg.connect(pg_base_url(), autocommit=True) as conn:
        conn.execute(f'SET search_path TO "{schema}"')
        conn.execute(statement)


def test_a_schema_given_back_is_handed_out_again_empty_with_ids_from_one(
    pool: SchemaPool,
) -> None:
    first = _used(pool)
    pool.give_back(first)
    assert pool.free == [first]
    again = pool.take()
    assert again == first
    with psycopg.connect(pg_base_url(), autocommit=True) as conn:
        left = conn.execute(
            f'SELECT (SELECT count(*) FROM "{again}".errands_jobs),'
            f' (SELECT count(*) FROM "{again}".errands_workers),'
            f' (SELECT count(*) FROM "{again}".errands_migrations)'
        ).fetchone()
    assert left is not None and left[:2] == (0, 0) and left[2] > 0  # migrations kept
    try:
        assert _enqueue_one(again) == 1  # the identity restarted
    finally:
        drop_schema(again)


@pytest.mark.parametrize(
    "change",
    [
        "CREATE INDEX extra ON errands_jobs (name)",
        "ALTER TABLE errands_jobs ADD COLUMN extra int",
        "DROP INDEX errands_jobs_finished",
        "DELETE FROM errands_migrations WHERE version = 1",
        "ANALYZE errands_jobs",
        "ANALYZE errands_signals",  # empty: no statistics written, its estimates set
        "ALTER TABLE errands_jobs DISABLE TRIGGER errands_jobs_ended",
    ],
    ids=[
        "index-added",
        "column-added",
        "index-dropped",
        "migration-unrecorded",
        "analysed",
        "analysed-empty",
        "trigger-disabled",
    ],
)
def test_a_schema_that_differs_from_a_freshly_migrated_one_is_dropped(
    pool: SchemaPool, change: str
) -> None:
    schema = _used(pool)
    _sql(schema, change)
    pool.give_back(schema)
    assert pool.free == []
    assert not _exists(schema)


def test_a_schema_a_session_still_uses_is_dropped_not_reused(
    pool: SchemaPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(SchemaPool, "SESSIONS_GONE_WITHIN", 0.2)
    schema = _used(pool)
    conninfo = with_params(pg_base_url(), application_name=schema)
    lingering = psycopg.connect(conninfo, autocommit=True)
    try:
        pool.give_back(schema)  # drops it: nothing is left to wait for but the drop itself
        assert pool.free == []
    finally:
        lingering.close()
    assert not _exists(schema)


def test_a_schema_no_test_migrated_is_dropped(pool: SchemaPool) -> None:
    schema = pool.take()
    _sql("public", f'CREATE SCHEMA "{schema}"')
    pool.give_back(schema)
    assert pool.free == [] and not _exists(schema)


def _close_when_a_lock_waits(schema: str, holder: psycopg.Connection) -> None:
    """Close ``holder`` once a session waits for a lock on a relation of ``schema``, or
    after 30 s (a schema reused: then nothing waits)."""
    with psycopg.connect(pg_base_url(), autocommit=True) as conn:
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation"
                " JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE NOT l.granted AND n.nspname = %s",
                (schema,),
            ).fetchone()
            if row and row[0]:
                break
            time.sleep(0.05)
    holder.close()


def test_a_schema_whose_table_another_session_holds_locked_is_dropped(pool: SchemaPool) -> None:
    schema = _used(pool)
    holder = psycopg.connect(pg_base_url())  # a name of its own: not seen as the schema's
    holder.execute(f'SELECT count(*) FROM "{schema}".errands_signals')  # a lock, held
    # the drop waits for the lock, as it always did: the holder ends once a lock request
    # in the schema waits (a timer raced the pool's check on a loaded machine: the lock
    # was gone before the check looked)
    closer = threading.Thread(target=_close_when_a_lock_waits, args=(schema, holder))
    closer.start()
    pool.give_back(schema)
    closer.join()
    assert pool.free == []
    assert not _exists(schema)


def test_identities_start_from_one_again_also_where_the_table_was_emptied_without_restart(
    pool: SchemaPool,
) -> None:
    schema = _used(pool)
    _sql(schema, "TRUNCATE errands_jobs")  # as a TransactionTestCase's teardown does
    pool.give_back(schema)
    assert pool.free == [schema]
    try:
        assert _enqueue_one(pool.take()) == 1
    finally:
        drop_schema(schema)
