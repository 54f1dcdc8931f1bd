"""The ``errands`` command line against a real store with dead jobs (DESIGN §6, §11).

Every command runs as its own ``python -m errands`` process, as an operator would run it;
the store comes from ``ERRANDS_URL``. Bad input must give one clear error line and a
non-zero exit, never a traceback.
"""

from __future__ import annotations

import contextlib
import signal
import sqlite3
from collections import Counter

import acc_basic
import pytest

import errands

from .harness import Cluster, wait_until

pytestmark = pytest.mark.acceptance


def _store_with_dead_jobs(cluster: Cluster) -> tuple[errands.App, int, int, int]:
    """Two jobs dead on their first run (Permanent), one completed; a real worker ran them."""
    app = cluster.app()
    first = acc_basic.fail_first.enqueue(label="first")
    second = acc_basic.fail_first.enqueue(label="second")
    fine = acc_basic.noop.enqueue(n=1)
    worker = cluster.start_worker(label="first-run")
    wait_until(
        lambda: cluster.states() == Counter({"dead": 2, "completed": 1}),
        15,
        "two dead jobs and one completed",
        describe=lambda: str(dict(cluster.states())),
    )
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit(15) == 0
    return app, first.id, second.id, fine.id


def test_migrate_status_and_jobs_list_report_the_store_as_json(cluster: Cluster) -> None:
    migrated = cluster.cli("migrate")
    assert migrated.code == 0, migrated
    assert "applied 0001_initial" in migrated.stdout
    again = cluster.cli("migrate")
    assert (again.code, again.stdout.strip()) == (0, "schema is up to date"), again

    app, dead_a, dead_b, completed = _store_with_dead_jobs(cluster)
    later = acc_basic.noop.enqueue(n=2, queue="later", delay=3600)

    status = cluster.cli("status", "--json")
    assert status.code == 0, status
    data = status.json()
    queues = {q["queue"]: q["counts"] for q in data["queues"]}
    assert set(queues) == {"default", "later"}
    assert queues["default"]["dead"] == 2 and queues["default"]["completed"] == 1
    assert queues["later"]["scheduled"] == 1
    assert sum(queues["default"].values()) == 3
    assert data["dead"] == 2

    text = cluster.cli("status")
    assert text.code == 0, text
    assert "default" in text.stdout and "later" in text.stdout

    listed = cluster.cli("jobs", "list", "--json")
    assert listed.code == 0, listed
    jobs = listed.json()
    assert [j["id"] for j in jobs] == [later.id, completed, dead_b, dead_a]  # newest first
    by_id = {j["id"]: j for j in jobs}
    assert by_id[completed]["state"] == "completed" and by_id[completed]["result"] == 1
    assert by_id[later.id]["state"] == "scheduled" and by_id[later.id]["queue"] == "later"
    assert by_id[dead_a]["errors"][0]["type"] == "Permanent"

    dead_only = cluster.cli("jobs", "list", "--state", "dead", "--json")
    assert [j["id"] for j in dead_only.json()] == [dead_b, dead_a]

    shown = cluster.cli("jobs", "show", str(dead_a), "--json")
    assert shown.code == 0, shown
    job = shown.json()
    assert (job["state"], job["attempt"], job["name"]) == ("dead", 1, "fail_first")
    assert "fails on purpose" in job["errors"][0]["message"]
    assert "Traceback" in job["errors"][0]["traceback"]

    alert = cluster.cli("status", "--max-dead", "1")
    assert alert.code == 3, alert
    assert "ALERT: 2 dead job(s) > --max-dead 1" in alert.stderr
    assert app.get_job(completed).state.value == "completed"


def test_dlq_list_show_discard_and_replay_through_the_cli(cluster: Cluster) -> None:
    app, replay_id, discard_id, _ = _store_with_dead_jobs(cluster)

    dead = cluster.cli("dlq", "list", "--json")
    assert dead.code == 0, dead
    assert [j["id"] for j in dead.json()] == [discard_id, replay_id]
    assert all(j["errors"][-1]["type"] == "Permanent" for j in dead.json())

    shown = cluster.cli("dlq", "show", str(replay_id), "--json")
    assert shown.code == 0, shown
    assert shown.json()["state"] == "dead"
    assert [e["attempt"] for e in shown.json()["errors"]] == [1]
    text = cluster.cli("dlq", "show", str(replay_id))
    assert text.code == 0, text
    assert "attempts that failed (1)" in text.stdout and "Permanent" in text.stdout

    # discard: only with a reason; the refusal is one clear usage error.
    refused = cluster.cli("dlq", "discard", str(discard_id))
    assert refused.code == 2, refused
    assert "--reason" in refused.stderr and "Traceback" not in refused.stderr
    blank = cluster.cli("dlq", "discard", str(discard_id), "--reason", "   ")
    assert blank.code == 2, blank
    assert "--reason must say why" in blank.stderr
    assert app.get_job(discard_id).state.value == "dead"

    discarded = cluster.cli(
        "dlq", "discard", str(discard_id), "--reason", "duplicate of order 7", "--actor", "ops"
    )
    assert discarded.code == 0, discarded
    assert f"discarded 1 job(s): {discard_id}" in discarded.stdout
    job = app.get_job(discard_id)
    assert (job.state.value, job.discard_reason, job.discarded_by) == (
        "discarded",
        "duplicate of order 7",
        "ops",
    )
    assert [(e.action, e.actor) for e in app.audit(job_id=discard_id)] == [("discard", "ops")]
    assert len(cluster.effects(discard_id)) == 1  # discarded without running again

    # One dead job is left: the alert threshold 0 trips, 1 does not.
    alert = cluster.cli("status", "--max-dead", "0")
    assert alert.code == 3, alert
    assert "ALERT: 1 dead job(s) > --max-dead 0" in alert.stderr
    assert cluster.cli("status", "--max-dead", "1").code == 0

    # replay: a dry run changes nothing; a discarded job cannot be replayed.
    dry = cluster.cli("dlq", "replay", str(replay_id), "--dry-run")
    assert (dry.code, dry.stdout.strip()) == (0, f"would replay 1 job(s): {replay_id}"), dry
    assert app.get_job(replay_id).state.value == "dead"
    not_dead = cluster.cli("dlq", "replay", str(discard_id))
    assert not_dead.code == 1, not_dead
    assert "not in the dead-letter queue (state discarded)" in not_dead.stderr

    replayed = cluster.cli("dlq", "replay", str(replay_id), "--json")
    assert replayed.code == 0, replayed
    assert replayed.json() == {"dry_run": False, "matched": [replay_id], "skipped": {}}
    job = app.get_job(replay_id)
    assert (job.state.value, job.attempt) == ("available", 0)

    # A worker runs the same job id to completion.
    worker = cluster.start_worker(label="after-replay")
    wait_until(
        lambda: cluster.state_of(replay_id) == "completed",
        15,
        "the replayed job to complete",
        describe=lambda: str(app.get_job(replay_id)),
    )
    job = app.get_job(replay_id)
    assert job.result == "replayed ok"
    assert job.attempt == 1
    assert [e.type for e in job.errors] == ["Permanent"]  # the history is kept
    assert [attempt for _, attempt, _, _ in cluster.effects(replay_id)] == [1, 1]
    assert [e.action for e in app.audit(job_id=replay_id)] == ["replay"]
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit(15) == 0

    assert cluster.cli("dlq", "list", "--json").json() == []
    assert cluster.cli("status", "--max-dead", "0").code == 0
    assert app.get_job(discard_id).state.value == "discarded"  # replay left it alone


BAD_INPUT = [
    pytest.param(
        ["worker", "no_such_module:app"],
        2,
        "cannot import module 'no_such_module'",
        id="unknown-app-module",
    ),
    pytest.param(
        ["worker", "acc_basic:missing_attr"],
        2,
        "module 'acc_basic' has no attribute 'missing_attr'",
        id="missing-attribute",
    ),
    pytest.param(
        ["worker", "acc_support:EFFECTS_ENV"], 2, "is a str, not an errands.App", id="not-an-app"
    ),
    pytest.param(
        ["status", "--url", "mysql://db.internal/shop"],
        1,
        "unsupported database URL 'mysql://db.internal/shop'",
        id="bad-url-scheme",
    ),
    pytest.param(
        ["worker", "acc_basic:app", "--url", "mysql://db.internal/shop"],
        1,
        "unsupported database URL 'mysql://db.internal/shop'",
        id="bad-url-scheme-worker",
    ),
    pytest.param(
        ["status", "--url", "sqlite:////no-such-errands-folder/jobs.db"],
        2,
        "no errands database at '/no-such-errands-folder/jobs.db'",
        id="status-on-missing-file",
    ),
    pytest.param(
        ["worker", "acc_basic:app", "--url", "sqlite:////no-such-errands-folder/jobs.db"],
        1,
        "folder '/no-such-errands-folder' does not exist",
        id="worker-in-missing-folder",
    ),
    pytest.param(
        ["status", "--url", "sqlite:///{folder}/not-a-database.db"],
        1,
        "file is not a database",
        id="not-a-database",
    ),
    pytest.param(
        ["worker", "acc_basic:app", "--frobnicate"],
        2,
        "No such option '--frobnicate'",
        id="unknown-option",
    ),
    pytest.param(
        ["worker", "acc_basic:app", "-q", "emails=abc"],
        1,
        "queue spec 'emails=abc': the limit after '=' must be a whole number",
        id="bad-queue-limit",
    ),
    pytest.param(
        ["worker", "acc_basic:app", "-c", "20000"],
        1,
        "concurrency (-c) is 20,000: at most 10,000",
        id="concurrency-above-the-maximum",
    ),
    pytest.param(
        ["worker", "acc_basic:app", "-q", "default=20000", "--processes", "2"],
        1,
        "its concurrency (-q default=N) is 20,000: at most 10,000",
        id="queue-concurrency-above-the-maximum-refused-once-not-per-child",
    ),
    pytest.param(
        ["worker", "acc_basic:app", "--processes", "5000"],
        1,
        "processes (--processes) is 5,000: at most 1,024",
        id="processes-above-the-maximum-refused-before-any-child-starts",
    ),
    pytest.param(
        ["worker", "acc_basic:app", "--prefetch", "20000"],
        1,
        "prefetch (--prefetch) is 20,000: at most 10,000",
        id="prefetch-above-the-maximum",
    ),
    pytest.param(
        ["worker", "acc_basic:app", "--prefetch", "20000", "--processes", "2"],
        1,
        "prefetch (--prefetch) is 20,000: at most 10,000",
        id="prefetch-above-the-maximum-refused-once-not-per-child",
    ),
    pytest.param(
        # (a worker runs on a newer schema, warning: a rolling deploy's old workers)
        ["migrate", "--url", "sqlite:///{folder}/future.db"],
        1,
        "has errands schema version 999, newer than this errands (",
        id="migrate-of-a-schema-from-a-newer-errands",
    ),
    pytest.param(["jobs", "show", "424242"], 1, "no job with id 424242", id="no-such-job"),
]


@pytest.mark.parametrize(("args", "code", "message"), BAD_INPUT)
def test_bad_input_gives_one_clear_error_line_and_nonzero_exit_without_traceback(
    cluster: Cluster, args: list[str], code: int, message: str
) -> None:
    cluster.app().migrate()  # a real store, so each case has exactly one thing wrong
    (cluster.folder / "not-a-database.db").write_text("these are not the pages you want\n")
    with contextlib.closing(sqlite3.connect(cluster.folder / "future.db")) as future:
        future.execute(
            "CREATE TABLE errands_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL, "
            "applied_at REAL NOT NULL)"
        )
        future.execute("INSERT INTO errands_migrations VALUES (999, 'from_the_future', 0)")
        future.commit()
    args = [a.replace("{folder}", str(cluster.folder)) for a in args]

    result = cluster.cli(*args)

    assert result.code == code, result
    assert "Traceback" not in result.stdout + result.stderr, result
    assert result.stdout == "", result
    error_lines = [line for line in result.stderr.splitlines() if line.lower().startswith("error:")]
    assert len(error_lines) == 1, result
    assert message in error_lines[0], result
    assert not any(p.alive for p in cluster.procs)
