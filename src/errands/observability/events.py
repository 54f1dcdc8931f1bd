"""One catalogue of events, emitted once where things happen; logs, metrics and traces
are subscribers (Oban's telemetry idea).

Every event is named ``errands.<component>.<action>`` and carries the fields listed in
:data:`CATALOGUE` (documented in docs/observability.md). ``app.events.subscribe(fn)``
adds a subscriber; a subscriber that raises is logged and never breaks the worker.
``app.events.wrappers`` are context managers entered around each handler call, in the
thread or task that runs it (tracing uses one to make its span current).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("errands.events")

JOB_FIELDS = ("job_id", "job_name", "queue", "attempt")

CATALOGUE: dict[str, tuple[str, ...]] = {
    # event name: fields beyond job_id, job_name, queue, attempt (job events)
    "errands.job.enqueued": ("deduplicated", "meta"),
    "errands.job.started": ("args", "queue_wait", "meta"),
    "errands.job.completed": ("duration",),
    "errands.job.retrying": ("duration", "delay", "error_type", "error_message"),
    "errands.job.dead": ("duration", "error_type", "error_message", "reason"),
    "errands.job.cancelled": ("duration",),
    "errands.job.stale_write_rejected": ("outcome",),
    "errands.job.rescued": ("state", "reason", "worker"),
    "errands.job.released": (),
    "errands.job.replayed": ("actor",),
    "errands.job.discarded": ("actor", "reason"),
    "errands.job.cancel_requested": ("actor", "previous_state"),
    "errands.worker.started": ("worker_id", "queues", "concurrency", "store"),
    "errands.worker.stopped": ("worker_id", "processed"),
    "errands.leader.elected": ("worker_id",),
    "errands.leader.resigned": ("worker_id",),
}


@dataclass(frozen=True)
class Event:
    name: str
    fields: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


Subscriber = Callable[[Event], None]
Wrapper = Callable[[dict[str, Any]], AbstractContextManager[Any]]


class EventBus:
    def __init__(self) -> None:
        self.subscribers: list[Subscriber] = []
        self.wrappers: list[Wrapper] = []
        self._lock = threading.Lock()

    def subscribe(self, fn: Subscriber) -> Subscriber:
        with self._lock:
            self.subscribers = [*self.subscribers, fn]
        return fn

    def unsubscribe(self, fn: Subscriber) -> None:
        with self._lock:
            self.subscribers = [s for s in self.subscribers if s is not fn]

    def wrap(self, fn: Wrapper) -> Wrapper:
        with self._lock:
            self.wrappers = [*self.wrappers, fn]
        return fn

    def emit(self, name: str, **fields: Any) -> None:
        if name not in CATALOGUE:
            raise ValueError(f"unknown event {name!r}; add it to the catalogue first")
        if not self.subscribers:
            return
        event = Event(name, fields)
        for subscriber in self.subscribers:
            try:
                subscriber(event)
            except Exception:
                log.exception("event subscriber %r failed on %s", subscriber, name)

    @contextmanager
    def around_handler(self, info: dict[str, Any]) -> Iterator[None]:
        """Enter every wrapper around one handler call (a failing wrapper is skipped)."""
        if not self.wrappers:
            yield
            return
        with ExitStack() as stack:
            for wrapper in self.wrappers:
                try:
                    stack.enter_context(wrapper(info))
                except Exception:
                    log.exception(
                        "handler wrapper %r failed for job %s", wrapper, info.get("job_id")
                    )
            yield
