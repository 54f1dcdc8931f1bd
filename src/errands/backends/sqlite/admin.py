"""What the admin API, the CLI and the dashboard ask of SQLite, apart from the worker's
path: reading jobs, admin actions, the worker registry, store health and the dashboard's
aggregates. A mixin of :class:`SQLiteBackend`, whose connections it uses."""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

from ..base import (
    QueueStats,
    StoreHealth,
)
from ..shared_admin import SharedAdmin, TxRun
from .statements import Q


class SQLiteAdmin(SharedAdmin):
    memory: bool
    path: str
    # A bulk replay or discard commits BULK_CHUNK jobs at a time: every other writer of
    # the file (enqueues, claims, heartbeats) waits while one write transaction runs, and
    # 1,000,000 jobs in one took 16 s even set-based (heartbeats give up after a third of
    # a lease: running jobs then stop themselves).
    BULK_COMMITS = True

    if TYPE_CHECKING:  # provided by SQLiteBackend

        def _read(self) -> AbstractContextManager[sqlite3.Connection]: ...

        def _write(
            self, timeout: float | None = None
        ) -> AbstractContextManager[sqlite3.Connection]: ...

    def _statement(self, query: str) -> str:
        return Q[query]

    def _id_list(self, ids: list[int]) -> Any:
        return json.dumps(ids)

    def _read_rows(self, query: str, params: dict[str, Any] | None = None) -> list[Any]:
        with self._read() as conn:
            return conn.execute(Q[query], params or ()).fetchall()

    def _write_count(self, query: str, params: dict[str, Any]) -> int:
        with self._write() as conn:
            return conn.execute(Q[query], params).rowcount

    @contextmanager
    def _transaction(self) -> Iterator[TxRun]:
        with self._write() as conn:
            yield TxRun(conn, Q, ())

    # -- reading -------------------------------------------------------------------------
    def queue_stats(self) -> list[QueueStats]:
        with self._read() as conn:
            rows = conn.execute(Q["queue_stats"]).fetchall()
        by_queue: dict[str, dict[str, Any]] = {}
        for queue, state, n, oldest_due, now, stalled in rows:
            entry = by_queue.setdefault(
                queue, {"counts": {}, "oldest": None, "now": now, "stalled": 0}
            )
            entry["counts"][state] = n
            entry["stalled"] += stalled or 0
            if oldest_due is not None and (entry["oldest"] is None or oldest_due < entry["oldest"]):
                entry["oldest"] = oldest_due
        return [
            QueueStats(
                queue=queue,
                counts=entry["counts"],
                oldest_available_age=None
                if entry["oldest"] is None
                else max(entry["now"] - entry["oldest"], 0.0),
                stalled=entry["stalled"],
            )
            for queue, entry in sorted(by_queue.items())
        ]

    # -- health --------------------------------------------------------------------------
    def store_health(self) -> StoreHealth:
        with self._read() as conn:
            pages, free = conn.execute(Q["store_health"]).fetchone()
        wal: int | None = None
        if not self.memory:
            try:
                wal = os.path.getsize(self.path + "-wal")
            except OSError:
                wal = 0  # no WAL file right now
        return StoreHealth(page_count=pages, freelist_count=free, wal_bytes=wal)

    # -- the dashboard ---------------------------------------------------------------------
    def job_throughput(self, since_seconds: float, bucket_seconds: float) -> list[Any]:
        from ..base import ThroughputBucket

        with self._read() as conn:
            rows = conn.execute(
                Q["job_throughput"], {"since": since_seconds, "bucket": bucket_seconds}
            ).fetchall()
        return [ThroughputBucket(float(r[0]), r[1], r[2] or 0, r[3] or 0, r[4] or 0) for r in rows]
