"""The few writes the test tools make to the job store directly (internal).

They live here, not in the :class:`~errands.backends.base.Backend` protocol, because no
production code may move time or make a job due early. Each store gets the same four
operations, in its own SQL dialect:

- ``shift(seconds, keep_tokens)``: move every time stored about jobs ``seconds`` into the
  past (what advancing the test clock means); leases held by live attempts are kept;
- ``make_due(ids)``: a scheduled job becomes due now (inline mode ignores ``delay=``);
- ``next_wakeup(...)``: seconds until the next retry, schedule or lease expiry;
- ``pending_queues()``: the queues that hold pending jobs.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, Protocol

PENDING = ("available", "scheduled", "retryable")


class StoreTools(Protocol):
    def shift(self, seconds: float, keep_tokens: Collection[str]) -> None: ...

    def make_due(self, ids: Sequence[int]) -> None: ...

    def forget_rates(self) -> None: ...

    def next_wakeup(
        self, queue: str | None, scheduled: bool, keep_tokens: Collection[str]
    ) -> float | None: ...

    def pending_queues(self) -> list[str]: ...

    def busy(self, queue: str | None) -> bool: ...


def store_tools(backend: Any) -> StoreTools:
    module = type(backend).__module__
    if module.startswith("errands.backends.sqlite"):
        return _SQLiteTools(backend)
    if module.startswith("errands.backends.postgres"):
        return _PostgresTools(backend)
    raise TypeError(
        f"errands.testing does not know the store {type(backend).__name__}; it supports the "
        "SQLite and PostgreSQL backends"
    )


_SQLITE_NOW = "((julianday('now') - 2440587.5) * 86400.0)"


class _SQLiteTools:
    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def shift(self, seconds: float, keep_tokens: Collection[str]) -> None:
        keep = list(keep_tokens)
        held = f"lease_token IN ({', '.join('?' * len(keep))})" if keep else "0"
        with self.backend._write() as conn:
            conn.execute(
                "UPDATE errands_jobs SET run_at = run_at - ?, inserted_at = inserted_at - ?, "
                "attempted_at = attempted_at - ?, finished_at = finished_at - ?, "
                "unique_until = unique_until - ?, wait_until = wait_until - ?, "
                f"lease_expires_at = CASE WHEN {held} THEN lease_expires_at "
                "ELSE lease_expires_at - ? END",
                (seconds, seconds, seconds, seconds, seconds, seconds, *keep, seconds),
            )
            conn.execute(
                "UPDATE errands_workflows SET created_at = created_at - ?, "
                "settled_at = settled_at - ?",
                (seconds, seconds),
            )

    def forget_rates(self) -> None:
        """Every start the rate limits counted (drain() applies no rate)."""
        with self.backend._write() as conn:
            conn.execute("DELETE FROM errands_rate_log")

    def make_due(self, ids: Sequence[int]) -> None:
        if not ids:
            return
        marks = ", ".join("?" * len(ids))
        with self.backend._write() as conn:
            conn.execute(
                f"UPDATE errands_jobs SET run_at = {_SQLITE_NOW} "
                f"WHERE id IN ({marks}) AND state = 'scheduled'",
                tuple(ids),
            )

    def next_wakeup(
        self, queue: str | None, scheduled: bool, keep_tokens: Collection[str]
    ) -> float | None:
        states = ("retryable", "available", "scheduled") if scheduled else ("retryable",)
        keep = list(keep_tokens)
        held = f"AND lease_token NOT IN ({', '.join('?' * len(keep))})" if keep else ""
        with self.backend._read() as conn:
            row = conn.execute(
                "SELECT min(t) - " + _SQLITE_NOW + " FROM ("
                "SELECT run_at AS t FROM errands_jobs "
                f"WHERE state IN ({', '.join('?' * len(states))}) AND (? IS NULL OR queue = ?) "
                "UNION ALL SELECT lease_expires_at FROM errands_jobs "
                f"WHERE state = 'running' AND (? IS NULL OR queue = ?) {held} "
                "UNION ALL SELECT wait_until FROM errands_jobs "  # a signal's wait running out
                "WHERE state = 'waiting' AND (? IS NULL OR queue = ?))",
                (*states, queue, queue, queue, queue, *keep, queue, queue),
            ).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def pending_queues(self) -> list[str]:
        with self.backend._read() as conn:
            rows = conn.execute(
                "SELECT DISTINCT queue FROM errands_jobs WHERE state IN (?, ?, ?) ORDER BY queue",
                PENDING,
            ).fetchall()
        return [r[0] for r in rows]

    def busy(self, queue: str | None) -> bool:
        with self.backend._read() as conn:
            row = conn.execute(
                "SELECT 1 FROM errands_jobs WHERE (? IS NULL OR queue = ?) "
                "AND (state = 'running' OR (state IN ('available', 'scheduled', 'retryable') "
                f"AND run_at <= {_SQLITE_NOW})) LIMIT 1",
                (queue, queue),
            ).fetchone()
        return row is not None


class _PostgresTools:
    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.table = f'"{backend.schema}".errands_jobs'

    def shift(self, seconds: float, keep_tokens: Collection[str]) -> None:
        with self.backend._tx() as conn:
            conn.execute(
                f"UPDATE {self.table} SET run_at = run_at - d, inserted_at = inserted_at - d, "
                "attempted_at = attempted_at - d, finished_at = finished_at - d, "
                "unique_until = unique_until - d, wait_until = wait_until - d, "
                "lease_expires_at = CASE WHEN lease_token = ANY(%(keep)s::text[]) "
                "THEN lease_expires_at ELSE lease_expires_at - d END "
                "FROM (SELECT make_interval(secs => %(seconds)s) AS d) AS shift",
                {"seconds": seconds, "keep": list(keep_tokens)},
            )
            conn.execute(
                f'UPDATE "{self.backend.schema}".errands_workflows '
                "SET created_at = created_at - d, settled_at = settled_at - d "
                "FROM (SELECT make_interval(secs => %(seconds)s) AS d) AS shift",
                {"seconds": seconds},
            )

    def forget_rates(self) -> None:
        """Every start the rate limits counted (drain() applies no rate)."""
        with self.backend._conn() as conn:
            conn.execute(f'DELETE FROM "{self.backend.schema}".errands_rate_log')

    def make_due(self, ids: Sequence[int]) -> None:
        if not ids:
            return
        with self.backend._conn() as conn:
            conn.execute(
                f"UPDATE {self.table} SET run_at = now() "
                "WHERE id = ANY(%(ids)s::bigint[]) AND state = 'scheduled'",
                {"ids": list(ids)},
            )

    def next_wakeup(
        self, queue: str | None, scheduled: bool, keep_tokens: Collection[str]
    ) -> float | None:
        states = ["retryable", "available", "scheduled"] if scheduled else ["retryable"]
        with self.backend._conn() as conn:
            row = conn.execute(
                "SELECT extract(epoch FROM min(t) - now())::float8 FROM ("
                f"SELECT run_at AS t FROM {self.table} "
                "WHERE state = ANY(%(states)s::text[]) "
                "AND (%(queue)s::text IS NULL OR queue = %(queue)s::text) "
                f"UNION ALL SELECT lease_expires_at FROM {self.table} "
                "WHERE state = 'running' AND (%(queue)s::text IS NULL OR queue = %(queue)s::text) "
                "AND NOT (lease_token = ANY(%(keep)s::text[])) "
                f"UNION ALL SELECT wait_until FROM {self.table} "  # a signal's wait running out
                "WHERE state = 'waiting' AND (%(queue)s::text IS NULL OR queue = %(queue)s::text)"
                ") AS due",
                {"states": states, "queue": queue, "keep": list(keep_tokens)},
            ).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def pending_queues(self) -> list[str]:
        with self.backend._conn() as conn:
            rows = conn.execute(
                f"SELECT DISTINCT queue FROM {self.table} "
                "WHERE state = ANY(%(states)s::text[]) ORDER BY queue",
                {"states": list(PENDING)},
            ).fetchall()
        return [r[0] for r in rows]

    def busy(self, queue: str | None) -> bool:
        with self.backend._conn() as conn:
            row = conn.execute(
                f"SELECT 1 FROM {self.table} "
                "WHERE (%(queue)s::text IS NULL OR queue = %(queue)s::text) "
                "AND (state = 'running' OR (state IN ('available', 'scheduled', 'retryable') "
                "AND run_at <= now())) LIMIT 1",
                {"queue": queue},
            ).fetchone()
        return row is not None
