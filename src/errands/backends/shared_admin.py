"""The admin-side methods whose SQL differs per backend but whose Python does not:
listing jobs, the worker registry, finding jobs by key, counts per queue.

A backend's admin mixin inherits :class:`SharedAdmin` and supplies two primitives,
``_read_rows(query, params)`` and ``_write_count(query, params)``, which run a named
query of its own ``queries.sql`` (in a read connection, or in a write transaction
returning the rows changed).
"""

from __future__ import annotations

from typing import Any

from ..jobs import JobRow
from .base import ActionParams, ListParams, WorkerInfo


class SharedAdmin:
    def _read_rows(self, query: str, params: dict[str, Any] | None = None) -> list[Any]:
        raise NotImplementedError

    def _write_count(self, query: str, params: dict[str, Any]) -> int:
        raise NotImplementedError

    def job_list(self, params: ListParams) -> list[JobRow]:
        rows = self._read_rows(
            "job_list",
            {
                "state": params.state,
                "queue": params.queue,
                "name": params.name,
                "before_id": params.before_id,
                "parent_id": params.parent_id,
                "limit": params.limit,
            },
        )
        return [JobRow(*r) for r in rows]

    def job_find_by_key(self, key: str, limit: int = 50) -> list[JobRow]:
        return [
            JobRow(*r) for r in self._read_rows("job_find_by_key", {"key": key, "limit": limit})
        ]

    def job_count_by_queue(self, state: str) -> dict[str, int]:
        return {q: int(n) for q, n in self._read_rows("job_count_by_queue", {"state": state})}

    # -- the worker registry ---------------------------------------------------------------
    def worker_register(self, info: WorkerInfo) -> None:
        self._write_count(
            "worker_register",
            {
                "id": info.id,
                "host": info.host,
                "pid": info.pid,
                "queues": info.queues,
                "concurrency": info.concurrency,
                "version": info.version,
            },
        )

    def worker_heartbeat(self, worker_id: str, in_flight: int, processed: int) -> None:
        self._write_count(
            "worker_heartbeat", {"id": worker_id, "in_flight": in_flight, "processed": processed}
        )

    def worker_deregister(self, worker_id: str) -> None:
        self._write_count("worker_deregister", {"id": worker_id})

    def worker_list(self) -> list[WorkerInfo]:
        return [
            WorkerInfo(
                id=r[0], host=r[1], pid=r[2], queues=r[3], concurrency=r[4], started_at=r[5],
                heartbeat_at=r[6], in_flight=r[7], processed=r[8], version=r[9],
                heartbeat_age=max(r[10], 0.0),
            )
            for r in self._read_rows("worker_list")
        ]  # fmt: skip

    def worker_prune(self, older_than: float) -> int:
        return self._write_count("worker_prune", {"older_than": older_than})


def action_detail(params: ActionParams) -> dict[str, Any]:
    """The audit detail of a replay or discard: its reason, and whether it was fresh."""
    detail: dict[str, Any] = {}
    if params.reason:
        detail["reason"] = params.reason
    if params.fresh:
        detail["fresh"] = True
    return detail
