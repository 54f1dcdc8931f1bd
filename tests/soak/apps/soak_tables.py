"""The soak's own tables, beside errands' in the same store, and the SQL dialect helpers.

Shared by the worker processes (the handlers append to them) and the harness (which
creates them and checks them). Nothing here is errands: the handlers write these rows
through their own connections (or through ``ctx.transaction()``), so the checker counts
what really ran independently of what errands recorded.

- ``soak_effects``: append-only, one row per thing a handler did: ``run`` (a handler
  started: one row per execution), ``end`` (a slow handler stopped or finished), ``tx``
  (written through ``ctx.transaction()``, commits with the completion), ``psp_call``
  (a call that reached the fake payment provider) and ``hook`` (an ``on_dead`` hook ran;
  its ``detail`` is the job's state then). Each row carries the attempt and the
  lease token of the claim that ran it, the claimed row's ``run_at`` and claim time, the
  worker and the database time.
- ``soak_charges``: the fake payment provider's charges, at most one per idempotency key
  (what real providers promise).
- ``soak_orders``: the business rows of transactional enqueues (RELIABILITY I2).
"""

from __future__ import annotations

# {q}: the schema qualifier ('"schema".' on PostgreSQL, '' on SQLite); {serial}, {float}:
# the dialect's column types.
TABLES = (
    """CREATE TABLE IF NOT EXISTS {q}soak_effects (
        id {serial}, job_id BIGINT NOT NULL, attempt INTEGER NOT NULL, token TEXT,
        kind TEXT NOT NULL, name TEXT NOT NULL, pid INTEGER NOT NULL, worker TEXT NOT NULL,
        at {float} NOT NULL, run_at {float}, claimed_at {float}, detail TEXT)""",
    "CREATE INDEX IF NOT EXISTS soak_effects_job ON {q}soak_effects (job_id)",
    """CREATE TABLE IF NOT EXISTS {q}soak_charges (
        id {serial}, idem_key TEXT NOT NULL UNIQUE, job_id BIGINT NOT NULL,
        amount INTEGER NOT NULL, at {float} NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS {q}soak_orders (
        order_id BIGINT PRIMARY KEY, at {float} NOT NULL)""",
)

PG_NOW = "extract(epoch FROM clock_timestamp())::float8"
SQLITE_NOW = "((julianday('now') - 2440587.5) * 86400.0)"


def ddl(sqlite: bool, qualifier: str) -> list[str]:
    serial = (
        "INTEGER PRIMARY KEY AUTOINCREMENT"
        if sqlite
        else "BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY"
    )
    flt = "REAL" if sqlite else "DOUBLE PRECISION"
    return [s.format(q=qualifier, serial=serial, float=flt) for s in TABLES]


def dialect(sqlite: bool, sql: str) -> str:
    """Our SQL uses %s placeholders and NOW(); SQLite wants ? and its own clock."""
    if sqlite:
        return sql.replace("%s", "?").replace("NOW()", SQLITE_NOW)
    return sql.replace("NOW()", PG_NOW)
