"""What the admin API, the CLI and the dashboard ask of PostgreSQL, apart from the
worker's path: reading jobs, admin actions, the worker registry, store health and the
dashboard's aggregates. A mixin of :class:`PostgresBackend`, whose connections and
queries it uses."""

from __future__ import annotations

import json
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

if TYPE_CHECKING:
    import psycopg


class PostgresAdmin(SharedAdmin):
    q: dict[str, str]
    schema: str

    if TYPE_CHECKING:  # provided by PostgresBackend

        def _conn(
            self, timeout: float | None = None
        ) -> AbstractContextManager[psycopg.Connection[Any]]: ...

        def _tx(self) -> AbstractContextManager[psycopg.Connection[Any]]: ...

        def _maybe_notify(self, conn: psycopg.Connection[Any], queues: set[str]) -> None: ...

    def _read_rows(self, query: str, params: dict[str, Any] | None = None) -> list[Any]:
        with self._conn() as conn:
            return conn.execute(self.q[query], params).fetchall()

    def _write_count(self, query: str, params: dict[str, Any]) -> int:
        with self._conn() as conn:
            return conn.execute(self.q[query], params).rowcount

    # -- reading -------------------------------------------------------------------------
    def job_get(self, job_id: int) -> JobRow | None:
        with self._conn() as conn:
            row = conn.execute(self.q["job_get"], {"id": job_id}).fetchone()
        return None if row is None else JobRow(*row)

    def queue_stats(self) -> list[QueueStats]:
        with self._conn() as conn:
            rows = conn.execute(self.q["queue_stats"]).fetchall()
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

    def audit_list(self, limit: int = 100, job_id: int | None = None) -> list[AuditEvent]:
        with self._conn() as conn:
            rows = conn.execute(self.q["audit_list"], {"limit": limit, "job_id": job_id}).fetchall()
        return [
            AuditEvent(id=r[0], at=r[1], actor=r[2], action=r[3], job_id=r[4],
                       detail=json.loads(r[5]))
            for r in rows
        ]  # fmt: skip

    def db_now(self) -> float:
        with self._conn() as conn:
            return float(conn.execute(self.q["db_now"]).fetchone()[0])  # type: ignore[index]

    # -- admin actions -------------------------------------------------------------------
    def _dead_action(self, params: ActionParams, query: str, action: str) -> ActionResult:
        with self._tx() as conn:
            if params.all_matching:
                ids = [
                    r[0]
                    for r in conn.execute(
                        self.q["job_ids_matching"],
                        {"state": "dead", "queue": params.queue, "name": params.name},
                    ).fetchall()
                ]
            else:
                ids = list(dict.fromkeys(params.ids))
            matched: list[int] = []
            skipped: dict[int, str] = {}
            for job_id in ids:
                row = conn.execute(self.q["job_state_for_update"], {"id": job_id}).fetchone()
                if row is None:
                    skipped[job_id] = "no such job"
                elif row[0] != "dead":
                    skipped[job_id] = f"not in the dead-letter queue (state {row[0]})"
                else:
                    matched.append(job_id)
            if params.dry_run:
                return ActionResult(matched=matched, skipped=skipped)
            for job_id in matched:
                if action == "replay" and params.fresh:
                    conn.execute(self.q["steps_delete"], {"job_id": job_id})
                conn.execute(
                    self.q[query], {"id": job_id, "actor": params.actor, "reason": params.reason}
                )
                conn.execute(
                    self.q["audit_insert"],
                    {
                        "actor": params.actor,
                        "action": action,
                        "job_id": job_id,
                        "detail": json.dumps(action_detail(params)),
                    },
                )
        if action == "replay" and matched and not params.dry_run:
            queues = set()
            for job_id in matched[:100]:
                row = self.job_get(job_id)
                if row is not None:
                    queues.add(row.queue)
            with self._conn() as conn:
                self._maybe_notify(conn, queues)
        return ActionResult(matched=matched, skipped=skipped)

    def job_replay(self, params: ActionParams) -> ActionResult:
        return self._dead_action(params, "job_replay", "replay")

    def job_discard(self, params: ActionParams) -> ActionResult:
        if not (params.reason and params.reason.strip()):
            raise InvalidTransition("discard needs a reason: pass --reason TEXT (reason=...)")
        return self._dead_action(params, "job_discard", "discard")

    def job_cancel(self, job_id: int, actor: str) -> CancelResult:
        with self._tx() as conn:
            row = conn.execute(self.q["job_state_for_update"], {"id": job_id}).fetchone()
            if row is None:
                raise JobNotFound(f"no job with id {job_id}")
            previous = row[0]
            if previous in ("available", "scheduled", "retryable"):
                conn.execute(self.q["job_cancel_pending"], {"id": job_id})
                state = "cancelled"
            elif previous == "running":
                conn.execute(self.q["job_cancel_running"], {"id": job_id})
                state = "running"
            else:
                raise InvalidTransition(
                    f"job {job_id} is {previous}; only scheduled, available, retryable or "
                    "running jobs can be cancelled"
                )
            conn.execute(
                self.q["audit_insert"],
                {
                    "actor": actor,
                    "action": "cancel",
                    "job_id": job_id,
                    "detail": json.dumps({"previous_state": previous}),
                },
            )
        return CancelResult(id=job_id, previous_state=previous, state=state)

    # -- the worker registry ---------------------------------------------------------------
    # -- health --------------------------------------------------------------------------
    def store_health(self) -> StoreHealth:
        with self._conn() as conn:
            row = conn.execute(self.q["store_health"], {"schema": self.schema}).fetchone()
        dead, live, oldest = row if row is not None else (None, None, None)
        return StoreHealth(
            dead_tuples=dead,
            live_tuples=live,
            oldest_transaction_age=None if oldest is None else max(float(oldest), 0.0),
        )

    # -- the dashboard ---------------------------------------------------------------------
    def job_throughput(self, since_seconds: float, bucket_seconds: float) -> list[Any]:
        from ..base import ThroughputBucket

        with self._conn() as conn:
            rows = conn.execute(
                self.q["job_throughput"], {"since": since_seconds, "bucket": bucket_seconds}
            ).fetchall()
        return [ThroughputBucket(float(r[0]), r[1], r[2], r[3], r[4]) for r in rows]
