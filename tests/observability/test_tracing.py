"""OpenTelemetry: the enqueuing request's trace continues into every attempt of the job
(issue 6), with the messaging attributes, recorded failures and nothing when not installed."""

from __future__ import annotations

import asyncio
import sqlite3
from contextlib import closing
from typing import Any

import pytest
from opentelemetry.trace import SpanKind, StatusCode, format_span_id, format_trace_id

import errands
from errands.observability.tracing import install_tracing
from tests.integration.helpers import wait_until

from .conftest import Spans


def test_a_jobs_process_spans_belong_to_the_enqueuing_requests_trace_across_a_retry(
    app: errands.App, worker_factory: Any, spans: Spans
) -> None:
    install_tracing(app, tracer_provider=spans.provider)
    shop_tracer = spans.provider.get_tracer("shop")

    @app.job(name="tr.charge", queue="billing", retries=2, backoff=0.01)
    def charge(ctx: errands.Context, order: int) -> str:
        with shop_tracer.start_as_current_span("call payment api"):
            if ctx.attempt == 1:
                raise ConnectionError("payment api down")
        return "ok"

    with shop_tracer.start_as_current_span("POST /orders") as request:
        handle = charge.enqueue(order=7)
    with worker_factory(queues="billing"):
        assert handle.result(timeout=10) == "ok"
        wait_until(lambda: len(spans.named("process billing")) == 2, what="two process spans")

    trace_id = request.get_span_context().trace_id
    [send] = spans.named("send billing")
    first, second = sorted(spans.named("process billing"), key=lambda s: s.start_time)
    user_spans = sorted(spans.named("call payment api"), key=lambda s: s.start_time)
    for span in [send, first, second, *user_spans]:
        assert span.context.trace_id == trace_id

    assert send.kind is SpanKind.PRODUCER
    assert send.parent.span_id == request.get_span_context().span_id
    assert send.attributes["messaging.system"] == "errands"
    assert send.attributes["messaging.destination.name"] == "billing"
    assert send.attributes["messaging.message.id"] == str(handle.id)

    for number, span in enumerate([first, second], start=1):
        assert span.kind is SpanKind.CONSUMER
        assert span.parent.span_id == send.context.span_id
        assert [link.context.span_id for link in span.links] == [send.context.span_id]
        assert span.attributes["messaging.system"] == "errands"
        assert span.attributes["messaging.destination.name"] == "billing"
        assert span.attributes["messaging.message.id"] == str(handle.id)
        assert span.attributes["messaging.operation"] == "process"
        assert span.attributes["errands.job.name"] == "tr.charge"
        assert span.attributes["errands.job.attempt"] == number
        assert user_spans[number - 1].parent.span_id == span.context.span_id  # nested

    assert first.attributes["errands.job.outcome"] == "retry"
    assert first.status.status_code is StatusCode.ERROR
    [exception] = [e for e in first.events if e.name == "exception"]
    assert exception.attributes["exception.type"] == "ConnectionError"
    assert exception.attributes["exception.message"] == "payment api down"
    assert "ConnectionError" in exception.attributes["exception.stacktrace"]
    assert second.attributes["errands.job.outcome"] == "completed"
    assert second.status.status_code is StatusCode.UNSET

    # the context is stored once, in the job's meta, and names the send span
    carrier = handle.job().meta["trace"]
    assert format_span_id(send.context.span_id) in carrier["traceparent"]


def test_an_async_handlers_spans_nest_under_its_process_span(
    app: errands.App, worker_factory: Any, spans: Spans
) -> None:
    install_tracing(app, tracer_provider=spans.provider)
    tracer = spans.provider.get_tracer("shop")

    @app.job(name="tr.async")
    async def refund(order: int) -> None:
        with tracer.start_as_current_span("refund"):
            await asyncio.sleep(0.01)

    with tracer.start_as_current_span("POST /refunds") as request:
        handles = [refund.enqueue(order=n) for n in range(3)]
    with worker_factory(concurrency=3):
        for handle in handles:
            handle.result(timeout=10)
        wait_until(lambda: len(spans.named("process default")) == 3, what="three process spans")

    processes = {s.attributes["messaging.message.id"]: s for s in spans.named("process default")}
    assert set(processes) == {str(h.id) for h in handles}
    for span in spans.named("refund"):
        assert span.parent.span_id in {p.context.span_id for p in processes.values()}
        assert span.context.trace_id == request.get_span_context().trace_id


def test_a_sensitive_argument_never_reaches_a_span(
    app: errands.App, worker_factory: Any, spans: Spans
) -> None:
    install_tracing(app, tracer_provider=spans.provider)
    secret = "4111-1111-1111-1111"

    @app.job(name="tr.pay", sensitive={"card"}, retries=0)
    def pay(card: str) -> None:
        raise ValueError(f"card {card} declined")

    handle = pay.enqueue(card=secret)
    with worker_factory(), pytest.raises(errands.JobFailed):
        handle.result(timeout=10)
    wait_until(lambda: spans.named("process default"), what="the process span")

    [span] = spans.named("process default")
    [exception] = [e for e in span.events if e.name == "exception"]
    assert exception.attributes["exception.message"] == "card *** declined"
    assert "exception.stacktrace" not in exception.attributes
    assert span.attributes["errands.job.outcome"] == "dead"
    for recorded in spans.finished():
        text = repr(recorded.to_json())
        assert secret not in text


def test_batch_jobs_share_one_send_span_and_are_linked_not_parented(
    app: errands.App, worker_factory: Any, spans: Spans
) -> None:
    install_tracing(app, tracer_provider=spans.provider)

    @app.job(name="tr.batch")
    def item(n: int) -> None:
        pass

    handles = app.enqueue_many([item.bind(n=n) for n in range(3)])
    with worker_factory():
        for handle in handles:
            handle.result(timeout=10)
        wait_until(lambda: len(spans.named("process default")) == 3, what="three process spans")

    [send] = spans.named("send default")
    assert send.attributes["messaging.batch.message_count"] == 3
    for span in spans.named("process default"):
        assert [link.context.span_id for link in span.links] == [send.context.span_id]
        assert span.parent is None
        assert span.context.trace_id != send.context.trace_id


def test_parent_false_links_single_jobs_without_joining_their_trace(
    app: errands.App, worker_factory: Any, spans: Spans
) -> None:
    install_tracing(app, tracer_provider=spans.provider, parent=False)

    @app.job(name="tr.linked")
    def linked() -> None:
        pass

    handle = linked.enqueue()
    with worker_factory():
        handle.result(timeout=10)
        wait_until(lambda: spans.named("process default"), what="the process span")

    [send] = spans.named("send default")
    [process] = spans.named("process default")
    assert process.parent is None
    assert [link.context.span_id for link in process.links] == [send.context.span_id]


def test_without_install_tracing_nothing_is_traced_or_stored(
    app: errands.App, worker_factory: Any
) -> None:
    @app.job(name="tr.plain")
    def plain() -> None:
        pass

    handle = plain.enqueue()
    with worker_factory():
        handle.result(timeout=10)
    assert app.events.wrappers == [] and app.events.inserters == []
    assert "trace" not in handle.job().meta


def test_a_child_job_and_a_workflows_callback_continue_the_trace_with_no_span_left_open(
    app: errands.App, worker_factory: Any, spans: Spans
) -> None:
    """A job a handler enqueued (ctx.enqueue) got no trace context (the store inserts it
    with the outcome, without the before-insert hooks) and began a trace of its own; a
    workflow's callback got a send span that no enqueued event ever ended (force-ended
    as an error 10,000 enqueues later). The child's process span is a child of its
    parent job's; the callback's, of the request that enqueued the workflow; every send
    span ends."""
    plugin = install_tracing(app, tracer_provider=spans.provider)
    shop_tracer = spans.provider.get_tracer("shop")

    @app.job(name="tr.child", queue="billing")
    def child() -> str:
        return "child"

    @app.job(name="tr.parent", queue="billing")
    def parent(ctx: errands.Context) -> str:
        ctx.enqueue(child)
        return "parent"

    @app.job(name="tr.note", queue="billing")
    def note() -> None: ...

    batch = errands.Batch("traced", on_success=note.bind())
    batch.add(parent.bind(), name="parent")
    with shop_tracer.start_as_current_span("POST /orders") as request:
        handle = app.enqueue_workflow(batch)
    with worker_factory(queues="billing"):
        assert handle.result(timeout=10) == {"parent": "parent"}
        wait_until(lambda: len(spans.named("process billing")) == 3, what="three process spans")
    trace_id = request.get_span_context().trace_id
    processes = {s.attributes["errands.job.name"]: s for s in spans.named("process billing")}
    assert {n: s.context.trace_id == trace_id for n, s in processes.items()} == {
        "tr.parent": True, "tr.child": True, "tr.note": True,
    }  # fmt: skip
    assert processes["tr.child"].parent.span_id == processes["tr.parent"].context.span_id
    assert processes["tr.note"].parent.span_id == request.get_span_context().span_id
    assert plugin._sending == {}  # no send span left open


PATHS = [
    "enqueue_many",
    "enqueue_many conn=",
    "aenqueue_many",
    "aenqueue_many conn=",
    "enqueue_workflow",
    "enqueue_workflow conn=",
    "aenqueue_workflow",
    "aenqueue_workflow conn=",
]


def _enqueue_by(app: errands.App, path: str, template: errands.BoundJob) -> int:
    """Enqueue ``template`` by ``path`` (``conn=``: on the caller's own connection, in
    autocommit); the new job's id."""
    import aiosqlite

    file = app.backend.path  # type: ignore[attr-defined]
    workflow = path.startswith(("enqueue_workflow", "aenqueue_workflow"))
    what: Any = errands.Batch("tr.batch") if workflow else [template]
    if workflow:
        what.add(template, name="only")
    method = getattr(app, path.split()[0])
    if not path.startswith("a"):
        if path.endswith("conn="):
            with closing(sqlite3.connect(file, isolation_level=None)) as conn:
                handle = method(what, conn=conn)
        else:
            handle = method(what)
    else:

        async def run() -> Any:
            if path.endswith("conn="):
                async with aiosqlite.connect(file, isolation_level=None) as conn:
                    return await method(what, conn=conn)
            return await method(what)

        handle = asyncio.run(run())
    return int(handle.jobs["only"].id if workflow else handle[0].id)


@pytest.mark.parametrize("path", PATHS)
def test_a_bound_job_enqueued_from_two_requests_joins_each_requests_trace(
    app: errands.App, spans: Spans, path: str
) -> None:
    """A BoundJob kept as a template (or an enqueue the caller retried) carried the first
    enqueue's trace context in its own meta, changed in place by the hook: the tracing
    plugin, which stores a context once, skipped every later request, and their jobs ran
    in the first request's trace."""
    plugin = install_tracing(app, tracer_provider=spans.provider)
    web = spans.provider.get_tracer("web")

    @app.job(name="tr.ping")
    def ping(n: int) -> int:
        return n

    template = ping.bind(n=1)
    enqueued: list[tuple[int, int]] = []
    for request in ("GET /a", "GET /b"):
        with web.start_as_current_span(request) as span:
            job_id = _enqueue_by(app, path, template)
        enqueued.append((span.get_span_context().trace_id, job_id))
    for trace_id, job_id in enqueued:
        carrier = app.get_job(job_id).meta["trace"]
        assert format_trace_id(trace_id) in carrier["traceparent"], path
    assert {s.context.trace_id for s in spans.named("send default")} == {t for t, _ in enqueued}
    assert "trace" not in template.request.meta  # the template itself is left as it was
    assert plugin._sending == {}  # every send span ended


def test_a_bound_job_given_twice_in_one_batch_gets_a_meta_of_its_own_each_time(
    app: errands.App, spans: Spans
) -> None:
    """The same BoundJob twice in one enqueue_many: both requests shared one meta dict, so
    the batch's send span waited for two confirmations under one key and never ended."""
    plugin = install_tracing(app, tracer_provider=spans.provider)

    @app.job(name="tr.twice")
    def twice(n: int) -> int:
        return n

    template = twice.bind(n=1)
    first, second = app.enqueue_many([template, template])
    assert first.id != second.id
    [send] = spans.named("send default")
    assert send.attributes["messaging.batch.message_count"] == 2
    assert plugin._sending == {}


@pytest.mark.parametrize("path", PATHS)
def test_a_send_span_whose_insert_failed_ends_at_once_as_an_error(
    app: errands.App, spans: Spans, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """An insert that raised (the caller's transaction already aborted, the store out of
    reach) never confirmed its send span: it was never exported, only dropped once
    10,000 more were pending."""
    from errands.backends.sqlite import backend as sqlite_backend

    plugin = install_tracing(app, tracer_provider=spans.provider)
    web = spans.provider.get_tracer("web")

    @app.job(name="tr.refused")
    def refused(n: int) -> int:
        return n

    app.migrate()

    def broken(request: Any) -> Any:
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(sqlite_backend, "insert_params", broken)
    with web.start_as_current_span("POST /orders"), pytest.raises(sqlite3.OperationalError):
        _enqueue_by(app, path, refused.bind(n=1))
    [send] = spans.named("send default")
    assert send.status.status_code is StatusCode.ERROR
    [exception] = [e for e in send.events if e.name == "exception"]
    assert exception.attributes["exception.type"] == "OperationalError"
    assert exception.attributes["exception.message"] == "disk I/O error"
    assert plugin._sending == {}
    monkeypatch.undo()
    refused.enqueue(n=2)  # the next one is confirmed as ever
    assert [s.status.status_code for s in spans.named("send default")] == [
        StatusCode.ERROR, StatusCode.UNSET,
    ]  # fmt: skip
