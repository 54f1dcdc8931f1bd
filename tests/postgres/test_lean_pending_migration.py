"""Schema version 16 on PostgreSQL: available rows leave the listing indexes.

Its migration replaces errands_jobs_state_queue / _name by errands_jobs_listed_queue /
_name, which leave out available rows. An operator may build the new indexes first with
CREATE INDEX CONCURRENTLY (the migration then skips them): one left invalid by a failed
build is built again, and one built with another condition stops the migration with a
message that names it, instead of a schema that silently keeps the old cost.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from errands.backends.postgres.backend import MIGRATIONS, fill_markers
from tests.pg import fresh_schema_conn

LEAN = next(text for version, _, text in MIGRATIONS if version == 16)


def _run_16(conn: Any) -> None:
    schema = conn.execute("SELECT current_schema()").fetchone()[0]
    conn.execute(fill_markers(LEAN, schema).encode())


def _predicate(conn: Any, index: str) -> tuple[str, bool]:
    row = conn.execute(
        "SELECT pg_get_expr(indpred, indrelid), indisvalid FROM pg_index "
        "WHERE indexrelid = to_regclass(%s)",
        (index,),
    ).fetchone()
    return row[0], row[1]


def test_listing_indexes_leave_out_available_running_and_completed_rows() -> None:
    """After migrating, both listing indexes hold no available row, and the old ones are
    gone; running the migration again changes nothing."""
    for conn, _ in fresh_schema_conn():
        for index in ("errands_jobs_listed_queue", "errands_jobs_listed_name"):
            predicate, valid = _predicate(conn, index)
            assert valid and "'available'" in predicate and "'completed'" in predicate
        old = conn.execute(
            "SELECT to_regclass('errands_jobs_state_queue'), to_regclass('errands_jobs_state_name')"
        ).fetchone()
        assert old == (None, None)
        _run_16(conn)
        assert _predicate(conn, "errands_jobs_listed_name")[1]


def test_an_index_left_invalid_by_a_concurrent_build_is_built_again() -> None:
    """An invalid index of the new name (a CREATE INDEX CONCURRENTLY that failed) is
    dropped and built again, valid, with its condition."""
    for conn, _ in fresh_schema_conn():
        conn.execute(
            "UPDATE pg_index SET indisvalid = false "
            "WHERE indexrelid = to_regclass('errands_jobs_listed_queue')"
        )
        _run_16(conn)
        predicate, valid = _predicate(conn, "errands_jobs_listed_queue")
        assert valid and "'available'" in predicate


def test_an_index_built_with_another_condition_stops_the_migration_naming_it() -> None:
    """An index of the new name built with the old condition (available rows in it) is
    not taken for the new one: the migration stops and names it."""
    for conn, _ in fresh_schema_conn():
        conn.execute("DROP INDEX errands_jobs_listed_name")
        conn.execute(
            "CREATE INDEX errands_jobs_listed_name ON errands_jobs (state, name, id) "
            "WHERE state NOT IN ('running', 'completed')"
        )
        with pytest.raises(psycopg.errors.RaiseException, match="errands_jobs_listed_name"):
            _run_16(conn)
