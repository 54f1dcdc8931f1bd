"""What the admin API, the CLI and the dashboard ask of PostgreSQL, apart from the
worker's path: reading jobs, admin actions, the worker registry, store health and the
dashboard's aggregates. A mixin of :class:`PostgresBackend`, whose connections and
queries it uses."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from ..base import (
    QueueStats,
    StoreHealth,
)
from ..shared_admin import SharedAdmin, TxRun

if TYPE_CHECKING:
    import psycopg

T = TypeVar("T")


class PostgresAdmin(SharedAdmin):
    STATE_QUERY = "job_state_for_update"
    q: dict[str, str]
    schema: str

    if TYPE_CHECKING:  # provided by PostgresBackend

        def _conn(
            self, timeout: float | None = None
        ) -> AbstractContextManager[psycopg.Connection[Any]]: ...

        def _tx(self) -> AbstractContextManager[psycopg.Connection[Any]]: ...

        def _read(self, work: Callable[[psycopg.Connection[Any]], T]) -> T: ...

        def _maybe_notify(self, conn: psycopg.Connection[Any], queues: set[str]) -> None: ...

    def _statement(self, query: str) -> str:
        return self.q[query]

    def _lock_conflict(self, exc: BaseException) -> bool:
        # deadlock_detected, serialization_failure: the server rolled the transaction back
        return getattr(exc, "sqlstate", None) in ("40P01", "40001")

    # Reads run again on a fresh connection when theirs is lost (a restart, a killed
    # session): an application's reads after a fail-over succeed at the first call.
    def _read_rows(self, query: str, params: dict[str, Any] | None = None) -> list[Any]:
        return self._read(lambda conn: conn.execute(self.q[query], params).fetchall())

    def _write_count(self, query: str, params: dict[str, Any]) -> int:
        with self._conn() as conn:
            return conn.execute(self.q[query], params).rowcount

    @contextmanager
    def _transaction(self) -> Iterator[TxRun]:
        with self._tx() as conn:
            yield TxRun(conn, self.q, None)

    def _replayed(self, ids: list[int], queues: set[str] | None = None) -> None:
        if queues is None:
            queues = set()
            for job_id in ids[:100]:
                row = self.job_get(job_id)
                if row is not None:
                    queues.add(row.queue)
        with self._conn() as conn:
            self._maybe_notify(conn, queues)

    # -- reading -------------------------------------------------------------------------
    def queue_stats(self) -> list[QueueStats]:
        rows = self._read_rows("queue_stats")
        by_queue: dict[str, dict[str, Any]] = {}
        for queue, state, n, oldest, stalled in rows:
            entry = by_queue.setdefault(queue, {"counts": {}, "oldest": None, "stalled": 0})
            entry["counts"][state] = n
            entry["stalled"] += stalled or 0
            if oldest is not None and (entry["oldest"] is None or oldest > entry["oldest"]):
                entry["oldest"] = max(oldest, 0.0)
        return [
            QueueStats(
                queue=q, counts=e["counts"], oldest_available_age=e["oldest"], stalled=e["stalled"]
            )
            for q, e in sorted(by_queue.items())
        ]

    # -- health --------------------------------------------------------------------------
    def store_health(self) -> StoreHealth:
        rows = self._read_rows("store_health", {"schema": self.schema})
        row = rows[0] if rows else None
        dead, live, oldest = row if row is not None else (None, None, None)
        return StoreHealth(
            dead_tuples=dead,
            live_tuples=live,
            oldest_transaction_age=None if oldest is None else max(float(oldest), 0.0),
        )

    def wal_trim(self) -> None:
        """Nothing: the server manages its own write-ahead log."""

    # -- the dashboard ---------------------------------------------------------------------
    def job_throughput(self, since_seconds: float, bucket_seconds: float) -> list[Any]:
        from ..base import ThroughputBucket

        rows = self._read_rows("job_throughput", {"since": since_seconds, "bucket": bucket_seconds})
        return [ThroughputBucket(float(r[0]), r[1], r[2], r[3], r[4]) for r in rows]
