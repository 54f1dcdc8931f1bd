"""One catalogue of events, emitted once where things happen; logs, metrics and traces
are subscribers (Oban's telemetry idea).

Every event is named ``errands.<component>.<action>`` and carries the fields listed in
:data:`CATALOGUE` (documented in docs/observability.md). ``app.events.subscribe(fn)``
adds a subscriber; a subscriber that raises is logged and never breaks the worker.
``app.events.wrappers`` are context managers entered around each handler call, in the
thread or task that runs it (tracing uses one to make its span current).
``app.events.inserters`` are called with the list of ``EnqueueRequest`` just before
``App.enqueue_many`` inserts them, and may add keys to each request's ``meta`` (tracing
stores the enqueuing span's context there, once per job); the App hands them a copy of
each BoundJob's request and meta, made for that enqueue. ``app.events.insert_failures``
are called with those requests and the exception when their insert raised.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..forking import reset_at_fork
from ..hooks import HookTimeout, Lane, describe, on_protected_thread
from ..interrupts import Interrupt

if TYPE_CHECKING:
    from ..hooks import HookRunner

log = logging.getLogger("errands.events")

JOB_FIELDS = ("job_id", "job_name", "queue", "attempt")
_RUN = (*JOB_FIELDS, "max_attempts")  # events of one attempt, from a worker or a rescue

CATALOGUE: dict[str, tuple[str, ...]] = {
    # event name: every field it carries (docs/observability.md describes each)
    "errands.job.enqueued": (*JOB_FIELDS, "deduplicated", "meta"),
    "errands.job.started": (*_RUN, "args", "queue_wait", "meta"),
    "errands.job.completed": (*_RUN, "duration"),
    "errands.job.retrying": (
        *_RUN,
        "duration",
        "delay",
        "error_type",
        "error_message",
        "traceback",
    ),
    "errands.job.dead": (
        *_RUN,
        "duration",
        "error_type",
        "error_message",
        "traceback",
        "reason",
    ),
    "errands.job.cancelled": (*_RUN, "duration"),
    "errands.job.stale_write_rejected": (*_RUN, "outcome"),
    "errands.job.write_failed": (*_RUN, "outcome"),
    "errands.job.progress": (*_RUN, "progress", "message"),
    "errands.job.waiting": (*_RUN, "signal", "timeout"),
    "errands.job.signalled": ("job_id", "actor", "signal", "resumed"),
    "errands.job.wait_timed_out": (*_RUN, "signal", "state"),
    "errands.job.rescued": (*_RUN, "state", "reason", "worker"),
    "errands.job.released": _RUN,
    "errands.job.replayed": ("job_id", "actor"),
    "errands.job.discarded": ("job_id", "actor", "reason"),
    "errands.job.cancel_requested": ("job_id", "actor", "previous_state"),
    "errands.job.edited": ("job_id", "actor", "changes"),
    "errands.workflow.enqueued": ("workflow_id", "workflow_name", "kind", "members"),
    "errands.workflow.cancelled": ("workflow_id", "actor", "cancelled"),
    "errands.workflow.settled": ("workflow_id", "workflow_name", "kind", "state", "callbacks"),
    "errands.worker.started": ("worker_id", "queues", "concurrency", "store"),
    "errands.worker.stopped": ("worker_id", "processed"),
    "errands.leader.elected": ("worker_id",),
    "errands.leader.resigned": ("worker_id",),
    "errands.maintenance.pruned": ("worker_id", "count"),
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
STORED_LATER = "_errands_stored_later"  # set on requests while before_insert hooks run


class _Before:
    """A request as it was before a ``before_insert`` hook ran, to undo what it did."""

    __slots__ = ("fields", "meta", "meta_items", "request")

    def __init__(self, request: Any) -> None:
        self.request = request
        self.meta: dict[str, Any] = request.meta
        self.meta_items = dict(request.meta)
        self.fields = {
            name: getattr(request, name) for name in request.__dataclass_fields__ if name != "meta"
        }

    def changed_fields(self) -> list[str]:
        request = self.request
        return [
            name
            for name, was in self.fields.items()
            if (now := getattr(request, name)) is not was and now != was
        ]

    def meta_changed(self) -> bool:
        return self.request.meta is not self.meta or self.meta != self.meta_items

    def restore(self) -> None:
        self.meta.clear()
        self.meta.update(self.meta_items)
        for name, value in self.fields.items():
            setattr(self.request, name, value)
        self.request.meta = self.meta


_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")  # JSON's escape of NUL, not an escaped backslash


def _meddled(requests: list[Any], given: list[Any], before: list[_Before]) -> str | None:
    """What a hook did beyond adding storable keys to each meta (None: nothing)."""
    if len(given) != len(requests) or any(a is not b for a, b in zip(given, requests, strict=True)):
        return "changed the list of jobs it was given (added, dropped or replaced one)"
    for saved in before:
        changed = saved.changed_fields()
        if changed:
            return f"changed {', '.join(changed)} of a job ({saved.request.name!r})"
        if saved.meta_changed():
            meta = saved.request.meta
            if not isinstance(meta, dict):
                return f"replaced a job's meta with a {type(meta).__name__}"
            try:
                text = json.dumps(meta, allow_nan=False)
            except (TypeError, ValueError) as exc:
                return f"left a meta that JSON cannot hold ({exc})"
            if _NUL.search(text):
                return "left a meta holding the NUL character, which PostgreSQL cannot store"
    return None


Wrapper = Callable[[dict[str, Any]], AbstractContextManager[Any]]
Inserter = Callable[[list[Any]], None]  # called with the EnqueueRequests about to be inserted
# called with the EnqueueRequests whose insert raised, and what it raised
InsertFailed = Callable[[list[Any], BaseException], None]


class EventBus:
    """Delivers each event to every subscriber.

    errands' own subscribers (the lifecycle log, metrics, tracing) subscribe ``inline``:
    they run in the thread that emits, and are quick. Any other subscriber is user code:
    emitted from one of the worker's own threads (completer, claim loop, lease keeper,
    maintenance), it is delivered in order on the ``events`` lane of ``hooks`` (bounded,
    time-limited, see :mod:`errands.hooks`), so a slow or hung subscriber never holds up
    an outcome write or a rescue; the dashboard's actions run on a thread marked the same
    way (a hung subscriber held a request); emitted from the caller's thread (an enqueue,
    an admin action through the API or the CLI), it runs there, as before.
    """

    def __init__(self, hooks: HookRunner | None = None) -> None:
        self.subscribers: list[Subscriber] = []
        self.wrappers: list[Wrapper] = []
        self.inserters: list[Inserter] = []
        self.insert_failures: list[InsertFailed] = []
        self._inline: frozenset[int] = frozenset()  # ids of the inline subscribers
        self._hooks = hooks
        self._lock = threading.Lock()
        reset_at_fork(self)  # its lock starts afresh in a forked child (_forked)

    def _forked(self) -> None:
        """In a child forked from this process, on its only thread (errands.forking; no
        I/O, no logging): the lock starts afresh. Copied held by a thread of the parent
        that was subscribing (or unsubscribing, adding a wrapper or an insert hook) as
        another forked, it hung the child's first subscribe for good. The lists are
        replaced whole under it, never changed in place, so the child has them as they
        were before or after that change."""
        self._lock = threading.Lock()

    def subscribe(self, fn: Subscriber, *, inline: bool = False) -> Subscriber:
        """Add a subscriber; ``inline=True`` is for errands' own quick ones (see above)."""
        with self._lock:
            self.subscribers = [*self.subscribers, fn]
            if inline:
                self._inline = self._inline | {id(fn)}
        return fn

    def unsubscribe(self, fn: Subscriber) -> None:
        with self._lock:
            self.subscribers = [s for s in self.subscribers if s is not fn]
            self._inline = self._inline - {id(fn)}

    def wrap(self, fn: Wrapper) -> Wrapper:
        with self._lock:
            self.wrappers = [*self.wrappers, fn]
        return fn

    def before_insert(self, fn: Inserter) -> Inserter:
        """Call ``fn(requests)`` before every insert; it may add keys to ``request.meta``."""
        with self._lock:
            self.inserters = [*self.inserters, fn]
        return fn

    def on_insert_failed(self, fn: InsertFailed) -> InsertFailed:
        """Call ``fn(requests, exc)`` when the insert of ``requests`` (prepared by the
        ``before_insert`` hooks) raised ``exc``: no ``errands.job.enqueued`` follows for
        them (tracing ends their send spans there, as errors)."""
        with self._lock:
            self.insert_failures = [*self.insert_failures, fn]
        return fn

    def insert_failed(self, requests: list[Any], exc: BaseException) -> None:
        """Run every ``on_insert_failed`` hook; one that raises is logged, never raised
        (the caller gets the insert's own error)."""
        for fn in self.insert_failures:
            try:
                fn(list(requests), exc)
            except Exception:
                log.exception("insert-failed hook %r failed", fn)

    def prepare_insert(self, requests: list[Any], *, stored_later: bool = False) -> list[Any]:
        """Run every ``before_insert`` hook on ``requests``.

        A hook may add keys to each ``request.meta``, nothing more, and is user code: one
        that raises, changes the list (it is handed a copy), changes a request's other
        fields (a priority the store cannot hold) or leaves a meta that cannot be stored
        as JSON (a datetime, NaN, NUL) has what it did undone, logged with its name: the
        jobs are stored without it. (Its changes reached the store before: a hook that
        appended or dropped a request stored the jobs and then raised to the caller, who
        retried and stored them twice.)

        ``stored_later``: the store inserts them later, with something else's write (a
        handler's children and added members with its outcome, a workflow's callbacks
        when it settles), so no ``errands.job.enqueued`` follows: each carries
        ``meta[STORED_LATER]`` while the hooks run (the tracing plugin then stores the
        current trace context, the running job's, without a send span that nothing
        would end)."""
        if stored_later:
            for request in requests:
                request.meta[STORED_LATER] = True
        try:
            for inserter in self.inserters:
                before = [_Before(r) for r in requests]
                given = list(requests)
                try:
                    inserter(given)
                    problem = _meddled(requests, given, before)
                except Exception:
                    log.exception(
                        "before-insert hook %r failed; the jobs are stored without it", inserter
                    )
                    problem = ""
                if problem is not None:
                    for saved in before:
                        saved.restore()
                    if problem:
                        log.error(
                            "before-insert hook %r %s; it may only add keys to each "
                            "request.meta, whose values JSON can hold: what it did is "
                            "undone, the jobs are stored without it",
                            inserter,
                            problem,
                        )
        finally:
            if stored_later:
                for request in requests:
                    request.meta.pop(STORED_LATER, None)
        return requests

    def wants(self, name: str) -> bool:
        """Whether emitting ``name`` would reach anyone (skip building its fields if not).

        The lifecycle-log subscriber wants an event only when its log line is enabled.
        """
        for subscriber in self.subscribers:
            wants = getattr(subscriber, "wants", None)
            if wants is None or wants(name):
                return True
        return False

    def wants_later(self, name: str) -> bool:
        """Whether :meth:`emit_later` of ``name`` would hand it to a subscriber that runs
        later, on the events lane (one not errands' own inline): its fields must then be
        a copy of what may change meanwhile."""
        inline = self._inline
        for subscriber in self.subscribers:
            wants = getattr(subscriber, "wants", None)
            if id(subscriber) not in inline and (wants is None or wants(name)):
                return True
        return False

    def emit(self, name: str, **fields: Any) -> None:
        self._emit(name, fields, on_protected_thread())

    def emit_later(self, name: str, **fields: Any) -> None:
        """:meth:`emit`, with the subscribers that are not errands' own run on the events
        lane whatever thread emits: for an event emitted on a handler thread after its
        slot was given back (a job's end written in its ctx.transaction()), where a slow
        or hung subscriber held the thread the next claimed job was waiting for."""
        self._emit(name, fields, True)

    def _emit(self, name: str, fields: dict[str, Any], protected: bool) -> None:
        if name not in CATALOGUE:
            raise ValueError(f"unknown event {name!r}; add it to the catalogue first")
        if not self.subscribers:
            return
        event = Event(name, fields)
        subscribers = self.subscribers
        deferred: list[Subscriber] = []
        off_thread = self._hooks is not None and protected
        for subscriber in subscribers:
            wants = getattr(subscriber, "wants", None)
            if wants is not None and not wants(name):
                continue  # (a lane call each, for nothing: the lane's room is bounded)
            if off_thread and id(subscriber) not in self._inline:
                deferred.append(subscriber)
            else:
                _deliver(subscriber, event)
        if deferred and self._hooks is not None:
            lane = self._hooks.lane("events")
            lane.submit(_deliver_all, lane, deferred, event, what=f"event subscribers of {name}")

    @contextmanager
    def around_handler(self, info: dict[str, Any]) -> Iterator[None]:
        """Enter every wrapper around one handler call (a failing wrapper is skipped)."""
        if not self.wrappers:
            yield
            return
        with ExitStack() as stack:
            for wrapper in self.wrappers:
                try:
                    stack.enter_context(_Guarded(wrapper(info), wrapper, info.get("job_id")))
                except Exception:
                    log.exception(
                        "handler wrapper %r failed for job %s", wrapper, info.get("job_id")
                    )
            yield


class _Guarded:
    """A handler wrapper's context, held to what a wrapper may do: its exit never turns
    the handler's outcome into another. An exit that raised made a completed handler's
    job fail and run again (its effects repeated); one that suppressed the handler's
    exception left no result, and the job failed with an UnboundLocalError instead of
    its own Permanent, Retry or Suspended outcome. A failing exit is logged."""

    __slots__ = ("cm", "job_id", "wrapper")

    def __init__(self, cm: Any, wrapper: Any, job_id: Any) -> None:
        self.cm, self.wrapper, self.job_id = cm, wrapper, job_id

    def __enter__(self) -> Any:
        return self.cm.__enter__()

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            self.cm.__exit__(kind, exc, tb)  # a True (suppress) is not honoured
        except Exception as raised:
            if raised is not exc:  # (a @contextmanager wrapper re-raises the handler's)
                log.exception(
                    "handler wrapper %r failed on exit for job %s; the handler's outcome stands",
                    self.wrapper,
                    self.job_id,
                )


# What a subscriber raises and still goes on: what stops the thread (Ctrl-C, sys.exit)
# and errands' own interrupts (the hook or handler that emitted the event, past its time
# limit).
_STOPS = (KeyboardInterrupt, SystemExit, Interrupt)


def _deliver(subscriber: Subscriber, event: Event) -> None:
    """Hand ``event`` to ``subscriber``: whatever else it raises is logged and goes no
    further, a BaseException too (a gevent or eventlet Timeout, a library's own): one from
    an ``errands.job.enqueued`` subscriber made the enqueue raise though its job was
    stored (a caller retrying without a key stored it twice), and on the events lane it
    kept the event from the subscribers after it."""
    try:
        subscriber(event)
    except _STOPS:
        raise
    except BaseException:
        log.exception("event subscriber %r failed on %s", subscriber, event.name)


def _deliver_all(lane: Lane, subscribers: list[Subscriber], event: Event) -> None:
    """Each subscriber with its own hook_timeout (Lane.timed): they shared the lane call's
    one, so a slow first one got the next interrupted, and one stopped at the limit left
    the subscribers after it without the event."""
    for subscriber in subscribers:
        try:
            with lane.timed(f"event subscriber {describe(subscriber)} of {event.name}"):
                _deliver(subscriber, event)
        except HookTimeout:  # logged by the lane as it stopped it: the next one gets it
            log.error("event subscriber %r was stopped at its limit on %s", subscriber, event.name)
