"""The dead-letter queue: replay, discard, audit, on_dead hooks, ERROR logs (DESIGN §6)."""

import logging
import sqlite3
from contextlib import closing

import pytest

import errands
from errands import JobState
from errands.backends.base import ActionParams

from .helpers import count_jobs, wait_until


def test_replay_runs_the_same_dead_job_again_to_completion(
    app: errands.App, worker_factory
) -> None:
    downstream = {"up": False}
    runs: list[tuple[int, str]] = []

    @app.job(name="dlq.sync_invoice", retries=1, backoff=0.01)
    def sync_invoice(ctx: errands.Context, invoice_id: int) -> str:
        runs.append((ctx.attempt, ctx.idempotency_key))
        if not downstream["up"]:
            raise ConnectionError("accounting system is down")
        return f"invoice {invoice_id} synced"

    handle = sync_invoice.enqueue(invoice_id=9, key="invoice:9")
    with worker_factory():
        with pytest.raises(errands.JobFailed, match="accounting system is down"):
            handle.result(timeout=10)
        assert [j.id for j in app.jobs(state="dead")] == [handle.id]

        downstream["up"] = True
        outcome = app.replay([handle.id], actor="alice")
        assert outcome.matched == [handle.id] and outcome.skipped == {}
        assert handle.result(timeout=10) == "invoice 9 synced"

    assert count_jobs(app) == 1  # the same row, not a copy
    # two failed attempts, then the replay's first attempt; the same idempotency key each time
    key = "dlq.sync_invoice:invoice:9"
    assert runs == [(1, key), (2, key), (1, key)]
    job = handle.job()
    assert job.state is JobState.COMPLETED
    assert job.id == handle.id and job.idempotency_key == "invoice:9"
    assert job.attempt == 1  # attempts were reset by the replay
    assert [e.attempt for e in job.errors] == [1, 2]  # the history from before is kept
    [event] = app.audit(job_id=handle.id)
    assert (event.action, event.actor, event.job_id) == ("replay", "alice", handle.id)


def test_replay_of_a_job_that_is_not_dead_is_skipped(app: errands.App) -> None:
    @app.job(name="dlq.pending")
    def pending() -> None:
        pass

    handle = pending.enqueue()
    outcome = app.replay([handle.id])
    assert outcome.matched == []
    assert "not in the dead-letter queue" in outcome.skipped[handle.id]
    assert app.audit(job_id=handle.id) == []


def test_discard_without_a_reason_is_refused_and_discard_keeps_the_row_with_reason_and_actor(
    app: errands.App, worker_factory
) -> None:
    @app.job(name="dlq.hopeless", retries=0)
    def hopeless() -> None:
        raise errands.Permanent("customer deleted")

    handle = hopeless.enqueue()
    with worker_factory(), pytest.raises(errands.JobFailed):
        handle.result(timeout=10)

    for empty in ("", "   "):
        with pytest.raises(errands.InvalidTransition, match="reason"):
            app.discard([handle.id], reason=empty)
    assert handle.status() is JobState.DEAD
    assert app.audit(job_id=handle.id) == []

    outcome = app.discard([handle.id], reason="customer deleted their account", actor="bob")
    assert outcome.matched == [handle.id]

    job = handle.job()
    assert job.state is JobState.DISCARDED
    assert job.discard_reason == "customer deleted their account"
    assert job.discarded_by == "bob"
    assert job.finished_at is not None
    assert [e.message for e in job.errors] == ["customer deleted"]
    assert count_jobs(app) == 1
    [event] = app.audit(job_id=handle.id)
    assert (event.action, event.actor) == ("discard", "bob")
    assert event.detail == {"reason": "customer deleted their account"}
    with pytest.raises(errands.JobCancelled, match="discarded"):
        handle.result(timeout=1)


@pytest.mark.parametrize("actor", ["", "   ", "\t\n"])
def test_a_blank_actor_is_refused_and_nothing_is_done_or_audited(
    app: errands.App, actor: str
) -> None:
    """An audit entry by '' names nobody: replay, discard, cancel, edit, signal, pause all
    refused a NUL or an oversized actor, and took a blank one."""

    @app.job(name="dlq.blank", retries=0)
    def blank() -> None:
        pass

    handle = blank.enqueue(delay=3600)
    for act in (
        lambda: app.replay([handle.id], actor=actor),
        lambda: app.discard([handle.id], reason="r", actor=actor),
        lambda: app.cancel(handle.id, actor=actor),
        lambda: app.edit([handle.id], priority=3, actor=actor),
        lambda: app.signal(handle.id, "go", actor=actor),
        lambda: app.pause("default", actor=actor),
    ):
        with pytest.raises(errands.ConfigurationError, match="is blank: name who acts"):
            act()
    assert handle.job().state is JobState.SCHEDULED and handle.job().priority == 0
    assert app.audit() == []


def test_on_dead_hooks_get_the_job_and_a_failing_hook_does_not_break_the_worker(
    app: errands.App, worker_factory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    seen: list[errands.Job] = []

    @app.on_dead
    def broken_hook(job: errands.Job) -> None:
        raise RuntimeError("the pager integration is misconfigured")

    @app.on_dead
    def record(job: errands.Job) -> None:
        seen.append(job)

    @app.job(name="dlq.doomed", retries=0)
    def doomed(n: int) -> None:
        raise ValueError(f"cannot handle {n}")

    @app.job(name="dlq.fine")
    def fine(n: int) -> int:
        return n

    first = doomed.enqueue(n=1)
    with worker_factory(concurrency=1):
        with pytest.raises(errands.JobFailed):
            first.result(timeout=10)
        wait_until(lambda: seen, what="the on_dead hook")
        assert fine.enqueue(n=2).result(timeout=10) == 2
        second = doomed.enqueue(n=3)
        with pytest.raises(errands.JobFailed):
            second.result(timeout=10)
        wait_until(lambda: len(seen) == 2, what="the on_dead hook for the second job")
        assert fine.enqueue(n=4).result(timeout=10) == 4

    assert [(j.id, j.state, j.last_error.message) for j in seen] == [  # type: ignore[union-attr]
        (first.id, JobState.DEAD, "cannot handle 1"),
        (second.id, JobState.DEAD, "cannot handle 3"),
    ]
    hook_failures = [r for r in caplog.records if "on_dead hook" in r.getMessage()]
    assert len(hook_failures) == 2
    assert all(r.levelno == logging.ERROR and r.exc_info for r in hook_failures)


def test_an_on_dead_hook_that_lost_its_connection_is_called_once_more_a_bug_is_not(
    app: errands.App, worker_factory
) -> None:
    """A dead-letter alert whose service was away for a moment (a lost or refused
    connection) is called once more rather than lost; one whose service is down is
    called twice, not in a loop; a hook failing for any other reason (a bug) once."""
    calls = {"alert": 0, "buggy": 0, "down": 0}
    alerted: list[int] = []

    @app.on_dead
    def alert(job: errands.Job) -> None:
        calls["alert"] += 1
        if calls["alert"] == 1:
            raise ConnectionResetError("the pager's connection was reset")
        alerted.append(job.id)

    @app.on_dead
    def buggy(job: errands.Job) -> None:
        calls["buggy"] += 1
        raise KeyError("pager_channel")

    @app.on_dead
    def down(job: errands.Job) -> None:
        calls["down"] += 1
        raise ConnectionRefusedError("the metrics sink is down")

    @app.job(name="dlq.blip", retries=0)
    def doomed(n: int) -> None:
        raise ValueError(f"cannot handle {n}")

    handle = doomed.enqueue(n=1)
    with worker_factory(concurrency=1):
        with pytest.raises(errands.JobFailed):
            handle.result(timeout=10)
        wait_until(lambda: calls["down"] >= 2, what="every on_dead hook")
    assert alerted == [handle.id]
    assert calls == {"alert": 2, "buggy": 1, "down": 2}


def test_a_job_entering_the_dead_letter_queue_logs_at_error(
    app: errands.App, worker_factory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)

    @app.job(name="dlq.noisy", retries=1, backoff=0.01)
    def noisy() -> None:
        raise KeyError("missing-config")

    handle = noisy.enqueue()
    with worker_factory():
        with pytest.raises(errands.JobFailed):
            handle.result(timeout=10)
        dead_logs = wait_until(
            lambda: [r for r in caplog.records if getattr(r, "event", "") == "errands.job.dead"],
            what="the dead log record",
        )

    [record] = dead_logs
    assert record.levelno == logging.ERROR
    assert record.name.startswith("errands")
    assert getattr(record, "job_id", None) == handle.id
    assert "dead-letter queue" in record.getMessage()
    assert "missing-config" in record.getMessage()
    retry_logs = [r for r in caplog.records if getattr(r, "event", "") == "errands.job.retrying"]
    assert [r.levelno for r in retry_logs] == [logging.WARNING]


def test_a_replay_goes_on_past_a_dead_job_whose_stored_meta_is_not_json(
    app: errands.App, db_url: str
) -> None:
    """A dead row whose meta is not JSON (written by hand, or a raw row): a replay, by id
    or of the whole DLQ, replays every dead job. The check for workflow callbacks read
    every job's meta with json_extract, and SQLite's 'malformed JSON' failed the whole
    replay."""

    @app.job(name="dlq.raw_meta")
    def raw_meta() -> None: ...

    ids = [raw_meta.enqueue().id for _ in range(3)]
    path = db_url.removeprefix("sqlite:///")
    for params in (ActionParams(actor="t", ids=ids), ActionParams(actor="t", all_matching=True)):
        with closing(sqlite3.connect(path)) as conn, conn:
            conn.execute("UPDATE errands_jobs SET state = 'dead', finished_at = 1, attempt = 1")
            conn.execute("UPDATE errands_jobs SET meta = '{not json' WHERE id = ?", (ids[0],))
        assert app.backend.job_replay(params).matched == ids
