"""What the admin API, the CLI and the dashboard ask of SQLite, apart from the worker's
path: reading jobs, admin actions, the worker registry, store health and the dashboard's
aggregates. A mixin of :class:`SQLiteBackend`, whose connections it uses."""

from __future__ import annotations

import json
import os
import sqlite3
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from ...errors import InvalidTransition, JobNotFound
from ...jobs import JobRow
from ..base import (
    ActionParams,
    ActionResult,
    AuditEvent,
    CancelResult,
    QueueStats,
    StoreHealth,
)
from ..shared_admin import SharedAdmin, action_detail
from .statements import Q


class SQLiteAdmin(SharedAdmin):
    memory: bool
    path: str

    if TYPE_CHECKING:  # provided by SQLiteBackend

        def _read(self) -> AbstractContextManager[sqlite3.Connection]: ...

        def _write(
            self, timeout: float | None = None
        ) -> AbstractContextManager[sqlite3.Connection]: ...

    def _read_rows(self, query: str, params: dict[str, Any] | None = None) -> list[Any]:
        with self._read() as conn:
            return conn.execute(Q[query], params or ()).fetchall()

    def _write_count(self, query: str, params: dict[str, Any]) -> int:
        with self._write() as conn:
            return conn.execute(Q[query], params).rowcount

    # -- reading -------------------------------------------------------------------------
    def job_get(self, job_id: int) -> JobRow | None:
        with self._read() as conn:
            row = conn.execute(Q["job_get"], {"id": job_id}).fetchone()
        return None if row is None else JobRow(*row)

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

    def audit_list(self, limit: int = 100, job_id: int | None = None) -> list[AuditEvent]:
        with self._read() as conn:
            rows = conn.execute(Q["audit_list"], {"limit": limit, "job_id": job_id}).fetchall()
        return [
            AuditEvent(
                id=r[0], at=r[1], actor=r[2], action=r[3], job_id=r[4], detail=json.loads(r[5])
            )
            for r in rows
        ]

    def db_now(self) -> float:
        with self._read() as conn:
            return float(conn.execute(Q["db_now"]).fetchone()[0])

    # -- the worker registry ---------------------------------------------------------------
    # -- admin actions ---------------------------------------------------------------------
    def _dead_action(self, params: ActionParams, query: str, action: str) -> ActionResult:
        with self._write() as conn:
            if params.all_matching:
                ids = [
                    r[0]
                    for r in conn.execute(
                        Q["job_ids_matching"],
                        {"state": "dead", "queue": params.queue, "name": params.name},
                    )
                ]
            else:
                ids = list(dict.fromkeys(params.ids))
            matched: list[int] = []
            skipped: dict[int, str] = {}
            for job_id in ids:
                state = conn.execute(Q["job_state"], {"id": job_id}).fetchone()
                if state is None:
                    skipped[job_id] = "no such job"
                elif state[0] != "dead":
                    skipped[job_id] = f"not in the dead-letter queue (state {state[0]})"
                else:
                    matched.append(job_id)
            if params.dry_run:  # nothing written: the COMMIT below is empty
                return ActionResult(matched=matched, skipped=skipped)
            for job_id in matched:
                if action == "replay" and params.fresh:
                    conn.execute(Q["steps_delete"], {"job_id": job_id})
                conn.execute(query, {"id": job_id, "actor": params.actor, "reason": params.reason})
                conn.execute(
                    Q["audit_insert"],
                    {
                        "actor": params.actor,
                        "action": action,
                        "job_id": job_id,
                        "detail": json.dumps(action_detail(params)),
                    },
                )
        return ActionResult(matched=matched, skipped=skipped)

    def job_replay(self, params: ActionParams) -> ActionResult:
        return self._dead_action(params, Q["job_replay"], "replay")

    def job_discard(self, params: ActionParams) -> ActionResult:
        if not (params.reason and params.reason.strip()):
            raise InvalidTransition("discard needs a reason: pass --reason TEXT (reason=...)")
        return self._dead_action(params, Q["job_discard"], "discard")

    def job_cancel(self, job_id: int, actor: str) -> CancelResult:
        with self._write() as conn:
            row = conn.execute(Q["job_state"], {"id": job_id}).fetchone()
            if row is None:
                raise JobNotFound(f"no job with id {job_id}")
            previous = row[0]
            if previous in ("available", "scheduled", "retryable"):
                conn.execute(Q["job_cancel_pending"], {"id": job_id})
                state = "cancelled"
            elif previous == "running":
                conn.execute(Q["job_cancel_running"], {"id": job_id})
                state = "running"
            else:
                raise InvalidTransition(
                    f"job {job_id} is {previous}; only scheduled, available, retryable or "
                    "running jobs can be cancelled"
                )
            conn.execute(
                Q["audit_insert"],
                {
                    "actor": actor,
                    "action": "cancel",
                    "job_id": job_id,
                    "detail": json.dumps({"previous_state": previous}),
                },
            )
        return CancelResult(id=job_id, previous_state=previous, state=state)

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
