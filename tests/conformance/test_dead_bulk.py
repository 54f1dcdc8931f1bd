"""Bulk dead-letter actions: many jobs at once, set-based, on every backend.

``dlq replay --all`` / ``dlq discard --all`` (``app.replay(all=True)``, the dashboard's
"every job matching") ran four statements per job in one write transaction: 100,000 dead
jobs took a minute on PostgreSQL holding every row's lock, and 1,000,000 held SQLite's
write lock for three minutes (every enqueue of the application failed meanwhile); the
dry run took the same write transaction. Now a few statements change every job chosen, in
one transaction (still all or nothing), and a dry run is a plain read. What this file
checks: the end state is the one a replay or discard job by job leaves (workflow members,
stored steps, the audit), the statements do not grow with the number of jobs, a dry run
takes no write lock (SQLite) and no row lock (PostgreSQL), and a failure part way changes
nothing.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest

from errands.backends import Backend, shared_admin
from errands.backends.base import ActionParams, ClaimParams, FinishParams, ListParams, QueueClaim
from errands.backends.shared_admin import TxRun
from errands.backends.workflow_store import NodeSpec, WorkflowSpec
from errands.jobs import JobRow

from .conftest import Harness
from .support import claim, error, finish, make_dead, request

EVENTS = ("on_success", "on_settled", "on_dead")


# -- a mixed dead-letter queue ---------------------------------------------------------
@dataclass
class Mix:
    """One copy of the mixed scenario, in its own queue: its jobs and workflows in the
    order they were made (two copies compare position by position)."""

    queue: str
    jobs: list[int]
    workflows: list[int]
    running: JobRow  # a DAG member still running while its sibling is replayed

    @property
    def callbacks(self) -> str:
        return f"{self.queue}-callbacks"


def _member(queue: str, node: str) -> NodeSpec:
    return NodeSpec(node, request(name=f"member.{node}", queue=queue))


def _callbacks(queue: str, prefix: str = "") -> dict[str, Any]:
    return {e: request(name=f"callback.{prefix}{e}", queue=f"{queue}-callbacks") for e in EVENTS}


def _mix(backend: Backend, queue: str) -> Mix:
    """Dead jobs of every kind a replay treats apart, all in ``queue``:

    - a batch of two, one member dead, one completed: settled failed, on_dead fired;
    - a DAG a, b, then c after both (policy cancel): a dead while b still runs, c waiting;
    - a DAG of a job and a nested batch of one member, that member dead, the job
      completed: the nested batch failed, and with it the outer one;
    - three plain dead jobs with keys, the first with two stored steps (and the dead
      batch member with one).
    """
    batch = backend.workflow_insert(
        WorkflowSpec(
            "batch", "batch", [_member(queue, "m0"), _member(queue, "m1")], _callbacks(queue)
        )
    )
    dag = backend.workflow_insert(
        WorkflowSpec(
            "dag",
            "dag",
            [
                _member(queue, "a"),
                _member(queue, "b"),
                NodeSpec("c", request(name="member.c", queue=queue), (0, 1), ("cancel", "cancel")),
            ],
            _callbacks(queue),
        )
    )
    inner = WorkflowSpec("inner", "batch", [_member(queue, "inner")], _callbacks(queue, "inner."))
    outer = backend.workflow_insert(
        WorkflowSpec(
            "outer",
            "dag",
            [_member(queue, "job"), NodeSpec("nested", None, child=inner)],
            _callbacks(queue, "outer."),
        )
    )
    [nested] = outer.children.values()
    rows = {r.id: r for r in claim(backend, queue, 100)}
    assert len(rows) == 6  # every member but c
    ids = [j.id for j in (*batch.jobs, *dag.jobs, *outer.jobs, *nested.jobs)]
    m0, m1, a, b, _, job, inner_member = ids
    for job_id, state in ((m0, "dead"), (m1, "completed"), (a, "dead")):
        assert finish(backend, rows[job_id], state, **_outcome(state))
    for job_id, state in ((inner_member, "dead"), (job, "completed")):
        assert finish(backend, rows[job_id], state, **_outcome(state))
    plain = [
        make_dead(backend, queue=queue, name="bulk.plain", key=f"{queue}:{i}") for i in range(3)
    ]
    for step in ("charge", "email"):
        backend.step_store(plain[0], step, '"done"', 1)
    backend.step_store(m0, "charge", '"done"', 1)
    return Mix(queue, [*plain, *ids], [batch.id, dag.id, outer.id, nested.id], rows[b])


def _outcome(state: str) -> dict[str, Any]:
    return {"error": error()} if state == "dead" else {}


def _snapshot(backend: Backend, mix: Mix) -> dict[str, Any]:
    """Everything a replay or discard may change, by position in the mix (ids differ)."""
    position = {job_id: i for i, job_id in enumerate(mix.jobs)}
    jobs = []
    for job_id in mix.jobs:
        row = backend.job_get(job_id)
        assert row is not None
        jobs.append(
            (
                row.name, row.state, row.attempt, row.rescues, bool(row.cancel_requested),
                row.finished_at is None, (row.idempotency_key or "").rpartition(":")[2],
                len(json.loads(row.errors)),
                row.discarded_by, row.discard_reason,
                [s.name for s in backend.step_list(job_id)],
            )
        )  # fmt: skip
    workflows = []
    for workflow_id in mix.workflows:
        wf = backend.workflow_get(workflow_id)
        assert wf is not None
        members = sorted(
            (m.node, m.state, m.outcome, sorted(position.get(p, p) for p in m.parents))
            for m in backend.workflow_members(workflow_id)  # (a nested one: by its node)
        )
        workflows.append(
            (
                wf.state, wf.total, wf.completed, wf.dead, wf.cancelled, wf.skipped,
                wf.pending, wf.on_success_job is not None, wf.on_settled_job is not None,
                wf.on_dead_job is not None, members,
            )
        )  # fmt: skip
    fired = backend.job_list(ListParams(queue=mix.callbacks, limit=100))
    audit = sorted(
        (position[e.job_id], e.actor, e.action, e.detail)
        for job_id in mix.jobs
        for e in backend.audit_list(job_id=job_id)
        if e.job_id is not None
    )
    return {
        "jobs": jobs,
        "workflows": workflows,
        "callbacks": sorted((r.name, r.state) for r in fired),
        "audit": audit,
    }


def _run_what_is_left(backend: Backend, mix: Mix) -> None:
    """The running member completes, then every job the mix's queue holds runs to
    completion (the replayed ones, the dependents they release)."""
    assert finish(backend, mix.running, "completed")
    while rows := claim(backend, mix.queue, 100):
        for row in rows:
            assert finish(backend, row, "completed")


def _act(backend: Backend, action: str, params: ActionParams) -> list[int]:
    if action == "replay":
        return backend.job_replay(params).matched
    return backend.job_discard(params).matched


def _chunk(monkeypatch: pytest.MonkeyPatch, size: int | None) -> None:
    """Bulk actions change ``size`` jobs a statement (SQLite: a transaction)."""
    if size is not None:  # (raising=False: the suite also runs on code without chunks)
        monkeypatch.setattr(shared_admin, "BULK_CHUNK", size, raising=False)


@pytest.mark.parametrize("chunk", [None, 2], ids=["one chunk", "chunks of 2"])
@pytest.mark.parametrize("action", ["replay", "discard"])
def test_a_bulk_action_leaves_the_end_state_a_job_by_job_one_leaves(
    backend: Backend, action: str, chunk: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mix twice: one copy replayed (with fresh) or discarded one job at a time, the
    other all at once by its queue (in one chunk, or chunks of two: workflow members,
    a nested one among them, in different chunks). Jobs, steps, workflows (counts,
    members' outcomes, the dependent waiting again for its replayed parent), callbacks
    and audit rows are the same, position by position, right after the action and once
    everything left has run."""
    one, bulk = _mix(backend, "one"), _mix(backend, "bulk")
    _chunk(monkeypatch, chunk)
    fresh = action == "replay"
    dead = [i for i in one.jobs if backend.job_get(i).state == "dead"]  # type: ignore[union-attr]
    for job_id in dead:
        params = ActionParams(actor="ops", ids=[job_id], reason="obsolete", fresh=fresh)
        assert _act(backend, action, params) == [job_id]
    every = ActionParams(
        actor="ops", all_matching=True, queue=bulk.queue, reason="obsolete", fresh=fresh
    )
    matched = _act(backend, action, every)
    assert matched == [bulk.jobs[one.jobs.index(i)] for i in sorted(dead)]  # in id order
    after = _snapshot(backend, one)
    assert _snapshot(backend, bulk) == after
    assert len(after["audit"]) == len(dead) == 6
    _run_what_is_left(backend, one)
    _run_what_is_left(backend, bulk)
    assert _snapshot(backend, bulk) == _snapshot(backend, one)


def _dead_in_bulk(backend: Backend, queue: str, names: list[str]) -> list[int]:
    """One dead job per name given, in ``queue``: inserted, claimed and finished dead a
    thousand at a time. Their ids, in order."""
    ids = [r.id for r in backend.job_insert_many([request(name=n, queue=queue) for n in names])]
    while rows := backend.job_claim(ClaimParams([QueueClaim(queue, 1000)], 1000, "w", 60.0)):
        outcomes = [FinishParams(r.id, r.lease_token or "", "dead", error=error()) for r in rows]
        assert all(backend.job_finish_many(outcomes))
    return ids


def test_a_bulk_replay_and_discard_of_5000_dead_jobs_do_each_job_once_with_its_audit_row(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """5,000 dead jobs, two job types: a discard of one type by name, then a replay of
    every dead job of the queue (with fresh), 1,000 jobs a chunk: each job changed once,
    attempts reset, its steps forgotten, one audit row each, in the order of the jobs."""
    _chunk(monkeypatch, 1000)
    names = ["bulk.a", "bulk.b"] * 2500
    ids = _dead_in_bulk(backend, "bulk", names)
    a_ids, b_ids = ids[0::2], ids[1::2]
    for job_id in a_ids[:3]:
        backend.step_store(job_id, "charge", '"done"', 1)
    preview = backend.job_replay(ActionParams(actor="ops", all_matching=True, dry_run=True))
    assert (preview.matched, preview.skipped) == (ids, {})
    discard = ActionParams(actor="ops", all_matching=True, name="bulk.b", reason="duplicates")
    assert backend.job_discard(discard).matched == b_ids
    replay = ActionParams(actor="ops", all_matching=True, queue="bulk", fresh=True)
    assert backend.job_replay(replay).matched == a_ids
    rows = {r.id: r for r in backend.job_get_many(ids)}
    assert {(rows[i].state, rows[i].attempt, rows[i].rescues) for i in a_ids} == {
        ("available", 0, 0)
    }
    assert {(rows[i].state, rows[i].discard_reason) for i in b_ids} == {("discarded", "duplicates")}
    assert all(backend.step_list(i) == [] for i in a_ids[:3])
    audit = backend.audit_list(limit=10_000)[::-1]  # oldest first
    assert [(e.action, e.job_id) for e in audit] == [("discard", i) for i in b_ids] + [
        ("replay", i) for i in a_ids
    ]
    assert Counter(json.dumps(e.detail, sort_keys=True) for e in audit) == {
        '{"reason": "duplicates"}': 2500,
        '{"fresh": true}': 2500,
    }
    again = backend.job_replay(ActionParams(actor="ops", all_matching=True, queue="bulk"))
    assert again.matched == []  # nothing dead is left


def test_a_bulk_action_given_ids_skips_those_not_dead_saying_why(backend: Backend) -> None:
    """Ids given: the dead ones are done, in the order given; the others are skipped with
    the reason a job-by-job action gave (no such job, its state)."""
    dead = _dead_in_bulk(backend, "bulk", ["bulk.a"] * 5)
    pending = backend.job_insert_many([request(queue="elsewhere")])[0].id
    given = [dead[3], pending, dead[1], 999_999, dead[3]]
    for dry_run in (True, False):
        result = backend.job_replay(ActionParams(actor="ops", ids=given, dry_run=dry_run))
        assert result.matched == [dead[3], dead[1]]
        assert result.skipped == {
            pending: "not in the dead-letter queue (state available)",
            999_999: "no such job",
        }
    assert [e.job_id for e in backend.audit_list()[::-1]] == [dead[3], dead[1]]


# -- statements ------------------------------------------------------------------------
def _statements(backend: Backend, harness: Harness, call: Callable[[], Any]) -> list[str]:
    """The statements ``call()`` sent to the store (transaction control left out)."""
    if harness.name == "postgres":
        from tests.postgres.counting import statements

        return statements(call)[1]
    sent: list[str] = []
    conn = backend._conn()  # type: ignore[attr-defined]  # this thread's: the call's
    conn.set_trace_callback(sent.append)
    try:
        call()
    finally:
        conn.set_trace_callback(None)
    control = ("BEGIN", "COMMIT", "ROLLBACK", "--")  # (a trigger's body starts "--")
    return [s for s in sent if not s.lstrip().upper().startswith(control)]


@pytest.mark.parametrize("action", ["replay", "discard"])
def test_a_bulk_action_sends_as_many_statements_for_1000_jobs_as_for_10(
    backend: Backend, harness: Harness, action: str
) -> None:
    """Set-based: the statements of an action over every dead job of a queue do not grow
    with the number of jobs (job by job, it was four more per job)."""
    _dead_in_bulk(backend, "few", ["bulk.a"] * 10)
    _dead_in_bulk(backend, "many", ["bulk.a"] * 1000)
    sent = {}
    for queue in ("few", "many"):
        params = ActionParams(actor="ops", all_matching=True, queue=queue, reason="r")
        sent[queue] = _statements(backend, harness, lambda p=params: _act(backend, action, p))
    assert len(sent["many"]) == len(sent["few"]) <= 8, sent["few"]


# -- the dry run -------------------------------------------------------------------------
def _probe(backend: Backend, harness: Harness) -> str | None:
    """From another connection: take SQLite's write lock, or lock every dead row on
    PostgreSQL, without waiting. None when it could; else what stopped it."""
    if harness.name == "postgres":
        import psycopg

        with psycopg.connect(backend.config.conninfo) as conn:  # type: ignore[attr-defined]
            try:
                conn.execute(
                    f'SELECT id FROM "{backend.schema}".errands_jobs '  # type: ignore[attr-defined]
                    "WHERE state = 'dead' FOR UPDATE NOWAIT"
                ).fetchall()
            except psycopg.errors.LockNotAvailable as exc:
                return str(exc)
            finally:
                conn.rollback()
        return None
    with contextlib.closing(
        sqlite3.connect(backend.path, timeout=0.1, isolation_level=None)  # type: ignore[attr-defined]
    ) as conn:
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            return str(exc)
        conn.execute("UPDATE errands_jobs SET priority = priority WHERE state = 'dead'")
        conn.execute("ROLLBACK")
    return None


@contextlib.contextmanager
def _probing_each_statement(
    backend: Backend, harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> Iterator[list[str | None]]:
    """Run :func:`_probe` after every statement the backend's admin runs (in its write
    transactions or its reads) while the block runs; each probe's answer."""
    answers: list[str | None] = []
    in_tx = TxRun.__call__
    read_rows = backend._read_rows  # type: ignore[attr-defined]

    def statement_then_probe(self: TxRun, query: str, params: Any = None) -> Any:
        cursor = in_tx(self, query, params)
        answers.append(_probe(backend, harness))  # the transaction is still open
        return cursor

    def read_then_probe(query: str, params: Any = None) -> Any:
        rows = read_rows(query, params)
        answers.append(_probe(backend, harness))
        return rows

    monkeypatch.setattr(TxRun, "__call__", statement_then_probe)
    monkeypatch.setattr(backend, "_read_rows", read_then_probe)
    yield answers
    monkeypatch.undo()


def test_a_dry_run_takes_no_write_lock_and_locks_no_row(
    backend: Backend, harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a dry run (by filter, or ids given; replay or discard) reads, another
    connection takes SQLite's write lock, or locks every dead row on PostgreSQL, at
    once. Before, the dry run ran in a write transaction: on SQLite no other writer got
    in until it ended (for 1,000,000 dead jobs, three minutes: every enqueue failed), on
    PostgreSQL every dead row was locked (FOR UPDATE) until it ended."""
    ids = _dead_in_bulk(backend, "bulk", ["bulk.a"] * 20)
    dry_runs = [
        ActionParams(actor="ops", all_matching=True, queue="bulk", dry_run=True),
        ActionParams(actor="ops", ids=ids, dry_run=True),
    ]
    with _probing_each_statement(backend, harness, monkeypatch) as answers:
        for params in dry_runs:
            assert backend.job_replay(params).matched == ids
            assert backend.job_discard(replace(params, reason="r")).matched == ids
    assert answers, "no statement was probed"
    assert [a for a in answers if a is not None] == []
    assert {r.state for r in backend.job_get_many(ids)} == {"dead"}
    assert backend.audit_list() == []


# -- failing part way -------------------------------------------------------------------
def _failing_audit(monkeypatch: pytest.MonkeyPatch, at: int) -> None:
    """The ``at``-th audit write of a bulk action (one per chunk) fails."""
    in_tx = TxRun.__call__
    calls = Counter[str]()

    def failing(self: TxRun, query: str, params: Any = None) -> Any:
        if query.startswith("audit_insert"):
            calls[query] += 1
            if calls[query] == at:
                raise RuntimeError("the audit write failed")
        return in_tx(self, query, params)

    monkeypatch.setattr(TxRun, "__call__", failing)


def test_a_bulk_replay_that_fails_in_its_first_chunk_changes_nothing(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The audit rows are written last, in the same transaction as the jobs' change:
    when that write fails, no job was replayed, no step forgotten, no member re-entered
    its workflow."""
    mix = _mix(backend, "bulk")
    before = _snapshot(backend, mix)
    _failing_audit(monkeypatch, at=1)
    every = ActionParams(actor="ops", all_matching=True, queue="bulk", fresh=True)
    with pytest.raises(RuntimeError, match="the audit write failed"):
        backend.job_replay(every)
    monkeypatch.undo()
    assert _snapshot(backend, mix) == before


def test_a_bulk_replay_failing_part_way_undoes_all_on_postgres_keeps_whole_chunks_on_sqlite(
    backend: Backend, harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of two, the second chunk's audit write fails. PostgreSQL runs every chunk
    in one transaction: nothing is left done. SQLite commits each chunk on its own: the
    first chunk's two jobs stay replayed, each with its audit row, and the rest stay
    dead. Either way the same action again does the rest, and the end state is the one a
    replay that never failed leaves (a second copy of the mix)."""
    mix, clean = _mix(backend, "bulk"), _mix(backend, "clean")
    before = _snapshot(backend, mix)
    _chunk(monkeypatch, 2)
    _failing_audit(monkeypatch, at=2)
    every = ActionParams(actor="ops", all_matching=True, queue="bulk", fresh=True)
    with pytest.raises(RuntimeError, match="the audit write failed"):
        backend.job_replay(every)
    monkeypatch.undo()
    dead = sorted(i for i, job in zip(mix.jobs, before["jobs"], strict=True) if job[1] == "dead")
    states = backend.job_states(dead)
    if harness.name == "sqlite":
        assert [states[i] for i in dead] == ["available"] * 2 + ["dead"] * 4
        assert sorted(e.job_id for e in backend.audit_list()) == dead[:2]
    else:
        assert _snapshot(backend, mix) == before
    _chunk(monkeypatch, 2)
    assert backend.job_replay(every).matched == (dead[2:] if harness.name == "sqlite" else dead)
    backend.job_replay(replace(every, queue="clean"))
    assert _snapshot(backend, mix) == _snapshot(backend, clean)
