"""OpenTelemetry traces for errands (the ``errands[otel]`` extra: opentelemetry-api).

::

    install_tracing(app)                       # the global TracerProvider
    install_tracing(app, tracer_provider=provider, parent=True)

At enqueue, a ``send <queue>`` PRODUCER span (a child of whatever span is current, e.g.
the web request) is started just before the insert, and its context is written ONCE into
the job's ``meta["trace"]`` by the propagator (W3C ``traceparent``). It ends when the
insert is confirmed, carrying the job id, or when the insert raised, with ERROR status
and an ``exception`` event. A batch (``enqueue_many`` of several jobs) gets
one ``send`` span per queue, shared by its jobs (``meta["trace_batch"]``).

Every attempt runs inside a ``process <queue>`` CONSUMER span, linked to the producer
context and, with ``parent=True`` (the default), its child, so the job's work belongs to
the enqueuing request's trace, retries included. Batch jobs are only linked. The span is
the current span inside the handler (an ``app.events`` wrapper), so the handler's own
spans nest under it. It ends when the attempt's outcome is recorded, with
``errands.job.outcome`` and, on failure, an ``exception`` event and ERROR status. A job
with ``sensitive=`` arguments records the stored, scrubbed message and no stack trace.

Nothing of this runs unless :func:`install_tracing` is called.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError
from ..errortext import clip, format_trace
from ..forking import fresh_lock_at_fork
from .events import STORED_LATER, Event

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
    from opentelemetry.propagators.textmap import TextMapPropagator
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ConfigurationError(
        "OpenTelemetry tracing needs the otel extra: pip install 'errands[otel]'"
    ) from exc

if TYPE_CHECKING:
    from ..app import App
    from ..jobs import EnqueueRequest

META_KEY = "trace"
ENDS_HERE = "ends_here"  # in a handler wrapper's info: no outcome event ends its span
BATCH_KEY = "trace_batch"
PENDING_MAX = 10_000  # unconfirmed send spans kept (a safety net: a failed insert ends its)

OUTCOMES = {
    "errands.job.completed": "completed",
    "errands.job.retrying": "retry",
    "errands.job.dead": "dead",
    "errands.job.cancelled": "cancelled",
    "errands.job.stale_write_rejected": "stale",
    "errands.job.write_failed": "write_failed",  # not stored: rescued after its lease
    "errands.job.released": "released",
    "errands.job.waiting": "waiting",  # suspended (ctx.wait_for_signal): the attempt ends
}

_installed: weakref.WeakKeyDictionary[App, Tracing] = weakref.WeakKeyDictionary()
_install_lock = threading.Lock()
fresh_lock_at_fork(globals(), "_install_lock")  # a new one in a forked child


@dataclass
class _Send:
    span: trace.Span
    remaining: int  # enqueued events still expected (a batch shares one span)
    metas: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _Process:
    span: trace.Span
    sensitive: bool
    error: BaseException | None = None


def _meta_dict(meta: Any) -> dict[str, Any]:
    if isinstance(meta, dict):
        return meta
    if isinstance(meta, str | bytes) and meta:
        try:
            value = json.loads(meta)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}
    return {}


class Tracing:
    """The tracing plugin of one App (made by :func:`install_tracing`)."""

    def __init__(
        self,
        tracer: trace.Tracer,
        *,
        parent: bool = True,
        propagator: TextMapPropagator | None = None,
    ) -> None:
        self.tracer = tracer
        self.parent = parent
        self.propagator = propagator
        self._lock = threading.Lock()
        self._sending: dict[int, _Send] = {}  # id(request.meta) -> its send span
        self._running: dict[tuple[Any, Any], _Process] = {}  # (job id, attempt) -> span

    def _textmap(self) -> TextMapPropagator:
        return self.propagator or propagate.get_global_textmap()

    # -- enqueue -------------------------------------------------------------------------
    def before_insert(self, requests: list[EnqueueRequest]) -> None:
        todo = [r for r in requests if META_KEY not in r.meta]  # stored once, never replaced
        later = [r for r in todo if r.meta.get(STORED_LATER)]
        if later:
            # Stored by the store with another write (a handler's children, a workflow's
            # callbacks): no enqueued event ends a send span, so none is started (it stayed
            # open, and was ended as an error 10,000 enqueues later); the current context
            # (the running job's span, the request's) is their parent.
            current: dict[str, str] = {}
            self._textmap().inject(current)
            for request in later:
                if current:
                    request.meta[META_KEY] = dict(current)
            todo = [r for r in todo if not r.meta.get(STORED_LATER)]
        if not todo:
            return
        batch = len(requests) > 1
        by_queue: dict[str, list[EnqueueRequest]] = {}
        for request in todo:
            by_queue.setdefault(request.queue, []).append(request)
        for queue, group in by_queue.items():
            attributes: dict[str, Any] = {
                "messaging.system": "errands",
                "messaging.destination.name": queue,
                "messaging.operation": "publish",
                "messaging.operation.type": "send",
                "messaging.operation.name": "send",
            }
            if batch:
                attributes["messaging.batch.message_count"] = len(group)
            else:
                attributes["errands.job.name"] = group[0].name
            span = self.tracer.start_span(
                f"send {queue}", kind=SpanKind.PRODUCER, attributes=attributes
            )
            carrier: dict[str, str] = {}
            self._textmap().inject(carrier, context=trace.set_span_in_context(span))
            entry = _Send(span, len(group))
            with self._lock:
                for request in group:
                    request.meta[META_KEY] = dict(carrier)
                    if batch:
                        request.meta[BATCH_KEY] = True
                    entry.metas.append(request.meta)
                    self._sending[id(request.meta)] = entry
                self._evict()

    def _evict(self) -> None:
        while len(self._sending) > PENDING_MAX:  # inserts that raised: end their spans
            key = next(iter(self._sending))
            entry = self._sending.pop(key)
            entry.remaining -= 1
            if entry.remaining <= 0:
                entry.span.set_status(Status(StatusCode.ERROR, "insert not confirmed"))
                entry.span.end()

    def insert_failed(self, requests: list[EnqueueRequest], exc: BaseException) -> None:
        """The insert of ``requests`` raised: their send spans end now, as errors (no
        enqueued event will end them; they were dropped unexported, ended only once
        PENDING_MAX more had piled up)."""
        entries: dict[int, _Send] = {}
        with self._lock:
            for request in requests:
                entry = self._sending.pop(id(request.meta), None)
                if entry is not None:
                    entries[id(entry)] = entry
            for entry in entries.values():  # (a batch's span: every job of it failed)
                for meta in entry.metas:
                    self._sending.pop(id(meta), None)
        error_type = type(exc).__name__
        for entry in entries.values():
            attributes: dict[str, str | bool] = {
                "exception.type": error_type, "exception.escaped": True,
            }  # fmt: skip
            if not any(_meta_dict(m).get("sensitive") for m in entry.metas):
                attributes["exception.message"] = clip(str(exc))  # (it may quote a value)
                attributes["exception.stacktrace"] = format_trace(exc)
            entry.span.add_event("exception", attributes)
            entry.span.set_status(Status(StatusCode.ERROR, f"insert failed: {error_type}"))
            entry.span.end()

    def _enqueued(self, event: Event) -> None:
        meta = event.get("meta")
        with self._lock:
            # the entry keeps every meta dict alive, so an id here is that very dict
            entry = self._sending.pop(id(meta), None)
            if entry is None:
                return
            entry.remaining -= 1
            done = entry.remaining <= 0
        span = entry.span
        if len(entry.metas) == 1:
            span.set_attribute("messaging.message.id", str(event.get("job_id")))
            span.set_attribute("errands.job.deduplicated", bool(event.get("deduplicated")))
        if done:
            span.end()

    # -- execution -------------------------------------------------------------------------
    @contextmanager
    def around_handler(self, info: dict[str, Any]) -> Iterator[None]:
        meta = _meta_dict(info.get("meta"))
        queue = str(info.get("queue", ""))
        links: list[Link] = []
        parent_context = otel_context.Context()  # a new trace unless parented below
        carrier = meta.get(META_KEY)
        if isinstance(carrier, dict):
            sent = self._textmap().extract(carrier)
            sent_span = trace.get_current_span(sent).get_span_context()
            if sent_span.is_valid:
                links.append(Link(sent_span))
                if self.parent and not meta.get(BATCH_KEY):
                    parent_context = sent
        span = self.tracer.start_span(
            f"process {queue}",
            context=parent_context,
            kind=SpanKind.CONSUMER,
            links=links,
            attributes={
                "messaging.system": "errands",
                "messaging.destination.name": queue,
                "messaging.message.id": str(info.get("job_id")),
                "messaging.operation": "process",
                "messaging.operation.type": "process",
                "messaging.operation.name": "process",
                "errands.job.name": str(info.get("job_name", "")),
                "errands.job.attempt": int(info.get("attempt") or 0),
                "errands.job.max_attempts": int(info.get("max_attempts") or 0),
            },
        )
        record = _Process(span, sensitive=bool(meta.get("sensitive")))
        key = (info.get("job_id"), info.get("attempt"))
        here = bool(info.get(ENDS_HERE))  # a worker's child process: no outcome event here
        if not here:
            with self._lock:
                self._running[key] = record
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            yield
        except BaseException as exc:
            record.error = exc
            raise
        finally:
            otel_context.detach(token)
            if here:
                self._ended_here(record)

    @staticmethod
    def _ended_here(record: _Process) -> None:
        """End a span where no outcome event will (a process-pool child: the worker
        records the outcome; its spans stayed open, never exported): ``completed`` when
        the handler returned, ``failed`` with the exception when it raised (the worker
        then decides retry or dead)."""
        span, error = record.span, record.error
        if error is None:
            span.set_attribute("errands.job.outcome", "completed")
        else:
            span.set_attribute("errands.job.outcome", "failed")
            error_type = type(error).__name__
            attributes: dict[str, str | bool] = {
                "exception.type": error_type, "exception.escaped": True,
            }  # fmt: skip
            if not record.sensitive:  # (its message may carry a sensitive argument)
                attributes["exception.message"] = clip(str(error))  # (as errors keep it)
                attributes["exception.stacktrace"] = format_trace(error)
            span.add_event("exception", attributes)
            span.set_status(Status(StatusCode.ERROR, error_type))
        span.end()

    def _finished(self, event: Event) -> None:
        key = (event.get("job_id"), event.get("attempt"))
        with self._lock:
            record = self._running.pop(key, None)
        if record is None:
            return  # no span here (never entered its handler, or another process ran it)
        span = record.span
        span.set_attribute("errands.job.outcome", OUTCOMES[event.name])
        if event.name in ("errands.job.retrying", "errands.job.dead"):
            error_type = str(event.get("error_type") or "Error")
            message = str(event.get("error_message") or "")  # already scrubbed
            attributes: dict[str, str | bool] = {
                "exception.type": error_type,
                "exception.message": message,
                "exception.escaped": True,
            }
            if record.error is not None and not record.sensitive:
                attributes["exception.stacktrace"] = format_trace(record.error)
            span.add_event("exception", attributes)
            span.set_status(Status(StatusCode.ERROR, f"{error_type}: {message}"))
        elif event.name == "errands.job.write_failed":
            span.set_status(
                Status(StatusCode.ERROR, f"the {event.get('outcome')} outcome was not stored")
            )
        span.end()

    def on_event(self, event: Event) -> None:
        if event.name == "errands.job.enqueued":
            self._enqueued(event)
        elif event.name in OUTCOMES:
            self._finished(event)


def install_tracing(
    app: App,
    tracer_provider: trace.TracerProvider | None = None,
    *,
    parent: bool = True,
    propagator: TextMapPropagator | None = None,
) -> Tracing:
    """Trace ``app``'s jobs from enqueue to every attempt (idempotent per App).

    ``tracer_provider``: None uses the global provider. ``parent``: make each job's
    ``process`` spans children of its ``send`` span (single enqueues; batch jobs are
    always only linked). ``propagator``: None uses the global text-map propagator.
    """
    from .. import __version__

    with _install_lock:
        existing = _installed.get(app)
        if existing is not None:
            return existing
        tracer = trace.get_tracer("errands", __version__, tracer_provider=tracer_provider)
        plugin = Tracing(tracer, parent=parent, propagator=propagator)
        _installed[app] = plugin
    app.events.before_insert(plugin.before_insert)
    app.events.on_insert_failed(plugin.insert_failed)
    app.events.wrap(plugin.around_handler)
    app.events.subscribe(plugin.on_event, inline=True)
    return plugin
