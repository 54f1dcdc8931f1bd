"""The lease keeper: heartbeats, lost leases, operator cancels, timeouts, self-fencing.

One thread, waking at whichever comes first: the next heartbeat (a third of the shortest
lease) or the next handler deadline.

Heartbeat: extend the lease of every attempt still held, in one transaction. A lease the
store no longer extends was lost (rescued after a pause, or the job was replayed): the
handler is asked to stop, and its late outcome will be rejected by the fence. A lease
flagged ``cancel_requested`` means an operator cancelled the job: the handler is asked
to stop (``ctx.cancelled``; ``CancelledError`` in async handlers).

Self-fencing: if heartbeats keep failing (database unreachable), every handler whose
lease would run out within one heartbeat interval is stopped *before* it runs out, so
this worker never races the worker that will take the job over.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ..backends.base import LeaseRef
from .execution import Attempt

if TYPE_CHECKING:
    from ..app import App

log = logging.getLogger("errands.worker")


class LeaseKeeper:
    def __init__(
        self,
        worker: WorkerLike,
        interval: float,
        on_timeout: Callable[[Attempt], None],
    ) -> None:
        self.worker = worker
        self.interval = interval
        self.on_timeout = on_timeout
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="errands-leases", daemon=True)
        self.failures = 0

    def start(self) -> None:
        self._thread.start()

    def poke(self) -> None:
        """Re-plan the next wake-up (a new attempt with a deadline started)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        next_beat = time.monotonic() + self.interval
        while not self._stop.is_set():
            now = time.monotonic()
            deadlines = [a.deadline for a in self.worker.attempts() if a.deadline and not a.decided]
            wake_at = min([next_beat, *deadlines])
            if wake_at > now:
                self._wake.wait(wake_at - now)
                self._wake.clear()
                continue
            if now >= next_beat:
                self.beat()
                self.worker.registry_beat()
                next_beat = time.monotonic() + self.interval
            for attempt in self.worker.attempts():
                if (
                    attempt.deadline
                    and not attempt.decided
                    and time.monotonic() >= attempt.deadline
                ):
                    self.on_timeout(attempt)

    def beat(self) -> None:
        held = [a for a in self.worker.attempts() if not a.released]
        if not held:
            return
        sent_at = time.monotonic()
        try:
            result = self.worker.app.backend.job_heartbeat_many(
                [LeaseRef(a.id, a.token, a.lease_seconds) for a in held]
            )
        except Exception as exc:
            self.failures += 1
            log.warning("heartbeat failed (%s); %d lease(s) at risk", exc, len(held))
            self._self_fence(held)
            return
        self.failures = 0
        loop = self.worker.loop
        for attempt in held:
            if attempt.id in result.extended:
                attempt.lease_valid_until = sent_at + attempt.lease_seconds
                if attempt.id in result.cancel_requested and not (
                    attempt.ctx and attempt.ctx.cancelled
                ):
                    log.info(
                        "job %s was cancelled by an operator; stopping its handler", attempt.id
                    )
                    attempt.interrupt("cancelled", loop)
            elif not attempt.decided and not (attempt.ctx and attempt.ctx.cancelled):
                log.warning(
                    "lease of job %s (attempt %s) is lost: another worker may run it now; "
                    "stopping the handler, and its outcome will be rejected",
                    attempt.id,
                    attempt.row.attempt,
                )
                attempt.interrupt("lease lost", loop)

    def _self_fence(self, held: list[Attempt]) -> None:
        horizon = time.monotonic() + self.interval * 1.5
        for attempt in held:
            if not attempt.decided and attempt.lease_valid_until <= horizon:
                log.error(
                    "cannot renew the lease of job %s: stopping its handler before the lease "
                    "runs out, so no other worker races it",
                    attempt.id,
                )
                attempt.interrupt("lease could not be renewed", self.worker.loop)


class WorkerLike(Protocol):
    """The slice of :class:`errands.worker.worker.Worker` the keeper uses."""

    app: App
    loop: asyncio.AbstractEventLoop | None

    def attempts(self) -> list[Attempt]: ...

    def registry_beat(self) -> None: ...
