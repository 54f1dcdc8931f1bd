"""Progress (``ctx.progress``): kept in memory, stored by the next heartbeat (no write per
call), visible on ``handle.progress()``, ``errands jobs show``, the dashboard's running
jobs, and the ``errands.job.progress`` event; a new attempt starts without it."""

from __future__ import annotations

import threading

import pytest

import errands
from errands.observability.events import Event
from tests.conftest import running_worker

from .helpers import wait_until


def test_progress_is_stored_by_heartbeats_not_by_each_call(app: errands.App) -> None:
    """A thousand ctx.progress calls make a handful of stored reports (one per heartbeat
    at most): the latest reaches handle.progress() while the job runs."""
    release = threading.Event()
    stored: list[Event] = []
    app.events.subscribe(lambda e: stored.append(e) if e.name == "errands.job.progress" else None)

    @app.job(name="progress.render", lease=1.5)
    def render(ctx: errands.Context, pages: int) -> str:
        for page in range(1, pages + 1):
            ctx.progress(page / pages, f"rendered {page} of {pages} pages")
        release.wait(10)
        return "done"

    with running_worker(app):
        handle = render.enqueue(pages=1000)
        progress = wait_until(handle.progress, what="progress stored by a heartbeat")
        assert progress == errands.Progress(1.0, "rendered 1000 of 1000 pages")
        release.set()
        assert handle.result(timeout=10) == "done"
    assert 1 <= len(stored) <= 3, f"{len(stored)} reports stored for 1000 calls"
    assert stored[-1]["progress"] == 1.0 and stored[-1]["job_id"] == handle.id


def test_a_new_attempt_starts_without_the_last_attempts_progress(app: errands.App) -> None:
    """A retry's handle.progress() is None until the retry reports its own."""
    seen: list[errands.Progress | None] = []
    gate = threading.Event()

    @app.job(name="progress.flaky", lease=1.5, retries=1, backoff=0.01)
    def flaky(ctx: errands.Context) -> None:
        if ctx.attempt == 1:
            ctx.progress(0.9, "almost")
            wait_until(lambda: app.get_job(ctx.job_id).progress is not None, what="stored")
            raise ConnectionError("blip")
        seen.append(app.get_job(ctx.job_id).progress)
        gate.set()

    with running_worker(app):
        handle = flaky.enqueue()
        assert gate.wait(15)
        handle.result(timeout=10)
    assert seen == [None]


def test_bad_progress_values_are_refused_with_a_clear_error(app: errands.App) -> None:
    """Fractions outside 0..1 (or not numbers) raise ValueError in the handler."""
    errors: list[str] = []

    @app.job(name="progress.bad", retries=0)
    def bad(ctx: errands.Context) -> None:
        for value in (1.5, -0.1, float("nan"), "half", True):
            try:
                ctx.progress(value)  # type: ignore[arg-type]
            except ValueError as exc:
                errors.append(str(exc))

    with running_worker(app):
        bad.enqueue().result(timeout=10)
    assert len(errors) == 5 and all("ctx.progress" in e for e in errors)


def test_jobs_show_and_the_dashboard_show_a_running_jobs_progress(app: errands.App) -> None:
    """The CLI's job view and the dashboard's running jobs show start, worker and progress."""
    pytest.importorskip("starlette")
    from click.testing import CliRunner
    from starlette.testclient import TestClient

    from errands.cli.main import cli
    from errands.dashboard import create_app

    release = threading.Event()

    @app.job(name="progress.long", lease=1.5)
    def long(ctx: errands.Context) -> None:
        ctx.progress(0.4, "rendered 40 of 100 pages")
        release.wait(10)

    try:
        with running_worker(app) as worker:
            handle = long.enqueue()
            wait_until(handle.progress, what="progress stored")
            shown = CliRunner().invoke(cli, ["jobs", "show", str(handle.id), "--url", app.url])
            assert "40% rendered 40 of 100 pages" in shown.output, shown.output
            with TestClient(
                create_app(app), base_url="http://127.0.0.1", client=("127.0.0.1", 50000)
            ) as client:
                page = client.get("/jobs", params={"state": "running"})
            assert page.status_code == 200
            assert "rendered 40 of 100 pages" in page.text
            assert worker.id in page.text and "started" in page.text
            release.set()
    finally:
        release.set()


def test_a_progress_message_quoting_a_sensitive_argument_is_masked_where_it_is_shown(
    app: errands.App,
) -> None:
    """``ctx.progress(.5, f"sending to {email}")`` of a job with ``sensitive={"email"}``:
    the address showed on the dashboard's job page and running list, in ``jobs show`` and
    its JSON, and in the progress event; it is masked there as in the job's errors."""
    pytest.importorskip("starlette")
    from click.testing import CliRunner
    from starlette.testclient import TestClient

    from errands.cli.main import cli
    from errands.dashboard import create_app

    release = threading.Event()
    events: list[Event] = []
    app.events.subscribe(lambda e: events.append(e) if e.name == "errands.job.progress" else None)

    @app.job(name="progress.mail", lease=1.5, sensitive={"email"})
    def mail(ctx: errands.Context, email: str) -> None:
        ctx.progress(0.5, f"sending to {email}")
        release.wait(10)

    secret = "alice@example.com"
    try:
        with running_worker(app):
            handle = mail.enqueue(email=secret)
            wait_until(handle.progress, what="progress stored")
            wait_until(lambda: events, what="the progress event")
            for args in (
                ["jobs", "show", str(handle.id)],
                ["jobs", "show", str(handle.id), "--json"],
            ):
                shown = CliRunner().invoke(cli, [*args, "--url", app.url])
                assert "sending to" in shown.output and secret not in shown.output, shown.output
            with TestClient(
                create_app(app), base_url="http://127.0.0.1", client=("127.0.0.1", 50000)
            ) as client:
                for page in (client.get(f"/jobs/{handle.id}"), client.get("/jobs?state=running")):
                    assert page.status_code == 200
                    assert "sending to" in page.text and secret not in page.text
            assert secret not in events[-1]["message"]
            release.set()
    finally:
        release.set()


def test_a_long_progress_message_is_masked_before_it_is_cut_to_size(app: errands.App) -> None:
    """A message cut to its 500 characters before masking kept only part of a sensitive
    value, which the masking where it is shown no longer found: its first characters
    showed. Masked first, the store never holds any of it."""
    release = threading.Event()
    token = "tok_" + "s3cr3t" * 6  # 40 characters

    @app.job(name="progress.long", lease=1.5, sensitive={"token"})
    def long_message(ctx: errands.Context, token: str) -> None:
        ctx.progress(0.5, "x" * 480 + token)
        release.wait(10)

    try:
        with running_worker(app):
            handle = long_message.enqueue(token=token)
            wait_until(handle.progress, what="progress stored")
            stored = handle.progress().message  # type: ignore[union-attr]
            assert stored == "x" * 480 + "***"
            assert token[:8] not in stored
            release.set()
    finally:
        release.set()
