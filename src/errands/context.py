"""``errands.Context``: what a running handler knows about its own job.

A handler asks for it by annotating a parameter with it::

    @app.job()
    def charge(ctx: errands.Context, order_id: int) -> None:
        ctx.logger.info("charging order %s (attempt %s)", order_id, ctx.attempt)
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field


@dataclass
class Context:
    job_id: int
    name: str
    queue: str
    attempt: int
    max_attempts: int
    key: str | None
    worker_id: str
    logger: logging.Logger
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)
    _reason: str = field(default="", repr=False)

    @property
    def idempotency_key(self) -> str:
        """``"<job name>:<key or id>"``: the same on every attempt, rescue and replay.

        Pass it to external APIs that accept idempotency keys (payment providers,
        webhook receivers), so a retried attempt cannot charge twice.
        """
        return f"{self.name}:{self.key if self.key is not None else self.job_id}"

    @property
    def cancelled(self) -> bool:
        """True once the job should stop: cancelled, timed out, lease lost or shutdown.

        Long-running sync handlers should check it between units of work; async handlers
        are cancelled with ``asyncio.CancelledError`` instead.
        """
        return self._cancel.is_set()

    @property
    def cancel_reason(self) -> str:
        return self._reason

    @property
    def is_last_attempt(self) -> bool:
        return self.attempt >= self.max_attempts

    def _request_cancel(self, reason: str) -> None:
        if not self._cancel.is_set():
            self._reason = reason
            self._cancel.set()
