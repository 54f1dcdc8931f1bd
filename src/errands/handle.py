"""``JobHandle``: what enqueue returns — the id, and a way to follow the job."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from . import offloop
from .errors import JobCancelled, JobFailed, JobNotFound
from .jobs import Job, JobState, Progress
from .waiting import afirst_end, first_end

if TYPE_CHECKING:
    from .app import App
    from .backends.base import CancelResult

POLL_INTERVAL_DEFAULT = 0.05


class JobHandle:
    __slots__ = ("_last_state", "app", "deduplicated", "id", "name")

    def __init__(self, app: App, job_id: int, name: str, deduplicated: bool = False) -> None:
        self.app = app
        self.id = job_id
        self.name = name
        self.deduplicated = deduplicated
        self._last_state = "pending"

    def __repr__(self) -> str:
        dedup = " deduplicated" if self.deduplicated else ""
        return f"<JobHandle {self.id} {self.name}{dedup}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JobHandle) and other.id == self.id and other.app is self.app

    def __hash__(self) -> int:
        return hash(self.id)

    def job(self) -> Job:
        return self.app.get_job(self.id)

    async def ajob(self) -> Job:
        """:meth:`job` for async code.

        .. versionadded:: 0.2
        """
        return await self.app.aget_job(self.id)

    def status(self) -> JobState:
        return self.job().state

    async def astatus(self) -> JobState:
        """:meth:`status` for async code.

        .. versionadded:: 0.2
        """
        return (await self.ajob()).state

    def cancel(self, actor: str = "api") -> CancelResult:
        return self.app.cancel(self.id, actor=actor)

    async def acancel(self, actor: str = "api") -> CancelResult:
        """:meth:`cancel` for async code.

        .. versionadded:: 0.2
        """
        return await self.app.acancel(self.id, actor=actor)

    def result(
        self, timeout: float | timedelta | None = None, poll: float = POLL_INTERVAL_DEFAULT
    ) -> Any:
        """Wait for the job to finish and return its result.

        Raises JobFailed when it is dead (in the DLQ), JobCancelled when cancelled or
        discarded, ResultTimeout when ``timeout`` seconds pass first. The store wakes the
        wait when the job's outcome commits (LISTEN/NOTIFY on PostgreSQL, commit
        detection on SQLite; see errands.results); ``poll`` is the longest pause between
        reads where it cannot (``listen=false``, an in-memory store).

        The timeout holds while the store cannot be read (a server away, a pool with no
        connection free): a read waits for a connection no longer than the time left,
        a failed read is made again with backoff, and at the deadline ResultTimeout says
        the store could not be read (the store's error is its ``__cause__``); a read that
        hangs on the server (a locked jobs table) runs in errands' thread and is waited
        for until the deadline only. Without a timeout the wait reads again until the
        store answers.
        """
        return self._outcome(first_end(self, timeout, poll))

    async def aresult(
        self, timeout: float | timedelta | None = None, poll: float = POLL_INTERVAL_DEFAULT
    ) -> Any:
        """:meth:`result` for async code: the same outcomes and errors, woken the same
        way, and the event loop never blocks. Each read runs in a thread and is awaited
        no longer than the time left, so ResultTimeout comes at the deadline even when a
        read hangs (the thread ends on its own). A result is decoded in a thread too, and
        within the same deadline: its return type's validators are the application's
        code, which may take a while. The threads are errands' own (a pool of the
        process's), never the event loop's default executor: the application's own
        ``asyncio.to_thread`` calls cannot hold them up.
        Cancelling the awaiting task stops only the wait (its registration is removed).

        .. versionadded:: 0.2
        """
        job, pacer = await afirst_end(self, timeout, poll)
        if job.state is JobState.COMPLETED and job.result is not None:
            # decode_result runs the return type's pydantic validators: user code that
            # would hold up every coroutine of the loop while it ran. In errands' thread,
            # within the wait's deadline (it waited for a thread of the loop's executor,
            # shared with the application, for as long as they were all busy).
            return await pacer.bounded(offloop.run(self._outcome, job), self._decoding)
        return self._outcome(job)  # nothing to decode: None, or the error it ended with

    def _decoding(self) -> str:
        return f"job {self.id} ({self.name}) completed; its result was still being decoded"

    def progress(self) -> Progress | None:
        """What the running handler last reported with ``ctx.progress`` (as the worker's
        last heartbeat stored it); None before any report, and when a new attempt starts.

        .. versionadded:: 0.2
        """
        return self.job().progress

    def _still(self) -> str:
        return f"job {self.id} ({self.name}) is still {self._last_state}"

    def _read(self) -> Job:
        try:
            return self.app.get_job(self.id)
        except JobNotFound:
            raise JobNotFound(
                f"job {self.id} no longer exists (pruned after the retention period?)"
            ) from None

    def _read_finished(self, job: Job) -> Job | None:
        """``job`` when it is over (completed, dead, cancelled, discarded), else None."""
        self._last_state = job.state.value
        return job if job.state.is_terminal else None

    def _outcome(self, job: Job) -> Any:
        """A finished job's result, or the error that says how it ended."""
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
        raise JobCancelled(f"job {self.id} ({job.name}) was {job.state.value}")
