"""Editing pending jobs through the App, the CLI and the dashboard: reschedule,
reprioritise, move, replace arguments (validated against the payload contract), for
scheduled, available and retryable jobs only, audited with the actor, in bulk and as a
dry run; a worker then runs the edited job as edited."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

import errands
from tests.conftest import running_worker

from .helpers import wait_until


@pytest.fixture
def jobs(app: errands.App) -> dict[str, errands.JobDefinition]:  # type: ignore[type-arg]
    @app.job(name="edit.greet")
    def greet(name: str, times: int = 1) -> str:
        return " ".join([f"hello {name}"] * times)

    @app.job(name="edit.block")
    def block(gate: str) -> None:
        gates[gate].wait(10)

    gates: dict[str, threading.Event] = {"g": threading.Event()}
    app.__dict__["_gates"] = gates
    return {"greet": greet, "block": block}


def test_the_worker_runs_the_edited_arguments_in_the_edited_queue(
    app: errands.App,
    jobs: dict[str, errands.JobDefinition],  # type: ignore[type-arg]
) -> None:
    """Edited while scheduled: new arguments, queue, priority and time; the worker that
    serves the new queue runs it with the new arguments."""
    handle = jobs["greet"].enqueue(name="old", delay=3600)
    result = app.edit(
        [handle.id], args={"name": "new", "times": 2}, queue="vip", priority=3,
        run_at=datetime.now(UTC) - timedelta(seconds=1), actor="ops",
    )  # fmt: skip
    assert result.matched == [handle.id] and result.skipped == {}
    job = handle.job()
    assert (job.queue, job.priority, job.args) == ("vip", 3, {"name": "new", "times": 2})
    [event] = app.audit(job_id=handle.id)
    assert (event.action, event.actor) == ("edit", "ops") and "new" not in str(event.detail)
    with running_worker(app, queues="vip"):
        assert handle.result(timeout=10) == "hello new hello new"


def test_invalid_new_arguments_change_nothing(
    app: errands.App,
    jobs: dict[str, errands.JobDefinition],  # type: ignore[type-arg]
) -> None:
    """Arguments that do not fit the job's contract raise InvalidPayload; nothing written."""
    handle = jobs["greet"].enqueue(name="old", delay=3600)
    with pytest.raises(errands.InvalidPayload, match=f"job {handle.id}"):
        app.replace_args([handle.id], {"name": "x", "times": "many"})
    assert handle.job().args == {"name": "old"} and app.audit() == []


def test_bulk_edits_skip_running_and_finished_jobs_and_dry_runs_write_nothing(
    app: errands.App,
    jobs: dict[str, errands.JobDefinition],  # type: ignore[type-arg]
) -> None:
    """A bulk reprioritise changes the pending jobs only; each other one says why."""
    gates = app.__dict__["_gates"]
    pending = [jobs["greet"].enqueue(name=str(i), delay=3600) for i in range(3)]
    with running_worker(app, concurrency=1):
        running = jobs["block"].enqueue(gate="g")
        wait_until(lambda: running.status().value == "running", what="the blocker to run")
        ids = [h.id for h in pending] + [running.id]
        preview = app.reprioritise(ids, 9, dry_run=True)
        assert preview.matched == [h.id for h in pending]
        assert "running" in preview.skipped[running.id]
        assert all(h.job().priority == 0 for h in pending) and app.audit() == []
        applied = app.reprioritise(ids, 9, actor="ops")
        assert applied.matched == preview.matched
        assert running.job().priority == 0
        gates["g"].set()
        running.result(timeout=10)
    assert all(h.job().priority == 9 for h in pending)
    assert app.reschedule([running.id], delay=5).skipped[running.id].startswith("not pending")


def test_the_cli_edits_with_a_dry_run_first(
    app: errands.App,
    jobs: dict[str, errands.JobDefinition],  # type: ignore[type-arg]
) -> None:
    """`errands jobs edit --dry-run` changes nothing; without it the jobs are edited."""
    from click.testing import CliRunner

    from errands.cli.main import cli

    handle = jobs["greet"].enqueue(name="a", delay=3600)
    runner = CliRunner()
    base = ["jobs", "edit", str(handle.id), "--url", app.url, "--priority", "4"]
    dry = runner.invoke(cli, [*base, "--dry-run"])
    assert dry.exit_code == 0 and "would edit 1 job(s)" in dry.output, dry.output
    assert handle.job().priority == 0
    done = runner.invoke(cli, [*base, "--queue", "slow", "--actor", "cli:ops"])
    assert done.exit_code == 0 and "edited 1 job(s)" in done.output, done.output
    assert (handle.job().priority, handle.job().queue) == (4, "slow")
    refused = runner.invoke(cli, [*base, "--args", '{"name": "b"}'])
    assert refused.exit_code == 2 and "-A" in refused.output


def test_the_dashboard_edits_in_bulk_after_a_dry_run(
    app: errands.App,
    jobs: dict[str, errands.JobDefinition],  # type: ignore[type-arg]
) -> None:
    """The jobs page of a pending state offers a bulk edit; its preview changes nothing,
    its apply edits the jobs, audited with the dashboard's actor."""
    from starlette.testclient import TestClient

    from errands.dashboard import create_app

    handles = [jobs["greet"].enqueue(name=str(i), delay=3600) for i in range(2)]
    with TestClient(
        create_app(app), base_url="http://127.0.0.1", client=("127.0.0.1", 50000)
    ) as client:
        page = client.get("/jobs", params={"state": "scheduled"})
        assert "Edit the selected jobs" in page.text
        csrf = page.text.split('name="csrf_token" value="')[1].split('"')[0]
        form = {"csrf_token": csrf, "ids": [str(h.id) for h in handles], "priority": "7",
                "state": "scheduled"}  # fmt: skip
        preview = client.post("/jobs/edit/preview", data=form)
        assert "Dry run" in preview.text and "would change (priority)" in preview.text
        assert all(h.job().priority == 0 for h in handles)
        client.post("/jobs/edit/apply", data=form)
    assert all(h.job().priority == 7 for h in handles)
    assert app.audit()[0].actor.startswith("dashboard:")


def test_an_edit_keys_the_job_for_the_queue_it_is_in_or_moves_to(app: errands.App) -> None:
    """A job type without a fair_key template is keyed job:<name> in a fair queue. New
    arguments for a job enqueued into a fair queue left it unkeyed (its key was derived
    for the definition's default queue), and a move into a fair queue kept it unkeyed:
    the key now follows the queue the job is in after the edit."""
    app.queue("tenants", fair=True)

    @app.job(name="edit.fair")
    def fair_job(n: int) -> None: ...

    def key(job_id: int) -> str | None:
        row = app.backend.job_get(job_id)
        assert row is not None
        return row.fair_key

    in_fair = fair_job.enqueue(n=1, queue="tenants", delay=3600)
    assert key(in_fair.id) == "job:edit.fair"
    app.edit([in_fair.id], args={"n": 2})
    assert key(in_fair.id) == "job:edit.fair"
    plain = fair_job.enqueue(n=3, delay=3600)
    assert key(plain.id) is None
    app.edit([plain.id], queue="tenants")
    assert key(plain.id) == "job:edit.fair"
    app.edit([plain.id], queue="default")
    assert key(plain.id) is None


def _stored_key_and_limit(app: errands.App, job_id: int) -> tuple[str | None, int | None]:
    """The concurrency key and limit stored on the job's row (no JobRow field has them)."""
    backend: Any = app.backend
    if hasattr(backend, "schema"):  # PostgreSQL
        import psycopg

        with psycopg.connect(backend.config.conninfo) as conn:
            sql = (
                "SELECT concurrency_key, concurrency_limit "
                f'FROM "{backend.schema}".errands_jobs WHERE id = %s'
            )
            [row] = conn.execute(sql, (job_id,)).fetchall()
    else:
        with contextlib.closing(sqlite3.connect(backend.path)) as conn:
            sql = "SELECT concurrency_key, concurrency_limit FROM errands_jobs WHERE id = ?"
            [row] = conn.execute(sql, (job_id,)).fetchall()
    return row[0], row[1]


def test_an_edit_that_derives_the_keys_anew_stores_the_editing_apps_concurrency_limit(
    each_store_url: str,
) -> None:
    """Given jobs enqueued while their type's concurrency_limit was 1, and a deploy that
    raised it to 3, when the new code edits them with new arguments (a new concurrency
    key) or moves them to another queue (the keys derived anew), then each row stores the
    limit 3 with its key, as an enqueue by that code would: the claim holds a row to the
    lower of its stored limit and the worker's, so a row left at 1 ran one job of its key
    at a time for ever after the raise. An edit that derives no key (a new priority)
    leaves the stored limit as it was."""
    keyed = {"concurrency_key": "account:{account}"}
    before = errands.App(each_store_url)
    after = errands.App(each_store_url)
    try:

        @before.job(name="edit.keyed", **keyed, concurrency_limit=1)
        def old_code(account: int) -> None: ...

        @after.job(name="edit.keyed", **keyed, concurrency_limit=3)
        def new_code(account: int) -> None: ...

        with_args, moved, reprioritised = (
            old_code.enqueue(account=n, delay=3600).id for n in (1, 2, 3)
        )
        assert _stored_key_and_limit(before, with_args) == ("account:1", 1)

        assert after.edit([with_args], args={"account": 7}).matched == [with_args]
        assert after.edit([moved], queue="elsewhere").matched == [moved]
        assert after.edit([reprioritised], priority=5).matched == [reprioritised]

        assert _stored_key_and_limit(after, with_args) == ("account:7", 3)
        assert _stored_key_and_limit(after, moved) == ("account:2", 3)
        assert _stored_key_and_limit(after, reprioritised) == ("account:3", 1)  # no key derived
    finally:
        before.close()
        after.close()


def _stored_rate(app: errands.App, job_id: int) -> tuple[int | None, float | None]:
    """The job type's rate stored on the job's row (no JobRow field has it)."""
    backend: Any = app.backend
    if hasattr(backend, "schema"):  # PostgreSQL
        import psycopg

        with psycopg.connect(backend.config.conninfo) as conn:
            sql = (
                f'SELECT rate_limit, rate_period FROM "{backend.schema}".errands_jobs WHERE id = %s'
            )
            [row] = conn.execute(sql, (job_id,)).fetchall()
    else:
        with contextlib.closing(sqlite3.connect(backend.path)) as conn:
            sql = "SELECT rate_limit, rate_period FROM errands_jobs WHERE id = ?"
            [row] = conn.execute(sql, (job_id,)).fetchall()
    return row[0], row[1]


def test_an_edit_that_derives_the_keys_anew_stores_the_editing_apps_rate(
    each_store_url: str,
) -> None:
    """Given jobs enqueued while their type's rate was 5/m, and a deploy that changed it
    to 20/s, when the new code edits them with new arguments or moves them to another
    queue, then each row stores 20/s, as an enqueue by that code would (the claim counts
    a type's starts against the rate stored on its rows: one left at 5/m went on starting
    at most 5 a minute); likewise a rate dropped in code leaves the edited row unlimited.
    An edit of the run time or the priority alone changes no rate."""
    before = errands.App(each_store_url)
    after = errands.App(each_store_url)
    try:

        @before.job(name="edit.rated", rate="5/m")
        def old_code(account: int) -> None: ...

        @after.job(name="edit.rated", rate="20/s")
        def new_code(account: int) -> None: ...

        @before.job(name="edit.unrated", rate="5/m")
        def old_unrated(account: int) -> None: ...

        @after.job(name="edit.unrated")
        def new_unrated(account: int) -> None: ...

        with_args, moved, rescheduled, reprioritised = (
            old_code.enqueue(account=n, delay=3600).id for n in (1, 2, 3, 4)
        )
        unlimited = old_unrated.enqueue(account=5, delay=3600).id
        assert _stored_rate(before, with_args) == (5, 60.0)

        assert after.edit([with_args], args={"account": 7}).matched == [with_args]
        assert after.edit([moved], queue="elsewhere").matched == [moved]
        assert after.edit([rescheduled], delay=7200).matched == [rescheduled]
        assert after.edit([reprioritised], priority=5).matched == [reprioritised]
        assert after.edit([unlimited], args={"account": 8}).matched == [unlimited]

        assert _stored_rate(after, with_args) == (20, 1.0)
        assert _stored_rate(after, moved) == (20, 1.0)
        assert _stored_rate(after, rescheduled) == (5, 60.0)  # no key derived: as it was
        assert _stored_rate(after, reprioritised) == (5, 60.0)
        assert _stored_rate(after, unlimited) == (None, None)
    finally:
        before.close()
        after.close()
