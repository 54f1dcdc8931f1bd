"""Schema: migrations are idempotent and leave a current schema."""

from __future__ import annotations

from errands.backends import Backend

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
