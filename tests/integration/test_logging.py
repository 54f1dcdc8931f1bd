"""Job context on every log record, and sensitive arguments kept out of logs (DESIGN §4, §9)."""

import asyncio
import json
import logging
import threading
import time
from typing import Any

import pytest

import errands

from .helpers import wait_until

user_log = logging.getLogger("shop.billing")


def job_records(caplog: pytest.LogCaptureFixture, logger: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == logger]


def fields(record: logging.LogRecord) -> tuple[object, ...]:
    return tuple(getattr(record, f, None) for f in ("job_id", "job_name", "queue", "attempt"))


def test_user_log_records_inside_a_sync_handler_carry_the_job_fields(
    app: errands.App, worker_factory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)

    @app.job(name="log.charge", queue="billing", retries=1, backoff=0.01)
    def charge(ctx: errands.Context, order_id: int) -> None:
        user_log.info("charging order %s", order_id)
        if ctx.attempt == 1:
            raise ConnectionError("try again")

    handle = charge.enqueue(order_id=7)
    with worker_factory():
        handle.result(timeout=10)
    user_log.info("outside any job")

    records = job_records(caplog, "shop.billing")
    assert [r.getMessage() for r in records] == ["charging order 7"] * 2 + ["outside any job"]
    assert [fields(r) for r in records[:2]] == [
        (handle.id, "log.charge", "billing", 1),
        (handle.id, "log.charge", "billing", 2),
    ]
    assert fields(records[2]) == (None, None, None, None)


def test_user_log_records_inside_an_async_handler_carry_the_job_fields(
    app: errands.App, worker_factory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)

    @app.job(name="log.async_refund", queue="billing")
    async def refund(order_id: int) -> None:
        user_log.info("refund %s: start", order_id)
        await asyncio.sleep(0.05)  # other jobs' tasks run meanwhile on the same loop
        user_log.info("refund %s: done", order_id)

    handles = {n: refund.enqueue(order_id=n) for n in (1, 2, 3)}
    with worker_factory(concurrency=3):
        for handle in handles.values():
            handle.result(timeout=10)

    records = job_records(caplog, "shop.billing")
    assert len(records) == 6
    for record in records:
        order_id = int(record.getMessage().split()[1].rstrip(":"))
        assert fields(record) == (handles[order_id].id, "log.async_refund", "billing", 1)


def test_ctx_logger_records_carry_the_job_fields(
    app: errands.App, worker_factory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)

    @app.job(name="log.ctx_logger")
    def uses_ctx_logger(ctx: errands.Context) -> None:
        ctx.logger.info("hello from the job")

    handle = uses_ctx_logger.enqueue()
    with worker_factory():
        handle.result(timeout=10)

    [record] = [r for r in caplog.records if r.getMessage() == "hello from the job"]
    assert fields(record) == (handle.id, "log.ctx_logger", "default", 1)


def test_sensitive_arguments_never_appear_in_logs_or_stored_errors(
    app: errands.App, worker_factory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    secret = "hunter2-correct-horse"

    @app.job(name="log.login", sensitive={"password"}, retries=1, backoff=0.01)
    def login(user: str, password: str) -> None:
        raise PermissionError(f"login refused for {user} with password {password}")

    handle = login.enqueue(user="alice", password=secret)
    with worker_factory(), pytest.raises(errands.JobFailed) as failed:
        handle.result(timeout=10)

    assert secret not in str(failed.value)
    job = handle.job()
    assert len(job.errors) == 2
    for error in job.errors:
        assert secret not in error.message
        assert error.message == "login refused for alice with password ***"
        assert error.traceback is not None and secret not in error.traceback
    assert job.masked_args == {"user": "alice", "password": "***"}

    errands_records = [r for r in caplog.records if r.name.startswith("errands")]
    assert any(getattr(r, "event", "") == "errands.job.started" for r in errands_records)
    assert any(getattr(r, "event", "") == "errands.job.dead" for r in errands_records)
    assert secret not in caplog.text
    for record in errands_records:
        assert secret not in record.getMessage()
    started = [r for r in errands_records if getattr(r, "event", "") == "errands.job.started"]
    assert "password='***'" in started[0].getMessage()


def test_a_default_worker_writes_one_lifecycle_line_per_finished_job(
    app: errands.App, worker_factory, caplog: pytest.LogCaptureFixture
) -> None:
    """At INFO (the default), a job that completes writes one line, when it finishes; the
    started line (with its arguments) is DEBUG. Two lines per job halved a default
    worker's throughput (docs/benchmarks.md)."""
    caplog.set_level(logging.INFO)

    @app.job(name="log.quiet")
    def quiet(n: int) -> int:
        return n

    handles = [quiet.enqueue(n=i) for i in range(5)]
    with worker_factory():
        assert [h.result(timeout=10) for h in handles] == list(range(5))
    lines = [r for r in caplog.records if getattr(r, "job_name", None) == "log.quiet"]
    assert sorted(getattr(r, "event", "") for r in lines) == ["errands.job.completed"] * 5
    assert all(r.levelno == logging.INFO and "completed in" in r.getMessage() for r in lines)


def test_a_job_still_running_after_a_minute_is_named_at_info(
    app: errands.App, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one line per finished job, a long job would be silent while it runs: the
    lease keeper names it once it has run a minute (here: a shortened threshold)."""
    import threading

    from errands.worker import leases
    from tests.conftest import running_worker

    from .helpers import wait_until

    monkeypatch.setattr(leases, "STILL_RUNNING_AT", (0.3,))
    caplog.set_level(logging.INFO)
    release = threading.Event()

    @app.job(name="log.long")
    def long() -> None:
        release.wait(30)

    errands_app = errands.App(app.url, lease=1)
    errands_app.job(name="log.long")(long.fn)
    try:
        with running_worker(errands_app):
            handle = errands_app.registry["log.long"].enqueue()
            wait_until(lambda: "still running after" in caplog.text, timeout=20)
            release.set()
            handle.result(timeout=20)
    finally:
        release.set()
        errands_app.close()
    [line] = [r for r in caplog.records if "still running" in r.getMessage()]
    assert (line.job_id, line.job_name) == (handle.id, "log.long")  # type: ignore[attr-defined]


def test_a_handlers_own_extra_naming_a_job_field_logs_instead_of_failing_the_job(
    app: errands.App, worker_factory, caplog: pytest.LogCaptureFixture
) -> None:
    """Records made in a job carry its fields; logging refused an ``extra`` naming one
    (KeyError: "Attempt to overwrite 'attempt' in LogRecord"), which failed the job. The
    caller's value is set on its own line now."""
    mine = logging.getLogger("app.payments")

    @app.job(name="logs.extra")
    def charge() -> str:
        mine.warning("retrying the provider", extra={"attempt": 3, "provider": "acme"})
        return "charged"

    handle = charge.enqueue()
    with caplog.at_level(logging.WARNING, logger="app.payments"), worker_factory(concurrency=1):
        assert handle.result(timeout=10) == "charged"
    [record] = [r for r in caplog.records if r.getMessage() == "retrying the provider"]
    assert (record.attempt, record.provider, record.job_id) == (3, "acme", handle.id)


def _json_lines(caplog: pytest.LogCaptureFixture, text: str) -> list[dict[str, Any]]:
    """The captured records whose message holds ``text``, as the JSON format writes them."""
    from errands.observability.logcontext import JsonFormatter

    formatter = JsonFormatter()
    return [json.loads(formatter.format(r)) for r in caplog.records if text in r.getMessage()]


def test_the_workers_lines_about_a_running_jobs_timeout_and_cancel_carry_the_job_fields(
    app: errands.App, worker_factory, caplog: pytest.LogCaptureFixture
) -> None:
    """Given a sync handler that runs past its timeout and one an operator cancels while
    it runs, then the worker's lines about them (written by its lease keeper, outside the
    handler: "ran past its timeout", "still running past its timeout", "cancelled by an
    operator") carry job_id, job_name, queue and attempt in the JSON format, as the
    handler's own lines do (DESIGN §9). They had the id in their text alone."""
    caplog.set_level(logging.INFO)
    started = threading.Event()

    @app.job(name="log.overtime", queue="slow", timeout=0.3, retries=0)
    def overtime() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # ignores ctx.cancelled: interrupted later
            time.sleep(0.01)

    @app.job(name="log.cancelled", lease=1, retries=0)
    def cancelled(ctx: errands.Context) -> None:
        started.set()
        for _ in range(3000):
            if ctx.cancelled:
                return
            time.sleep(0.01)

    late = overtime.enqueue()
    stopped = cancelled.enqueue()
    with worker_factory(concurrency=2, queues=["default", "slow"]):
        assert started.wait(20)
        stopped.cancel()
        wait_until(lambda: late.job().state.is_terminal, timeout=30, what="the timeout")
        wait_until(lambda: stopped.job().state.is_terminal, timeout=30, what="the cancel")

    for text, handle, name, queue in (
        ("ran past its", late, "log.overtime", "slow"),
        ("still running past its timeout", late, "log.overtime", "slow"),
        ("cancelled by an operator", stopped, "log.cancelled", "default"),
    ):
        [line] = _json_lines(caplog, text)
        assert (line["job_id"], line["job_name"], line["queue"], line["attempt"]) == (
            handle.id,
            name,
            queue,
            1,
        ), text
