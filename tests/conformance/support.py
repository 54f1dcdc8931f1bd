"""Small builders the conformance tests share; they only use the Backend protocol."""

from __future__ import annotations

import json
from typing import Any

from errands.backends import Backend
from errands.backends.base import ClaimParams, FinishParams, QueueClaim
from errands.jobs import EnqueueRequest, JobRow

JOB = "conformance.job"
QUEUE = "default"
WORKER = "worker-1"
LEASE = 30.0


def request(
    *,
    name: str = JOB,
    queue: str = QUEUE,
    args_json: str = "{}",
    priority: int = 0,
    max_attempts: int = 3,
    delay: float = 0.0,
    run_at: float | None = None,
    key: str | None = None,
    timeout: float | None = None,
    lease_seconds: float | None = None,
    meta: dict[str, Any] | None = None,
) -> EnqueueRequest:
    return EnqueueRequest(
        name=name,
        queue=queue,
        args_json=args_json,
        priority=priority,
        max_attempts=max_attempts,
        delay=delay,
        run_at=run_at,
        key=key,
        timeout=timeout,
        lease_seconds=lease_seconds,
        meta=meta or {},
    )


def insert(backend: Backend, **fields: Any) -> int:
    """Insert one job built by :func:`request`; return its id."""
    (result,) = backend.job_insert_many([request(**fields)])
    return result.id


def claim(
    backend: Backend,
    queue: str = QUEUE,
    limit: int = 10,
    *,
    worker_id: str = WORKER,
    lease: float = LEASE,
    suspects: bool = False,
) -> list[JobRow]:
    return backend.job_claim(
        ClaimParams(
            queues=[QueueClaim(queue, limit)],
            limit=limit,
            worker_id=worker_id,
            lease_seconds_default=lease,
            suspects=suspects,
        )
    )


def claim_one(backend: Backend, queue: str = QUEUE, **kwargs: Any) -> JobRow:
    rows = claim(backend, queue, 1, **kwargs)
    assert len(rows) == 1, f"expected one claimable job on {queue!r}, got {rows}"
    return rows[0]


def get(backend: Backend, job_id: int) -> JobRow:
    row = backend.job_get(job_id)
    assert row is not None, f"job {job_id} is missing"
    return row


def error(attempt: int = 1, message: str = "boom") -> dict[str, Any]:
    return {
        "attempt": attempt,
        "type": "RuntimeError",
        "message": message,
        "traceback": None,
        "worker": WORKER,
    }


def finish(backend: Backend, row: JobRow, state: str, **fields: Any) -> bool:
    assert row.lease_token is not None
    (ok,) = backend.job_finish_many(
        [FinishParams(id=row.id, lease_token=row.lease_token, state=state, **fields)]  # type: ignore[arg-type]
    )
    return ok


def make_dead(backend: Backend, **fields: Any) -> int:
    """A job that went through one attempt and ended in the dead-letter queue.

    It is inserted with a top priority so the one-job claim picks it before any other.
    """
    fields.setdefault("priority", 1_000_000)
    job_id = insert(backend, **fields)
    row = claim_one(backend, fields.get("queue", QUEUE))
    assert row.id == job_id, f"claimed job {row.id} instead of {job_id}"
    assert finish(backend, row, "dead", error=error())
    return job_id


def errors_of(row: JobRow) -> list[dict[str, Any]]:
    return json.loads(row.errors)  # type: ignore[no-any-return]
