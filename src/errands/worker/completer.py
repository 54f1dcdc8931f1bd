"""The completer: writes attempt outcomes in batches, fenced by lease token.

Handlers hand their outcome to :meth:`Completer.submit` and move on. One thread drains
everything queued so far and writes it in a single transaction — under load a batch
carries many outcomes for one commit; when idle, a batch of one goes out at once (no
added latency). A write whose lease token is stale changes nothing: it is logged and
counted, never written over the newer attempt.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..backends.base import FinishParams
from .execution import Attempt

if TYPE_CHECKING:
    from ..app import App

log = logging.getLogger("errands.worker")

BATCH_MAX = 500

Written = Callable[[Attempt, FinishParams, bool], None]


class Completer:
    def __init__(self, app: App, on_written: Written) -> None:
        self.app = app
        self.on_written = on_written
        self._queue: queue.SimpleQueue[tuple[Attempt, FinishParams] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="errands-completer", daemon=True)
        self._pending = 0
        self._lock = threading.Condition()
        self._closing = False
        self.stale_rejected = 0

    def start(self) -> None:
        self._thread.start()

    def submit(self, attempt: Attempt, outcome: FinishParams) -> None:
        with self._lock:
            self._pending += 1
        self._queue.put((attempt, outcome))

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < BATCH_MAX:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)  # handle the stop after this batch
                    break
                batch.append(item)
            self._write(batch)
            with self._lock:
                self._pending -= len(batch)
                self._lock.notify_all()

    def _write(self, batch: list[tuple[Attempt, FinishParams]]) -> None:
        pause = 0.05
        while True:
            try:
                accepted = self.app.backend.job_finish_many([o for _, o in batch])
                break
            except Exception:
                log.exception(
                    "could not record %d outcome(s); retrying in %.2f s (leases keep them safe)",
                    len(batch),
                    pause,
                )
                time.sleep(pause * (1 + random.random()))
                pause = min(pause * 2, 5.0)
        for (attempt, outcome), ok in zip(batch, accepted, strict=True):
            if not ok:
                self.stale_rejected += 1
            try:
                self.on_written(attempt, outcome, ok)
            except Exception:
                log.exception("error after recording the outcome of job %s", attempt.id)

    def flush(self, timeout: float) -> bool:
        """Wait until every submitted outcome is written; False if ``timeout`` ran out."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._lock.wait(remaining)
        return True

    def stop(self, timeout: float = 10.0) -> None:
        if self._closing:
            return
        self._closing = True
        self.flush(timeout)
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)
