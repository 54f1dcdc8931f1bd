"""An operator's write meets a worker's finish and a fan-in on real PostgreSQL locks.

A worker's finish locks its job's row, then (its fan-in) its workflows' rows; a fan-in
locks its workflows, then the dependents it releases. An operator's cancel and a DLQ
replay take their locks in the same orders (docs/workflows.md, "Guarantees"), so the two
windows where each side held one lock and waited for the other's are closed; a cycle left
(two operators, say) is broken by the server and the operator's transaction runs again.

Each test opens the window for sure: a third connection (``holder``) holds a workflow's
row while the two sides line up behind it, the operator first; the deadlock check of the
side that waited first has passed by the time the holder lets go (the server checks each
wait once, ``deadlock_timeout`` after it began), so a cycle formed then would be detected
by, and abort, the operator's transaction.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from errands.backends import Backend, open_backend
from errands.backends.base import ActionParams, FinishParams
from errands.backends.workflow_store import NodeSpec, WorkflowInserted, WorkflowSpec
from errands.errors import InvalidTransition
from tests.conformance.support import claim, error, finish, request

CALLBACKS = "callbacks"


@pytest.fixture
def backend(pg_url: str) -> Iterator[Backend]:
    store = open_backend(pg_url)
    store.migrate()
    try:
        yield store
    finally:
        store.close()


def batch(backend: Backend, n: int) -> WorkflowInserted:
    return backend.workflow_insert(
        WorkflowSpec(
            name="wf",
            kind="batch",
            nodes=[NodeSpec(f"m{i}", request(name=f"member.m{i}")) for i in range(n)],
            callbacks={
                e: request(name=f"callback.{e}", queue=CALLBACKS)
                for e in ("on_success", "on_settled", "on_dead")
            },
        )
    )


class Call(threading.Thread):
    """``fn()`` in a thread: its answer, or what it raised."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.answer: Any = None
        self.raised: BaseException | None = None

    def run(self) -> None:
        try:
            self.answer = self.fn()
        except BaseException as exc:  # handed to the test
            self.raised = exc

    def result(self) -> Any:
        self.join(60)
        assert not self.is_alive(), "the call is still blocked"
        if self.raised is not None:
            raise self.raised
        return self.answer


def lock_waits(backend: Backend) -> int:
    """How many sessions of this test's schema wait for a row lock."""
    schema: str = backend.schema  # type: ignore[attr-defined]
    with psycopg.connect(backend.config.conninfo, autocommit=True) as conn:  # type: ignore[attr-defined]
        [(n,)] = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND position(%s IN query) > 0",
            (f'"{schema}".',),
        ).fetchall()
    return int(n)


def wait_for(what: str, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 60.0
    while not done():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


def blocked_or_done(backend: Backend, waiting: int, *calls: Call) -> Callable[[], bool]:
    return lambda: lock_waits(backend) + sum(not c.is_alive() for c in calls) >= waiting


class Holder:
    """A connection of the test's own that holds one workflow's row (FOR UPDATE), or
    another table's row."""

    def __init__(self, backend: Backend, row_id: int, table: str = "errands_workflows") -> None:
        self.schema: str = backend.schema  # type: ignore[attr-defined]
        self.conn = psycopg.connect(backend.config.conninfo)  # type: ignore[attr-defined]
        self.conn.execute("SET deadlock_timeout = '30s'")  # never the side that detects
        self.conn.execute(
            f'SELECT id FROM "{self.schema}".{table} WHERE id = %s FOR UPDATE', (row_id,)
        )

    def let_go(self, after_checks: bool = True) -> None:
        if after_checks:
            time.sleep(1.5)  # the waits so far were each checked once (deadlock_timeout 1 s)
        self.conn.rollback()
        self.conn.close()


def callbacks(backend: Backend) -> list[str]:
    from errands.backends.base import ListParams

    rows = backend.job_list(ListParams(queue=CALLBACKS, limit=100))
    return sorted(r.name.removeprefix("callback.") for r in rows)


def test_an_operator_cancel_meeting_a_members_claim_and_finish_gets_an_answer_not_a_deadlock(
    backend: Backend,
) -> None:
    inserted = batch(backend, 1)
    [member] = inserted.jobs
    holder = Holder(backend, inserted.id)
    operator = Call(lambda: backend.job_cancel(member.id, "ops"))
    operator.start()
    wait_for("the operator waits", blocked_or_done(backend, 1, operator))

    def claim_and_finish() -> list[Any]:
        return [finish(backend, row, "completed") for row in claim(backend)]

    worker = Call(claim_and_finish)
    worker.start()
    wait_for("the worker waits or is done", blocked_or_done(backend, 2, operator, worker))
    holder.let_go()
    answer = operator.result()  # no DeadlockDetected, whichever side got there first
    assert answer.state == "cancelled" and worker.result() == []  # the claim skipped it
    status = backend.workflow_get(inserted.id)
    assert status is not None and (status.state, status.cancelled) == ("failed", 1)
    assert callbacks(backend) == ["on_settled"]


def test_a_dlq_replay_meeting_a_settling_fan_in_gets_an_answer_not_a_deadlock(
    backend: Backend,
) -> None:
    low, high = batch(backend, 2), batch(backend, 2)  # low.id < high.id
    rows = {r.id: r for r in claim(backend, limit=4)}
    for workflow in (low, high):
        assert finish(backend, rows[workflow.jobs[0].id], "dead", error=error())
    holder = Holder(backend, high.id)
    replay = ActionParams(actor="ops", ids=[high.jobs[0].id, low.jobs[0].id])
    operator = Call(lambda: backend.job_replay(replay))
    operator.start()
    wait_for("the operator waits", blocked_or_done(backend, 1, operator))
    last = [rows[w.jobs[1].id] for w in (low, high)]
    outcomes = [FinishParams(r.id, r.lease_token or "", "completed") for r in last]
    worker = Call(lambda: backend.job_finish_many(outcomes))  # fans in both batches
    worker.start()
    wait_for("the worker waits or is done", blocked_or_done(backend, 2, operator, worker))
    holder.let_go()
    assert operator.result().matched == replay.ids
    assert worker.result() == [True, True]
    for replayed in claim(backend, limit=4):
        assert finish(backend, replayed, "completed")
    for workflow in (low, high):
        status = backend.workflow_get(workflow.id)
        assert status is not None and (status.state, status.completed) == ("succeeded", 2)
    assert callbacks(backend) == ["on_dead"] * 2 + ["on_settled"] * 2 + ["on_success"] * 2


def test_a_cancel_the_server_aborts_to_break_a_lock_cycle_runs_again(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    inserted = batch(backend, 2)
    member = inserted.jobs[0]
    holder = Holder(backend, inserted.id)  # as a workflow cancel: the workflow, then members
    operator = Call(lambda: backend.job_cancel(member.id, "ops"))
    with caplog.at_level(logging.INFO, logger="errands.admin"):
        operator.start()  # locks the member, cancels it, then waits for the workflow
        wait_for("the operator waits", blocked_or_done(backend, 1, operator))

        def holder_takes_the_member() -> None:
            holder.conn.execute(
                f'SELECT id FROM "{holder.schema}".errands_jobs WHERE id = %s FOR UPDATE',
                (member.id,),
            )

        cycle = Call(holder_takes_the_member)
        cycle.start()  # each side now waits for the other: the operator's check aborts it
        cycle.result()  # the holder got the member: the operator's transaction rolled back
        holder.let_go(after_checks=False)
        answer = operator.result()
    assert (answer.previous_state, answer.state) == ("available", "cancelled")
    assert any("broke a lock cycle" in r.getMessage() for r in caplog.records)
    status = backend.workflow_get(inserted.id)
    assert status is not None and (status.cancelled, status.pending) == (1, 1)
    with pytest.raises(InvalidTransition):  # cancelled once: a second cancel is refused
        backend.job_cancel(member.id, "ops")


def nested_batch(backend: Backend, n: int) -> tuple[WorkflowInserted, WorkflowInserted]:
    """A workflow whose one member is a nested batch of ``n`` (outer.id < inner.id)."""
    inner = WorkflowSpec("inner", "batch", [NodeSpec(f"m{i}", request()) for i in range(n)])
    outer = backend.workflow_insert(
        WorkflowSpec("outer", "dag", [NodeSpec("inner", None, child=inner)])
    )
    [child] = outer.children.values()
    return outer, child


def test_a_member_adding_members_to_a_nested_batch_meets_a_siblings_finish_without_a_deadlock(
    backend: Backend,
) -> None:
    """Two members of a nested batch finish at once, the first adding members: the add
    moved the nested batch's count (locking its row) before the fan-in locked the outer
    workflow, against the id order (outer first) the sibling's fan-in takes: each then
    held one row and waited for the other's (DeadlockDetected, 9 in 300 rounds). The
    holder keeps the nested batch's row while the adder, then the sibling, line up."""
    outer, inner = nested_batch(backend, 2)
    adder, sibling = sorted(claim(backend, limit=2), key=lambda r: r.id)
    holder = Holder(backend, inner.id)
    adds = [request(name="member.added")]
    first = Call(lambda: backend.job_finish_many(
        [FinishParams(adder.id, adder.lease_token or "", "completed", workflow_adds=adds)]
    ))  # fmt: skip
    first.start()
    wait_for("the adder waits", blocked_or_done(backend, 1, first))
    second = Call(lambda: finish(backend, sibling, "completed"))
    second.start()
    wait_for("the sibling waits", blocked_or_done(backend, 2, first, second))
    holder.let_go(after_checks=False)
    assert first.result() == [True] and second.result() is True
    [added] = claim(backend)
    assert finish(backend, added, "completed")
    for workflow in (inner, outer):
        status = backend.workflow_get(workflow.id)
        assert status is not None and status.state == "succeeded"
    assert backend.workflow_get(inner.id).total == 3  # type: ignore[union-attr]


def test_a_batch_of_finishes_one_adding_members_locks_its_workflows_in_id_order(
    backend: Backend,
) -> None:
    """A worker's batch ends a member of a low and of a high workflow, the high one's
    adding members: the add locked the high workflow before the batch's fan-in locked
    the low one, while another batch ending members of both took them in id order."""
    low, high = batch(backend, 2), batch(backend, 2)  # low.id < high.id
    rows = {r.id: r for r in claim(backend, limit=4)}
    (l1, l2), (h1, h2) = ([rows[j.id] for j in w.jobs] for w in (low, high))
    holder = Holder(backend, low.id)
    plain = [FinishParams(r.id, r.lease_token or "", "completed") for r in (l1, h1)]
    other = Call(lambda: backend.job_finish_many(plain))
    other.start()
    wait_for("the other batch waits", blocked_or_done(backend, 1, other))
    adds = [request(name="member.added")]
    adding = [
        FinishParams(h2.id, h2.lease_token or "", "completed", workflow_adds=adds),
        FinishParams(l2.id, l2.lease_token or "", "completed"),
    ]
    adder = Call(lambda: backend.job_finish_many(adding))
    adder.start()
    wait_for("the adding batch waits", blocked_or_done(backend, 2, other, adder))
    holder.let_go(after_checks=False)
    assert other.result() == [True, True] and adder.result() == [True, True]
    [added] = claim(backend)
    assert finish(backend, added, "completed")
    for workflow, total in ((low, 2), (high, 3)):
        status = backend.workflow_get(workflow.id)
        assert status is not None and (status.state, status.total) == ("succeeded", total)


def test_a_prune_meeting_a_dlq_replay_of_a_member_keeps_the_workflow_and_its_pending_row(
    backend: Backend,
) -> None:
    """A replay locks the workflow, then makes its dead member pending again; the prune
    took no workflow lock: it deleted the members, edges and pending rows it saw, then
    waited for the workflow's row, which the replay held while it waited for the member
    row the prune had deleted: DeadlockDetected (had the replay not touched that row,
    it committed a pending row for a workflow gone). The prune now locks the tree and
    asks again: the workflow is kept, and settles once the replay completes. The holder
    keeps the dead member's job row: the replay waits there holding the workflow's, and
    the prune lines up behind it."""
    inserted = batch(backend, 1)
    [member] = inserted.jobs
    [row] = claim(backend)
    assert finish(backend, row, "dead", error=error())
    holder = Holder(backend, member.id, "errands_jobs")
    replay = Call(lambda: backend.job_replay(ActionParams(actor="ops", ids=[member.id])))
    replay.start()
    wait_for("the replay waits", blocked_or_done(backend, 1, replay))
    prune = Call(lambda: backend.workflow_prune(-1.0, 100))
    prune.start()
    wait_for("the prune waits", blocked_or_done(backend, 2, replay, prune))
    holder.let_go(after_checks=False)
    assert replay.result().matched == [member.id]
    assert prune.result() == 0
    status = backend.workflow_get(inserted.id)
    assert status is not None and (status.state, status.pending) == ("failed", 1)
    [again] = claim(backend)
    assert finish(backend, again, "completed")
    assert callbacks(backend) == ["on_dead", "on_settled", "on_success"]
    assert backend.workflow_prune(-1.0, 100) == 0  # its callbacks are yet to run
    for callback in claim(backend, CALLBACKS, 10):
        assert finish(backend, callback, "completed")
    assert backend.workflow_prune(-1.0, 100) == 1


def test_a_replay_reopening_a_nested_workflow_as_its_outer_one_is_cancelled_is_cancelled_too(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay re-opens a failed nested batch (its member pending again) while the outer
    workflow's cancel is requested: the request waited for the replay's lock on the outer
    workflow, then flagged the tree as it read it before the wait, the nested batch still
    settled: unflagged. Its replayed member, claimed and completed before the cancel got to
    the nested batch, turned it succeeded and fired its on_success inside the cancelled
    workflow. The request reads the tree once it holds the outer workflow's lock: the
    nested batch is flagged, and settles cancelled again, with no on_success. The holder
    keeps the dead member's job row: the replay waits there holding the workflows', and
    the cancel lines up behind it."""
    inner = WorkflowSpec(
        "inner", "batch", [NodeSpec("m", request(name="member.m"))],
        callbacks={"on_success": request(name="callback.inner.on_success", queue=CALLBACKS)},
    )  # fmt: skip
    outer = backend.workflow_insert(
        WorkflowSpec("outer", "dag", [NodeSpec("job", request(name="member.job")),
                                      NodeSpec("inner", None, child=inner)])
    )  # fmt: skip
    [nested] = outer.children.values()
    rows = {r.name: r for r in claim(backend, limit=2)}
    member = rows["member.m"]
    assert finish(backend, member, "dead", error=error())  # the nested batch settles failed
    holder = Holder(backend, member.id, "errands_jobs")
    replay = Call(lambda: backend.job_replay(ActionParams(actor="ops", ids=[member.id])))
    replay.start()
    wait_for("the replay waits", blocked_or_done(backend, 1, replay))
    workflows = backend.workflows  # type: ignore[attr-defined]
    nested_pending = workflows.nested_pending

    def replayed_member_completes(workflow_id: int) -> Any:
        if workflow_id == outer.id:  # the request committed; the members are next
            [again] = claim(backend)
            assert finish(backend, again, "completed")
        return (yield from nested_pending(workflow_id))

    monkeypatch.setattr(workflows, "nested_pending", replayed_member_completes)
    cancel = Call(lambda: backend.workflow_cancel(outer.id, "ops"))
    cancel.start()
    wait_for("the cancel waits", blocked_or_done(backend, 2, replay, cancel))
    holder.let_go(after_checks=False)
    assert replay.result().matched == [member.id]  # it came first: replayed
    cancel.result()
    status = backend.workflow_get(nested.id)
    assert status is not None and (status.state, status.completed) == ("cancelled", 1)
    assert finish(backend, rows["member.job"], "completed")  # completed anyway
    status = backend.workflow_get(outer.id)
    assert status is not None and (status.state, status.cancelled) == ("cancelled", 1)
    assert callbacks(backend) == []  # no on_success
