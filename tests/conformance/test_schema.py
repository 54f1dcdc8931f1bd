"""Schema: migrations are idempotent and leave a current schema."""

from __future__ import annotations

from errands.backends import Backend

from .conftest import Harness
from .support import get, insert


def test_migrate_twice_applies_nothing_the_second_time(backend: Backend) -> None:
    """A store that is already current gets no migration applied."""
    assert backend.migrate() == []
    assert backend.migrate() == []


def test_schema_check_passes_after_migrate(backend: Backend) -> None:
    """A migrated store passes the worker's start-up schema check."""
    backend.migrate()
    assert backend.schema_check() is None  # raises SchemaOutdated otherwise


def test_migrate_keeps_existing_jobs(backend: Backend) -> None:
    """Running migrate on a store with jobs leaves them untouched."""
    job_id = insert(backend, key="keep")
    backend.migrate()
    assert get(backend, job_id).idempotency_key == "keep"


def _indexes(backend: Backend, harness: Harness) -> dict[str, str]:
    """Index name -> its definition, from the store's catalogue."""
    if harness.name == "sqlite":
        import sqlite3
        from contextlib import closing

        with closing(sqlite3.connect(backend.path)) as conn:  # type: ignore[attr-defined]
            rows = conn.execute(
                "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"
            ).fetchall()
        return {name: " ".join(sql.split(" ON ", 1)[1].split()) for name, sql in rows}
    import psycopg

    with psycopg.connect(backend.config.conninfo) as conn:  # type: ignore[attr-defined]
        rows = conn.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = %s",
            (backend.schema,),  # type: ignore[attr-defined]
        ).fetchall()
    return {name: definition.split(" ON ", 1)[1] for name, definition in rows}


def test_no_two_indexes_of_the_schema_are_the_same(backend: Backend, harness: Harness) -> None:
    """Each index is there once: a duplicate costs every write to the table twice
    (errands_jobs_running_keys repeated errands_jobs_running_key until version 7)."""
    indexes = _indexes(backend, harness)
    by_definition: dict[str, list[str]] = {}
    for name, definition in indexes.items():
        by_definition.setdefault(definition, []).append(name)
    assert [names for names in by_definition.values() if len(names) > 1] == []
    assert "errands_jobs_running_key" in indexes
    assert "errands_jobs_limited" in indexes
