"""``JobHandle``: what enqueue returns — the id, and a way to follow the job."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .errors import JobCancelled, JobFailed, JobNotFound, ResultTimeout
from .jobs import Job, JobState

if TYPE_CHECKING:
    from .app import App
    from .backends.base import CancelResult

POLL_INTERVAL_DEFAULT = 0.05


class JobHandle:
    __slots__ = ("app", "deduplicated", "id", "name")

    def __init__(self, app: App, job_id: int, name: str, deduplicated: bool = False) -> None:
        self.app = app
        self.id = job_id
        self.name = name
        self.deduplicated = deduplicated

    def __repr__(self) -> str:
        dedup = " deduplicated" if self.deduplicated else ""
        return f"<JobHandle {self.id} {self.name}{dedup}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JobHandle) and other.id == self.id and other.app is self.app

    def __hash__(self) -> int:
        return hash(self.id)

    def job(self) -> Job:
        return self.app.get_job(self.id)

    def status(self) -> JobState:
        return self.job().state

    def cancel(self, actor: str = "api") -> CancelResult:
        return self.app.cancel(self.id, actor=actor)

    def result(self, timeout: float | None = None, poll: float = POLL_INTERVAL_DEFAULT) -> Any:
        """Wait for the job to finish and return its result.

        Raises JobFailed when it is dead (in the DLQ), JobCancelled when cancelled or
        discarded, ResultTimeout when ``timeout`` seconds pass first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = min(poll, 0.01)
        while True:
            try:
                job = self.app.get_job(self.id)
            except JobNotFound:
                raise JobNotFound(
                    f"job {self.id} no longer exists (pruned after the retention period?)"
                ) from None
            if job.state is JobState.COMPLETED:
                definition = self.app.registry.get(job.name)
                return definition.payload.decode_result(job.result) if definition else job.result
            if job.state is JobState.DEAD:
                last = job.last_error
                detail = f"{last.type}: {last.message}" if last else "no error recorded"
                raise JobFailed(
                    f"job {self.id} ({job.name}) is dead after {job.attempt} attempt(s): {detail}",
                    job_id=self.id,
                    last_error=None if last is None else last.__dict__,
                )
            if job.state in (JobState.CANCELLED, JobState.DISCARDED):
                raise JobCancelled(f"job {self.id} ({job.name}) was {job.state.value}")
            if deadline is not None and time.monotonic() >= deadline:
                raise ResultTimeout(
                    f"job {self.id} ({job.name}) is still {job.state.value} after {timeout} s"
                )
            time.sleep(
                delay if deadline is None else max(min(delay, deadline - time.monotonic()), 0)
            )
            delay = min(delay * 2, poll)
