"""The SQL of the SQLite backend, loaded once: the named queries of ``queries.sql`` and
the numbered migrations of ``migrations/``."""

from __future__ import annotations

from ..sqlfile import load_migrations, load_queries

Q = load_queries(__package__) | load_queries(__package__, "workflows.sql")
MIGRATIONS = load_migrations(__package__)
SCHEMA_VERSION = MIGRATIONS[-1][0]
