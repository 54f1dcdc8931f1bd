"""Announcing ended jobs on PostgreSQL (schema 17) costs nothing to the writes that end
nothing, and one notification to a statement that ends attempts.

Before schema 17 a statement-level trigger with a transition table announced them: every
UPDATE of errands_jobs, each claim and heartbeat included, copied its new rows for the
trigger to read (11 % of the server's time in the claim and completion statements on the
bench machine). Now the statements that end attempts announce their jobs themselves (the
notify_ended CTE), and a row trigger announces every other end, which leaves a state
other than running. What this file checks on the SQL and on a real LISTEN connection;
tests/conformance/test_ended_announcements.py checks that every way a job ends is heard.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import errands
from errands.backends.base import ActionParams, FinishParams, LeaseRef, RescueParams
from errands.backends.postgres.backend import done_channel
from tests.conformance.support import claim, claim_one, error, finish, insert, make_dead

SQL = Path(errands.__file__).parent / "backends" / "postgres"
TERMINAL = ("completed", "dead", "cancelled", "discarded")

# Statements that change a job's state and never end a running job, with why: any new
# statement that sets state must be added here or announce its ends (notify_ended).
NEVER_END_A_RUNNING_JOB = {
    "job_claim": "to running",
    "job_claim_ids": "to running",
    "job_promote_due": "scheduled or retryable to available",
    "job_replay": "dead to available",
    "job_discard": "dead to discarded: the row trigger",
    "job_cancel_pending": "pending or waiting to cancelled: the row trigger",
    "job_resume_if_signalled": "waiting to available",
    "job_expire_wait": "waiting to dead or retryable: the row trigger",
    "job_edit": "pending to pending",
    "wf_jobs_join": "just inserted: a dependent to waiting",
    "wf_release_many": "waiting to scheduled or available",
    "wf_end_blocked_many": "waiting to cancelled: the row trigger",
    "wf_cancel_member": "pending or waiting to cancelled: the row trigger",
}


def _statements() -> Iterator[tuple[str, str]]:
    for path in (SQL / "queries.sql", SQL / "workflows.sql"):
        text = path.read_text()
        for match in re.finditer(r"^-- name: (\S+)\n(.*?)(?=^-- name: |\Z)", text, re.S | re.M):
            yield match.group(1), match.group(2)


def _sets_state(body: str) -> bool:
    code = "\n".join(line for line in body.splitlines() if not line.lstrip().startswith("--"))
    return bool(
        re.search(r"UPDATE \{schema\}\.errands_jobs\b", code)
        and re.search(r"(SET|,)\s+state\s*=", code)
    )


def test_every_statement_that_may_end_a_running_job_announces_what_it_ended() -> None:
    """Each statement that sets a job's state either carries notify_ended, read by its
    final SELECT (a CTE nothing reads is not run), or is listed as never ending a running
    job (those ends are the row trigger's)."""
    seen = set()
    for name, body in _statements():
        if not _sets_state(body):
            continue
        seen.add(name)
        if name in NEVER_END_A_RUNNING_JOB:
            assert "{notify_ended}" not in body, f"{name}: announced twice"
            continue
        assert "{notify_ended}" in body, (
            f"{name} sets a job's state and may end a running job, but announces nothing: "
            "add the notify_ended CTE (see job_finish_many), or list it in "
            "NEVER_END_A_RUNNING_JOB with the reason"
        )
        assert re.search(r"FROM ended[^;]*CROSS JOIN notified", body), (
            f"{name}: its final SELECT must read notified"
        )
    assert set(NEVER_END_A_RUNNING_JOB) <= seen, "a listed statement is gone or renamed"
    assert {"job_finish_many", "job_release_many", "job_rescue_many", "job_suspend"} <= seen


@pytest.fixture
def app(pg_url: str) -> Iterator[errands.App]:
    app = errands.App(pg_url)
    app.migrate()
    yield app
    app.close()


@pytest.fixture
def harness_expire(app: errands.App) -> Any:
    """expire(job_id): its lease ran out a second ago (as a rescue needs)."""
    backend: Any = app.backend

    def expire(job_id: int) -> None:
        with psycopg.connect(backend.config.conninfo, autocommit=True) as conn:
            conn.execute(
                f'UPDATE "{backend.schema}".errands_jobs '
                "SET lease_expires_at = now() - interval '1 second' WHERE id = %s",
                (job_id,),
            )

    return expire


@pytest.fixture
def heard(app: errands.App) -> Iterator[Any]:
    """A LISTEN connection on the results channel: heard(until) -> the payloads since the
    last call, up to the first that holds job ``until`` (notifications arrive in commit
    order, so one sent by any earlier write is among them), for at most 5 s."""
    backend: Any = app.backend
    with psycopg.connect(backend.config.conninfo, autocommit=True) as conn:
        conn.execute(f'LISTEN "{done_channel(backend.schema)}"')

        def collect(until: int) -> list[str]:
            payloads = []
            for n in conn.notifies(timeout=5):
                payloads.append(n.payload)
                if str(until) in n.payload.split(","):
                    break
            return payloads

        yield collect


def _marker(backend: Any) -> int:
    """A job completed now: its notification closes what heard() collects."""
    job_id = insert(backend, queue="marker")
    assert finish(backend, claim_one(backend, "marker"), "completed")
    return job_id


def test_claims_heartbeats_retries_releases_and_suspensions_announce_nothing(
    app: errands.App, harness_expire: Any, heard: Any
) -> None:
    backend: Any = app.backend
    for _ in range(5):
        insert(backend)
    rows = claim(backend, limit=5)
    backend.job_heartbeat_many([LeaseRef(r.id, r.lease_token or "", 30.0) for r in rows])
    assert finish(backend, rows[0], "retryable", error=error(), delay=60.0)
    assert backend.job_release_many([LeaseRef(rows[1].id, rows[1].lease_token or "", 30.0)])
    suspension = FinishParams(rows[2].id, rows[2].lease_token or "", "waiting", wait_signal="go")
    assert backend.job_finish_many([suspension]) == [True]
    harness_expire(rows[3].id)
    rescue = RescueParams(rows[3].id, rows[3].lease_token or "", "retryable", error(), 60.0)
    assert backend.job_rescue_many([rescue]) == [True]
    marker = _marker(backend)
    assert heard(marker) == [str(marker)]


def test_a_batch_of_outcomes_is_one_notification_with_every_id(
    app: errands.App, heard: Any
) -> None:
    """The completer's batch: one NOTIFY for the statement, not one per job, and the row
    trigger adds none (its rows leave running)."""
    backend: Any = app.backend
    for _ in range(3):
        insert(backend)
    rows = claim(backend, limit=3)
    outcomes = [
        FinishParams(rows[0].id, rows[0].lease_token or "", "completed", result_json="1"),
        FinishParams(rows[1].id, rows[1].lease_token or "", "dead", error=error()),
        FinishParams(rows[2].id, rows[2].lease_token or "", "retryable", error=error(), delay=60),
    ]
    assert backend.job_finish_many(outcomes) == [True, True, True]
    marker = _marker(backend)
    ended = ",".join(str(i) for i in sorted((rows[0].id, rows[1].id)))
    assert heard(marker) == [ended, str(marker)]


def test_a_batch_of_plain_completions_is_one_notification_too(app: errands.App, heard: Any) -> None:
    """The lean statement for completions alone (job_complete_many) announces as well."""
    backend: Any = app.backend
    for _ in range(3):
        insert(backend)
    rows = claim(backend, limit=3)
    done = [FinishParams(r.id, r.lease_token or "", "completed", fair=False) for r in rows]
    assert backend.job_finish_many(done) == [True, True, True]
    assert heard(max(r.id for r in rows)) == [
        ",".join(str(r.id) for r in sorted(rows, key=lambda r: r.id))
    ]


def test_ends_from_other_states_are_announced_by_the_row_trigger(
    app: errands.App, heard: Any
) -> None:
    backend: Any = app.backend
    dead = make_dead(backend)
    assert heard(dead) == [str(dead)]  # the worker's write
    backend.job_discard(ActionParams(actor="test", ids=[dead], reason="obsolete"))
    pending = insert(backend, delay=3600)
    backend.job_cancel(pending, "test")
    assert heard(pending) == [str(dead), str(pending)]


def test_the_old_trigger_and_its_transition_table_are_gone(app: errands.App) -> None:
    backend: Any = app.backend
    with psycopg.connect(backend.config.conninfo, autocommit=True) as conn:
        triggers = {
            r[0]: r[1]
            for r in conn.execute(
                "SELECT tgname, pg_get_triggerdef(oid) FROM pg_trigger "
                "WHERE tgrelid = to_regclass(%s) AND NOT tgisinternal",
                (f'"{backend.schema}".errands_jobs',),
            )
        }
    assert set(triggers) == {"errands_jobs_dead_hooks", "errands_jobs_ended"}
    assert "FOR EACH ROW" in triggers["errands_jobs_ended"]
    assert "REFERENCING" not in " ".join(triggers.values())
    assert all(state in triggers["errands_jobs_ended"] for state in TERMINAL)
    assert "old.state <> 'running'" in triggers["errands_jobs_ended"].lower()
