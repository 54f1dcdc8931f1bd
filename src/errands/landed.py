"""Did a fenced write land? For a write whose reply was lost.

A batch of outcomes (or of rescues) can commit and then lose its reply: the connection
drops after the COMMIT reached the server. Retried, the same write is fenced out, since
the rows no longer hold that lease; without a second look the writer would take its own
landed outcome for a stale one, and a job it moved to the DLQ would get no ``dead`` event
and no ``on_dead`` hooks. So after a retry that followed a connection error, the writer
reads the refused rows back and asks the row itself:

- an outcome with an error entry (retryable, dead, cancelled) or a rescue landed iff the
  job's errors hold an entry with that attempt's lease token (every entry errands writes
  carries the token of the attempt it records);
- a completion landed iff the job is ``completed`` at that attempt number (a completed
  job runs no other attempt, and only the lease holder can complete it).
"""

from __future__ import annotations

import json
from typing import Any

from .jobs import JobRow


def error_tokens(row: JobRow) -> set[str]:
    """The lease tokens named by the job's error entries."""
    if '"lease_token"' not in (row.errors or ""):
        return set()
    try:
        entries = json.loads(row.errors)
    except (TypeError, ValueError, RecursionError):
        return set()
    return {
        str(e["lease_token"])
        for e in entries
        if isinstance(e, dict) and isinstance(e.get("lease_token"), str)
    }


def landed(row: JobRow | None, token: str, attempt: int, has_error: bool) -> bool:
    """Whether the write of the attempt holding ``token`` (number ``attempt``) is in the
    row: see the module doc."""
    if row is None:
        return False
    if has_error:
        return token in error_tokens(row)
    return row.state == "completed" and row.attempt == attempt


def read_back(backend: Any, ids: list[int]) -> dict[int, JobRow]:
    """The rows of ``ids`` (one query), for :func:`landed`."""
    return {row.id: row for row in backend.job_get_many(ids)}
