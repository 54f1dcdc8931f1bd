"""The SQL of the SQLite backend, loaded once: the named queries of ``queries.sql`` and
the numbered migrations of ``migrations/``."""

from __future__ import annotations

from ..sqlfile import load_migrations, load_queries

Q = load_queries(__package__) | load_queries(__package__, "workflows.sql")
_UPSERT = Q.pop("fair_fold_upsert")  # a fragment, not run alone
for _fold in ("fair_fold", "fair_fold_many"):  # one upsert of a key's usage for both
    Q[_fold] = Q[_fold].rstrip() + "\n" + _UPSERT
MIGRATIONS = load_migrations(__package__)
SCHEMA_VERSION = MIGRATIONS[-1][0]
