"""Workflows in the store: the fan-in set, dependents and callbacks, on every backend.

Each callback must be inserted exactly once, never early, whatever delivers a member's
end (a finish, a duplicate of it, a stale attempt, a rescue, an operator's cancel or a
replay); dependents stay out of every claim until their last parent ends.
"""

from __future__ import annotations

from typing import Any

import pytest

from errands.backends import Backend, base
from errands.backends.base import ActionParams, FinishParams, LeaseRef, RescueParams
from errands.backends.workflow_store import NodeSpec, WorkflowInserted, WorkflowSpec
from errands.errors import CancelIncomplete, ConfigurationError
from errands.jobs import EnqueueRequest, JobRow

from .conftest import Harness
from .support import QUEUE, claim, claim_one, error, errors_of, finish, get, request

CALLBACKS = "callbacks"  # the queue callbacks go to: never claimed by the member claims
EVENTS = ("on_success", "on_settled", "on_dead")


def spec(
    nodes: list[tuple[str, list[tuple[int, str]]]],
    *,
    kind: str = "dag",
    events: tuple[str, ...] = EVENTS,
) -> WorkflowSpec:
    """A workflow of ``(node, [(parent index, policy), ...])``, every member in QUEUE."""
    return WorkflowSpec(
        name="wf",
        kind=kind,
        nodes=[
            NodeSpec(
                node=node,
                request=request(name=f"member.{node}", args_json=f'{{"node": "{node}"}}'),
                after=tuple(p for p, _ in parents),
                policies=tuple(policy for _, policy in parents),
            )
            for node, parents in nodes
        ],
        callbacks={e: request(name=f"callback.{e}", queue=CALLBACKS) for e in events},
    )


def batch(n: int, **kwargs: Any) -> WorkflowSpec:
    return spec([(f"m{i}", []) for i in range(n)], kind="batch", **kwargs)


def callbacks(backend: Backend) -> list[str]:
    """The callback jobs inserted so far, by event name, in id order."""
    rows = backend.job_list(_list(CALLBACKS))
    return sorted((r.name.removeprefix("callback.") for r in rows), key=str)


def _list(queue: str) -> Any:
    from errands.backends.base import ListParams

    return ListParams(queue=queue, limit=1000)


def claim_all(backend: Backend) -> list[JobRow]:
    return claim(backend, QUEUE, 100)


def test_a_batch_fires_on_success_and_on_settled_once_when_its_last_member_completes(
    backend: Backend,
) -> None:
    inserted = backend.workflow_insert(batch(3))
    rows = claim_all(backend)
    assert {r.id for r in rows} == {j.id for j in inserted.jobs}
    for row in rows[:-1]:
        assert finish(backend, row, "completed", result_json="1")
        assert callbacks(backend) == []  # never early
    assert finish(backend, rows[-1], "completed", result_json="1")
    assert callbacks(backend) == ["on_settled", "on_success"]
    status = backend.workflow_get(inserted.id)
    assert status is not None
    assert (status.state, status.total, status.completed, status.pending) == ("succeeded", 3, 3, 0)
    assert status.on_success_job is not None and status.on_settled_job is not None


def test_a_duplicate_delivery_of_the_last_outcome_changes_nothing(backend: Backend) -> None:
    backend.workflow_insert(batch(2))
    first, last = claim_all(backend)
    assert finish(backend, first, "completed")
    outcome = FinishParams(id=last.id, lease_token=last.lease_token or "", state="completed")
    assert backend.job_finish_many([outcome, outcome])[0]  # the same outcome twice in a batch
    assert backend.job_finish_many([outcome]) == [False]
    assert callbacks(backend) == ["on_settled", "on_success"]


def test_a_stale_attempt_neither_counts_nor_fires(backend: Backend, harness: Harness) -> None:
    inserted = backend.workflow_insert(batch(1))
    stale = claim_one(backend)
    harness.expire_lease(backend, stale.id)
    rescue = RescueParams(stale.id, stale.lease_token or "", "retryable", error(), 0.0)
    assert backend.job_rescue_many([rescue]) == [True]
    assert callbacks(backend) == []  # a retry is not an end
    current = claim_one(backend, suspects=True)
    assert not finish(backend, stale, "completed")
    assert callbacks(backend) == []
    status = backend.workflow_get(inserted.id)
    assert status is not None and status.completed == 0 and status.pending == 1
    assert finish(backend, current, "completed")
    assert callbacks(backend) == ["on_settled", "on_success"]


def test_a_rescue_to_dead_settles_the_batch_failed_and_fires_on_dead_once(
    backend: Backend, harness: Harness
) -> None:
    inserted = backend.workflow_insert(batch(2))
    lost, other = claim_all(backend)
    harness.expire_lease(backend, lost.id)
    rescue = RescueParams(lost.id, lost.lease_token or "", "dead", error(), 0.0)
    assert backend.job_rescue_many([rescue]) == [True]
    assert callbacks(backend) == ["on_dead"]
    assert finish(backend, other, "dead", error=error())
    assert callbacks(backend) == ["on_dead", "on_settled"]  # on_dead once; no on_success
    status = backend.workflow_get(inserted.id)
    assert status is not None and (status.state, status.dead) == ("failed", 2)


def test_a_chain_keeps_each_dependent_out_of_every_claim_until_its_parent_completes(
    backend: Backend,
) -> None:
    inserted = backend.workflow_insert(
        spec([("a", []), ("b", [(0, "cancel")]), ("c", [(1, "cancel")])])
    )
    a, b, c = (j.id for j in inserted.jobs)
    assert get(backend, b).state == "waiting" and get(backend, c).state == "waiting"
    row = claim_one(backend)
    assert row.id == a and claim_all(backend) == []
    assert finish(backend, row, "completed", result_json='"A"')
    row = claim_one(backend)
    assert row.id == b and claim_all(backend) == []
    assert finish(backend, row, "completed", result_json='"B"')
    row = claim_one(backend)
    assert row.id == c
    [parent] = backend.workflow_parent_results(c)
    assert (parent.job_id, parent.node, parent.state, parent.result_json) == (
        b,
        "b",
        "completed",
        '"B"',
    )
    assert finish(backend, row, "completed")
    assert callbacks(backend) == ["on_settled", "on_success"]


def test_a_dependents_own_delay_counts_from_its_release_not_its_insert(
    backend: Backend, harness: Harness
) -> None:
    later = backend.db_now() + 3600.0
    nodes = [
        NodeSpec("a", request(name="member.a")),
        NodeSpec("delayed", request(name="member.delayed", delay=60.0), (0,), ("cancel",)),
        NodeSpec("at", request(name="member.at", run_at=later), (0,), ("cancel",)),
        NodeSpec("past", request(name="member.past", run_at=1.0), (0,), ("cancel",)),
    ]
    inserted = backend.workflow_insert(WorkflowSpec("wf", "dag", nodes))
    delayed, at, past = (j.id for j in inserted.jobs[1:])
    harness.backdate_run_at(backend, delayed, 120.0)  # its insert-time delay long passed
    a = claim_one(backend)
    released = backend.db_now()
    assert finish(backend, a, "completed")
    assert claim_one(backend).id == past  # a run_at already past: at once
    row = get(backend, delayed)
    assert row.state == "scheduled" and row.run_at >= released + 59.0
    row = get(backend, at)
    assert row.state == "scheduled" and abs(row.run_at - later) < 1.0
    assert claim_all(backend) == []
    harness.backdate_run_at(backend, delayed, 0.0)  # its delay after the release passed
    assert claim_one(backend).id == delayed


def test_a_failed_parent_cancels_skips_or_runs_its_dependents_by_edge_policy(
    backend: Backend,
) -> None:
    inserted = backend.workflow_insert(
        spec(
            [
                ("root", []),
                ("cancelled", [(0, "cancel")]),
                ("anyway", [(0, "run_anyway")]),
                ("skipped", [(0, "skip")]),
                ("after_cancelled", [(1, "cancel")]),
                ("after_skipped", [(3, "cancel")]),
            ]
        )
    )
    ids = [j.id for j in inserted.jobs]
    root = claim_one(backend)
    assert finish(backend, root, "dead", error=error())
    states = {i: get(backend, i).state for i in ids}
    assert states[ids[1]] == "cancelled" and states[ids[4]] == "cancelled"  # cascades
    assert states[ids[3]] == "cancelled"  # skipped: it never runs ...
    assert {r.id for r in claim_all(backend)} == {ids[2], ids[5]}  # ... its dependent does
    members = {m.node: m.outcome for m in backend.workflow_members(inserted.id)}
    assert members["skipped"] == "skipped" and members["cancelled"] == "cancelled"
    [parent] = backend.workflow_parent_results(ids[2])
    assert parent.state == "dead"


def test_a_diamond_fans_in_once_when_both_branches_complete(backend: Backend) -> None:
    inserted = backend.workflow_insert(
        spec([("a", []), ("b", [(0, "cancel")]), ("c", [(0, "cancel")]),
              ("d", [(1, "cancel"), (2, "cancel")])])
    )  # fmt: skip
    d = inserted.jobs[3].id
    assert finish(backend, claim_one(backend), "completed")
    b, c = claim_all(backend)
    assert finish(backend, b, "completed")
    assert get(backend, d).state == "waiting"
    assert finish(backend, c, "completed")
    assert claim_one(backend).id == d
    assert [p.node for p in backend.workflow_parent_results(d)] == ["b", "c"]
    assert [p.node for p in backend.workflow_parent_results(d, limit=1)] == ["b"]
    assert [p.node for p in backend.workflow_parent_results(d, after=b.id)] == ["c"]


def test_a_wide_fan_out_is_released_by_its_roots_end_and_fans_in_once_in_one_write(
    backend: Backend,
) -> None:
    width = 30
    inserted = backend.workflow_insert(
        spec(
            [("root", []), *((f"m{i}", [(0, "cancel")]) for i in range(width)),
             ("last", [(i + 1, "cancel") for i in range(width)])]
        )
    )  # fmt: skip
    ids = [j.id for j in inserted.jobs]
    assert finish(backend, claim_one(backend), "completed")
    middle = claim(backend, QUEUE, 100)
    assert sorted(r.id for r in middle) == ids[1:-1]  # all released with the root's end
    assert get(backend, ids[-1]).state == "waiting"

    def done(rows: list[JobRow]) -> list[FinishParams]:
        return [FinishParams(id=r.id, lease_token=r.lease_token or "", state="completed")
                for r in rows]  # fmt: skip

    assert backend.job_finish_many(done(middle[:-1])) == [True] * (width - 1)
    assert get(backend, ids[-1]).state == "waiting"  # one parent still to end
    assert claim_all(backend) == []
    # the last parent, delivered twice in one write and once more after: released once
    assert backend.job_finish_many(done(middle[-1:] * 2))[0]
    assert backend.job_finish_many(done(middle[-1:])) == [False]
    last = claim_one(backend)
    assert last.id == ids[-1] and claim_all(backend) == []
    assert len(backend.workflow_parent_results(last.id, limit=100)) == width
    status = backend.workflow_get(inserted.id)
    assert status is not None and (status.completed, status.pending) == (width + 1, 1)
    assert finish(backend, last, "completed")
    assert callbacks(backend) == ["on_settled", "on_success"]


def test_parents_ending_in_one_write_decide_each_shared_dependent_once_by_its_policies(
    backend: Backend,
) -> None:
    inserted = backend.workflow_insert(
        spec(
            [
                ("a", []),
                ("b", []),
                ("both", [(0, "cancel"), (1, "cancel")]),
                ("anyway", [(0, "run_anyway"), (1, "run_anyway")]),
                ("skipped", [(0, "skip"), (1, "cancel")]),
                ("after_skipped", [(4, "cancel")]),
            ]
        )
    )
    ids = [j.id for j in inserted.jobs]
    a, b = sorted(claim_all(backend), key=lambda r: r.id)
    outcomes = [
        FinishParams(id=a.id, lease_token=a.lease_token or "", state="dead", error=error()),
        FinishParams(id=b.id, lease_token=b.lease_token or "", state="completed"),
    ]
    assert backend.job_finish_many(outcomes) == [True, True]
    assert get(backend, ids[2]).state == "cancelled" and get(backend, ids[4]).state == "cancelled"
    assert {r.id for r in claim_all(backend)} == {ids[3], ids[5]}
    members = {m.node: m.outcome for m in backend.workflow_members(inserted.id)}
    assert (members["both"], members["skipped"]) == ("cancelled", "skipped")
    status = backend.workflow_get(inserted.id)
    assert status is not None
    assert (status.completed, status.dead, status.cancelled, status.skipped, status.pending) == (
        1, 1, 1, 1, 2,
    )  # fmt: skip
    assert callbacks(backend) == ["on_dead"]
    [why] = [e["message"] for e in errors_of(get(backend, ids[2]))]
    assert why == f"parent job {a.id} failed (policy cancel)"


def test_a_finish_tells_its_thread_which_queues_its_fan_in_released_jobs_into(
    backend: Backend,
) -> None:
    backend.workflow_insert(spec([("a", []), ("b", [(0, "cancel")]), ("c", [(1, "cancel")])]))
    backend.workflow_take_released()
    assert finish(backend, claim_one(backend), "completed")
    assert backend.workflow_take_released() == {QUEUE}  # b released: its worker claims now
    assert backend.workflow_take_released() == set()  # read once
    b = claim_one(backend)
    assert finish(backend, b, "completed")
    assert backend.workflow_take_released() == {QUEUE}
    assert finish(backend, claim_one(backend), "completed")  # c: the callbacks, no dependent
    assert backend.workflow_take_released() == {CALLBACKS}
    assert not finish(backend, b, "completed")  # a stale duplicate releases nothing
    assert backend.workflow_take_released() == set()


def test_replaying_a_dead_member_of_a_settled_batch_fires_on_success_once_it_completes(
    backend: Backend,
) -> None:
    inserted = backend.workflow_insert(batch(2))
    dead, ok = claim_all(backend)
    assert finish(backend, dead, "dead", error=error())
    assert finish(backend, ok, "completed")
    assert callbacks(backend) == ["on_dead", "on_settled"]
    replay = ActionParams(actor="test", ids=[dead.id])
    assert backend.job_replay(replay).matched == [dead.id]
    status = backend.workflow_get(inserted.id)
    assert status is not None and (status.state, status.dead, status.pending) == ("failed", 0, 1)
    assert finish(backend, claim_one(backend), "completed")
    assert callbacks(backend) == ["on_dead", "on_settled", "on_success"]  # each once
    status = backend.workflow_get(inserted.id)
    assert status is not None and (status.state, status.completed) == ("succeeded", 2)


def test_replaying_a_member_before_the_batch_settles_keeps_it_in_the_fan_in(
    backend: Backend,
) -> None:
    backend.workflow_insert(batch(2))
    dead, other = claim_all(backend)
    assert finish(backend, dead, "dead", error=error())
    backend.job_replay(ActionParams(actor="test", ids=[dead.id]))
    assert finish(backend, other, "completed")
    assert callbacks(backend) == ["on_dead"]  # the replayed member is pending again
    assert finish(backend, claim_one(backend), "completed")
    assert callbacks(backend) == ["on_dead", "on_settled", "on_success"]


@pytest.mark.parametrize("policy", ["cancel", "run_anyway", "skip"])
def test_a_dependent_still_waiting_waits_for_a_replayed_parent_and_runs_once_it_completes(
    backend: Backend, policy: str
) -> None:
    """A and B, then C after both. A dies while B still runs; A is replayed and completes,
    then B completes: C runs (the edge from A waited for A's new end), and on_success
    fires. Before, the edge kept A's first end ('dead'): C was cancelled (or, under
    run_anyway, released while A's replay still ran) and on_success never fired."""
    inserted = backend.workflow_insert(
        spec([("a", []), ("b", []), ("c", [(0, policy), (1, policy)])])
    )
    a_id, _, c_id = (j.id for j in inserted.jobs)
    a, b = sorted(claim_all(backend), key=lambda r: r.id)
    assert finish(backend, a, "dead", error=error())
    assert backend.job_replay(ActionParams(actor="test", ids=[a_id])).matched == [a_id]
    assert get(backend, c_id).state == "waiting"
    assert finish(backend, b, "completed")
    assert get(backend, c_id).state == "waiting"  # A's replay has not ended yet
    [again] = claim_all(backend)
    assert again.id == a_id
    assert finish(backend, again, "completed")
    [c] = claim_all(backend)
    assert c.id == c_id
    assert finish(backend, c, "completed")
    status = backend.workflow_get(inserted.id)
    assert status is not None
    assert (status.state, status.completed, status.dead) == ("succeeded", 3, 0)
    assert callbacks(backend) == ["on_dead", "on_settled", "on_success"]  # each once


def test_a_dependent_decided_before_the_replay_keeps_its_decision(backend: Backend) -> None:
    """A dies with C's other parent B already completed: C is cancelled then (policy
    cancel). Replaying A afterwards revives nothing: C stays cancelled."""
    inserted = backend.workflow_insert(
        spec([("a", []), ("b", []), ("c", [(0, "cancel"), (1, "cancel")])])
    )
    a_id, _, c_id = (j.id for j in inserted.jobs)
    a, b = sorted(claim_all(backend), key=lambda r: r.id)
    assert finish(backend, b, "completed")
    assert finish(backend, a, "dead", error=error())
    assert get(backend, c_id).state == "cancelled"
    backend.job_replay(ActionParams(actor="test", ids=[a_id]))
    assert finish(backend, claim_one(backend), "completed")
    assert get(backend, c_id).state == "cancelled"
    assert claim_all(backend) == []


def test_cancelling_a_pending_member_fans_in(backend: Backend) -> None:
    inserted = backend.workflow_insert(spec([("a", []), ("b", [(0, "cancel")])]))
    a, b = (j.id for j in inserted.jobs)
    backend.job_cancel(a, "test")
    assert get(backend, b).state == "cancelled"
    assert callbacks(backend) == ["on_settled"]
    status = backend.workflow_get(inserted.id)
    assert status is not None and (status.state, status.cancelled) == ("failed", 2)


def test_cancelling_a_workflow_cancels_pending_members_and_stops_running_ones(
    backend: Backend,
) -> None:
    inserted = backend.workflow_insert(spec([("a", []), ("b", []), ("c", [(0, "run_anyway")])]))
    running = claim(backend, QUEUE, 1)[0]
    assert backend.workflow_cancel(inserted.id, "test") == 2  # b, and c waiting
    assert get(backend, running.id).cancel_requested
    assert callbacks(backend) == []  # a is still running
    assert finish(backend, running, "completed")
    status = backend.workflow_get(inserted.id)
    assert status is not None and status.state == "cancelled"
    assert callbacks(backend) == ["on_settled"]


def test_a_workflow_cancel_that_fails_after_its_request_is_audited_and_finishes_when_repeated(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request (the workflow flagged cancelled: it settles so) and its audit row were
    separate transactions, the audit row written two steps later: a connection lost in
    between left a cancelled workflow that no audit row explained, and the caller a raw
    driver error. The request is audited with it; what failed after says the cancel was
    requested and may be partly applied, and the same cancel run again finishes it."""
    inserted = backend.workflow_insert(spec([("a", []), ("b", [(0, "run_anyway")])]))
    workflows = backend.workflows  # type: ignore[attr-defined]

    def lost(workflow_id: int) -> Any:
        raise ConnectionError("server closed the connection unexpectedly (injected)")

    monkeypatch.setattr(workflows, "cancel_running", lost)
    with pytest.raises(CancelIncomplete, match=r"cancel was requested.*Run the cancel again"):
        backend.workflow_cancel(inserted.id, "ops")
    [event] = backend.audit_list()
    assert (event.action, event.actor, event.detail) == (
        "workflow_cancel", "ops", {"workflow": inserted.id},
    )  # fmt: skip
    status = backend.workflow_get(inserted.id)
    assert status is not None and status.cancel_requested and status.pending == 2

    monkeypatch.undo()
    assert backend.workflow_cancel(inserted.id, "ops") == 2  # a, and b waiting
    status = backend.workflow_get(inserted.id)
    assert status is not None and (status.state, status.cancelled) == ("cancelled", 2)
    assert callbacks(backend) == ["on_settled"]
    assert backend.workflow_cancel(inserted.id, "ops") == 0  # nothing left: no error
    assert [e.action for e in backend.audit_list()] == ["workflow_cancel"] * 3


def complete_adding(backend: Backend, row: JobRow, added: list[EnqueueRequest]) -> bool:
    """Complete ``row``, adding the members ``added`` to its workflow; whether it landed."""
    outcome = FinishParams(row.id, row.lease_token or "", "completed", workflow_adds=added)
    [landed] = backend.job_finish_many([outcome])
    return landed


def test_members_a_member_adds_keep_the_batch_open_until_they_end(backend: Backend) -> None:
    inserted = backend.workflow_insert(batch(1))
    adder = claim_one(backend)
    added = [request(name="member.added") for _ in range(2)]
    assert complete_adding(backend, adder, added)
    assert callbacks(backend) == []
    status = backend.workflow_get(inserted.id)
    assert status is not None and (status.total, status.pending) == (3, 2)
    for row in claim_all(backend):
        assert get(backend, row.id).meta.count('"workflow"') == 1
        assert finish(backend, row, "completed")
    assert callbacks(backend) == ["on_settled", "on_success"]


def test_a_retry_of_a_member_keeps_it_pending(backend: Backend, harness: Harness) -> None:
    inserted = backend.workflow_insert(batch(1))
    row = claim_one(backend)
    assert finish(backend, row, "retryable", error=error(), delay=0.0)
    status = backend.workflow_get(inserted.id)
    assert status is not None and status.pending == 1 and callbacks(backend) == []


def test_listing_workflows_newest_first_with_counts(backend: Backend) -> None:
    first = backend.workflow_insert(batch(1)).id
    second = backend.workflow_insert(batch(2)).id
    assert [w.id for w in backend.workflow_list()] == [second, first]
    assert [w.id for w in backend.workflow_list(before_id=second)] == [first]
    assert [w.id for w in backend.workflow_list(state="succeeded")] == []
    assert [m.node for m in backend.workflow_members(second)] == ["m0", "m1"]


def nested(
    inner: WorkflowSpec, *, after_it: bool = False, events: tuple[str, ...] = ("on_success",)
) -> WorkflowSpec:
    """A workflow of one job, the nested ``inner``, and (``after_it``) a job after it."""
    nodes = [
        NodeSpec(node="job", request=request(name="member.job")),
        NodeSpec(node="inner", request=None, child=inner),
    ]
    if after_it:
        nodes.append(
            NodeSpec("after", request(name="member.after"), after=(1,), policies=("cancel",))
        )
    callbacks = {e: request(name=f"callback.outer.{e}", queue=CALLBACKS) for e in events}
    return WorkflowSpec(name="outer", kind="dag", nodes=nodes, callbacks=callbacks)


def test_a_nested_batch_settles_with_its_callbacks_before_its_parent_settles(
    backend: Backend,
) -> None:
    inserted = backend.workflow_insert(nested(batch(2, events=("on_settled",))))
    [inner] = inserted.children.values()
    assert len(inserted.jobs) == 1 and len(inner.jobs) == 2
    rows = claim_all(backend)
    assert len(rows) == 3
    for row in rows:
        assert finish(backend, row, "completed")
    assert callbacks(backend) == ["on_settled", "outer.on_success"]
    [first, second] = backend.job_list(_list(CALLBACKS))[::-1]
    assert (first.name, second.name) == ("callback.on_settled", "callback.outer.on_success")
    outer = backend.workflow_get(inserted.id)
    assert outer is not None and (outer.state, outer.total, outer.completed) == ("succeeded", 2, 2)
    members = {m.node: m for m in backend.workflow_members(inserted.id)}
    assert members["inner"].job_id == -inner.id and members["inner"].outcome == "completed"


def _outer_and_inner(backend: Backend, outer_job: int) -> tuple[JobRow, JobRow]:
    """The claimed outer job member and the nested workflow's one member."""
    rows = claim_all(backend)
    [outer] = [r for r in rows if r.id == outer_job]
    [inner] = [r for r in rows if r.id != outer_job]
    return outer, inner


def test_a_node_after_a_nested_workflow_waits_for_it_to_settle(backend: Backend) -> None:
    inserted = backend.workflow_insert(nested(batch(1, events=()), after_it=True))
    after = inserted.jobs[1].id
    job, inner_member = _outer_and_inner(backend, inserted.jobs[0].id)
    assert finish(backend, job, "completed")
    assert get(backend, after).state == "waiting"
    assert finish(backend, inner_member, "completed")
    assert claim_one(backend).id == after
    [parent] = backend.workflow_parent_results(after)
    assert (parent.node, parent.state) == ("inner", "completed")


def test_a_failed_nested_workflow_is_a_dead_member_of_its_parent(backend: Backend) -> None:
    inserted = backend.workflow_insert(nested(batch(1, events=()), after_it=True, events=EVENTS))
    after = inserted.jobs[1].id
    job, inner_member = _outer_and_inner(backend, inserted.jobs[0].id)
    assert finish(backend, inner_member, "dead", error=error())
    assert get(backend, after).state == "cancelled"  # policy cancel, on the nested node
    assert callbacks(backend) == ["outer.on_dead"]
    assert finish(backend, job, "completed")
    outer = backend.workflow_get(inserted.id)
    assert outer is not None and (outer.state, outer.dead, outer.cancelled) == ("failed", 1, 1)
    assert callbacks(backend) == ["outer.on_dead", "outer.on_settled"]


def _replay(backend: Backend, job_id: int) -> None:
    assert backend.job_replay(ActionParams(actor="test", ids=[job_id])).matched == [job_id]


def _state(backend: Backend, workflow_id: int) -> tuple[str, int, int, int]:
    row = backend.workflow_get(workflow_id)
    assert row is not None
    return (row.state, row.completed, row.dead, row.pending)


def _nested_member_dead(
    backend: Backend,
) -> tuple[WorkflowInserted, WorkflowInserted, JobRow, JobRow]:
    """A workflow of a job and a nested batch of one member, claimed; that member dead.
    The workflow, the nested one, the job's claimed row, the nested member's."""
    inserted = backend.workflow_insert(nested(batch(1), events=EVENTS))
    [inner] = inserted.children.values()
    job, inner_member = _outer_and_inner(backend, inserted.jobs[0].id)
    assert finish(backend, inner_member, "dead", error=error())
    return inserted, inner, job, inner_member


def test_a_failed_nested_batch_whose_replayed_member_completes_turns_its_parent_succeeded(
    backend: Backend,
) -> None:
    inserted, inner, job, inner_member = _nested_member_dead(backend)
    assert finish(backend, job, "completed")
    assert _state(backend, inserted.id) == ("failed", 1, 1, 0)
    fired = ["on_dead", "on_settled", "outer.on_dead", "outer.on_settled"]
    assert callbacks(backend) == fired
    _replay(backend, inner_member.id)  # the nested batch is pending in its parent again
    assert _state(backend, inner.id) == ("failed", 0, 0, 1)
    assert _state(backend, inserted.id) == ("failed", 1, 0, 1)
    assert finish(backend, claim_one(backend), "completed")
    assert _state(backend, inner.id) == ("succeeded", 1, 0, 0)
    assert _state(backend, inserted.id) == ("succeeded", 2, 0, 0)
    assert callbacks(backend) == sorted([*fired, "on_success", "outer.on_success"])  # once each
    last_two = [r.name for r in backend.job_list(_list(CALLBACKS))[:2]]
    assert last_two == ["callback.outer.on_success", "callback.on_success"]  # child first
    members = {m.node: m.outcome for m in backend.workflow_members(inserted.id)}
    assert members == {"job": "completed", "inner": "completed"}


def test_a_replayed_member_of_a_nested_batch_that_dies_again_ends_it_dead_in_its_parent_again(
    backend: Backend,
) -> None:
    inserted, inner, job, inner_member = _nested_member_dead(backend)
    _replay(backend, inner_member.id)  # before the parent settled: it waits for it again
    assert _state(backend, inserted.id) == ("running", 0, 0, 2)
    assert finish(backend, claim_one(backend), "dead", error=error())
    assert _state(backend, inner.id) == ("failed", 0, 1, 0)
    assert _state(backend, inserted.id) == ("running", 0, 1, 1)
    assert finish(backend, job, "completed")
    assert _state(backend, inserted.id) == ("failed", 1, 1, 0)
    assert callbacks(backend) == ["on_dead", "on_settled", "outer.on_dead", "outer.on_settled"]


def test_cancelling_a_workflow_cancels_its_nested_workflows(backend: Backend) -> None:
    inserted = backend.workflow_insert(nested(batch(2, events=()), events=("on_settled",)))
    [inner] = inserted.children.values()
    assert backend.workflow_cancel(inserted.id, "test") == 3
    assert backend.workflow_get(inner.id).state == "cancelled"  # type: ignore[union-attr]
    outer = backend.workflow_get(inserted.id)
    assert outer is not None and (outer.state, outer.cancelled) == ("cancelled", 2)
    assert callbacks(backend) == ["outer.on_settled"]


WHY = "the workflow was cancelled"


def _why(row: JobRow) -> list[dict[str, Any]]:
    """The entries of a job's errors that say its workflow's cancel ended it, without their
    time (attempt, type, message, traceback, worker, kind)."""
    return [
        {k: v for k, v in e.items() if k != "at"} for e in errors_of(row) if e.get("message") == WHY
    ]


def _cancelled_why(attempt: int = 0) -> list[dict[str, Any]]:
    return [
        {"attempt": attempt, "type": "Cancelled", "message": WHY, "traceback": None,
         "worker": None, "kind": "cancelled"},
    ]  # fmt: skip


def test_members_a_workflow_cancel_ends_say_in_their_errors_that_the_workflow_was_cancelled(
    backend: Backend,
) -> None:
    """The members a workflow's cancel ended (pending ones at once, dependents still
    waiting included; running ones asked to stop, once they end cancelled) were cancelled
    with nothing in their errors: an operator could not tell them from jobs cancelled on
    their own. Each carries "the workflow was cancelled", as members added after the
    cancel do; members that ended before it, or completed anyway, keep their errors."""
    inserted = backend.workflow_insert(
        spec(
            [("done", []), ("died", []), ("stopped", []), ("failed", []), ("completes", []),
             ("released", []), ("suspends", []), ("pending", []),
             ("after", [(2, "run_anyway")])],
            events=(),
        )
    )  # fmt: skip
    ids = {m.node: m.job_id for m in backend.workflow_members(inserted.id)}
    rows = {r.id: r for r in claim(backend, QUEUE, 7)}
    assert set(rows) == {ids[n] for n in ("done", "died", "stopped", "failed", "completes",
                                          "released", "suspends")}  # fmt: skip
    assert finish(backend, rows[ids["done"]], "completed")
    assert finish(backend, rows[ids["died"]], "dead", error=error())

    assert backend.workflow_cancel(inserted.id, "ops") == 2  # pending, and after waiting
    for node in ("pending", "after"):
        assert get(backend, ids[node]).state == "cancelled"
        assert _why(get(backend, ids[node])) == _cancelled_why()
    assert errors_of(get(backend, ids["done"])) == []  # ended before: unchanged
    assert [e["message"] for e in errors_of(get(backend, ids["died"]))] == ["boom"]

    interrupted = {**error(), "type": "Interrupted", "kind": "cancelled",
                   "message": "cancelled by an operator while running"}  # fmt: skip
    assert finish(backend, rows[ids["stopped"]], "cancelled", error=interrupted)
    assert finish(backend, rows[ids["failed"]], "dead", error=error())  # after the cancel
    released = rows[ids["released"]]
    assert backend.job_release_many([LeaseRef(released.id, released.lease_token or "", 30.0)])
    assert finish(backend, rows[ids["suspends"]], "waiting", wait_signal="go")
    assert finish(backend, rows[ids["completes"]], "completed")  # completed anyway
    for node in ("stopped", "failed", "released", "suspends"):
        row = get(backend, ids[node])
        assert row.state == "cancelled", node
        assert _why(row) == _cancelled_why(row.attempt), node
    assert [e["type"] for e in errors_of(get(backend, ids["stopped"]))] == [
        "Interrupted", "Cancelled",
    ]  # fmt: skip
    assert [e["message"] for e in errors_of(get(backend, ids["failed"]))] == ["boom", WHY]
    assert errors_of(get(backend, ids["completes"])) == []
    status = backend.workflow_get(inserted.id)
    assert status is not None and (status.state, status.cancelled) == ("cancelled", 6)


def test_members_of_nested_workflows_a_cancel_ends_say_the_workflow_was_cancelled(
    backend: Backend,
) -> None:
    inserted = backend.workflow_insert(nested(batch(2, events=()), events=()))
    [inner] = inserted.children.values()
    assert backend.workflow_cancel(inserted.id, "test") == 3
    for job in [*inserted.jobs, *inner.jobs]:
        assert _why(get(backend, job.id)) == _cancelled_why()


def test_a_workflow_cancel_whose_entry_fails_cancels_nothing_and_finishes_when_repeated(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The entry is written in the transaction that cancels the members: when it fails,
    none of them is cancelled (none left cancelled without saying why), and the cancel run
    again cancels them with it."""
    inserted = backend.workflow_insert(spec([("a", []), ("b", [(0, "run_anyway")])]))
    queries = backend.workflows.q  # type: ignore[attr-defined]
    monkeypatch.setitem(queries, "wf_note_cancelled", "SELECT no_such_column FROM no_such_table")
    with pytest.raises(CancelIncomplete):
        backend.workflow_cancel(inserted.id, "ops")
    assert [get(backend, j.id).state for j in inserted.jobs] == ["available", "waiting"]
    monkeypatch.undo()
    assert backend.workflow_cancel(inserted.id, "ops") == 2
    for job in inserted.jobs:
        assert _why(get(backend, job.id)) == _cancelled_why()


def test_a_workflow_commits_and_rolls_back_with_the_callers_async_connection(
    backend: Backend, harness: Harness, tmp_path: Any
) -> None:
    import asyncio

    async def scenario(commit: bool) -> int:
        conn = await harness.async_connection(backend, tmp_path, same_store=True)
        try:
            inserted = await backend.aworkflow_insert(spec([("a", []), ("b", [(0, "cancel")])]),
                                                      conn=conn)  # fmt: skip
            await (conn.commit() if commit else conn.rollback())
            return inserted.id
        finally:
            await conn.close()

    gone = asyncio.run(scenario(commit=False))
    assert backend.workflow_get(gone) is None
    kept = asyncio.run(scenario(commit=True))
    assert [m.node for m in backend.workflow_members(kept)] == ["a", "b"]
    assert claim_one(backend).id == backend.workflow_members(kept)[0].job_id
    assert claim_all(backend) == []  # b waits for a
    assert asyncio.run(backend.aworkflow_insert(batch(1))).id > kept


def test_pruning_deletes_settled_workflows_past_the_retention_and_keeps_running_ones(
    backend: Backend,
) -> None:
    settled = backend.workflow_insert(batch(1, events=()))
    running = backend.workflow_insert(spec([("a", []), ("b", [(0, "cancel")])], events=()))
    row = claim(backend, QUEUE, 1)[0]
    assert row.id == settled.jobs[0].id and finish(backend, row, "completed")
    assert backend.workflow_prune(3600.0, 100) == 0  # settled just now: kept
    assert backend.workflow_prune(-1.0, 100) == 1  # a retention already past
    assert backend.workflow_get(settled.id) is None
    assert backend.workflow_members(settled.id) == []
    assert backend.workflow_get(running.id) is not None
    assert [m.node for m in backend.workflow_members(running.id)] == ["a", "b"]


def test_a_settled_workflow_stays_until_each_of_its_callbacks_has_ended(
    backend: Backend,
) -> None:
    """A workflow settled past the retention while its callbacks still waited (a busy or
    paused queue, a retry's backoff): the prune deleted it with its members, and each
    callback, run then, got JobNotFound from ctx.workflow() and ctx.workflow_members().
    It stays until every callback it inserted has ended, retried ones included."""
    inserted = backend.workflow_insert(batch(1, events=("on_success", "on_settled")))
    assert finish(backend, claim_one(backend), "completed")
    assert callbacks(backend) == ["on_settled", "on_success"]
    assert backend.workflow_prune(-1.0, 100) == 0  # both callbacks wait in their queue
    first, second = claim(backend, CALLBACKS, 10)
    assert finish(backend, first, "retryable", error=error())
    assert finish(backend, second, "completed")
    assert backend.workflow_prune(-1.0, 100) == 0  # one is to run again
    again = claim_one(backend, CALLBACKS)
    assert again.id == first.id
    assert backend.workflow_prune(-1.0, 100) == 0  # it runs
    assert [m.node for m in backend.workflow_members(inserted.id)] == ["m0"]
    assert finish(backend, again, "completed")
    assert backend.workflow_prune(-1.0, 100) == 1
    assert backend.workflow_get(inserted.id) is None


def test_a_dead_callback_keeps_its_workflow_until_it_is_discarded_or_replayed_and_ended(
    backend: Backend,
) -> None:
    """A callback that died is in the DLQ, to be replayed: pruned meanwhile, its workflow
    was gone when the replay ran it, and ctx.workflow() raised JobNotFound (it died
    again). The workflow stays while a callback of it is dead; once each is discarded, or
    replayed and ended otherwise than dead, it goes as any other."""
    inserted = backend.workflow_insert(batch(1, events=("on_success", "on_settled")))
    assert finish(backend, claim_one(backend), "completed")
    first, second = claim(backend, CALLBACKS, 10)
    assert finish(backend, first, "dead", error=error())
    assert finish(backend, second, "dead", error=error())
    assert backend.workflow_prune(-1.0, 100) == 0  # both dead: a replay runs them again
    discard = ActionParams(actor="test", ids=[first.id], reason="not needed")
    assert backend.job_discard(discard).matched == [first.id]
    assert backend.workflow_prune(-1.0, 100) == 0  # the other is still dead
    assert backend.job_replay(ActionParams(actor="test", ids=[second.id])).matched == [second.id]
    again = claim_one(backend, CALLBACKS)
    assert again.id == second.id
    assert finish(backend, again, "dead", error=error())
    assert backend.workflow_prune(-1.0, 100) == 0  # dead again: still to be replayed
    backend.job_replay(ActionParams(actor="test", ids=[second.id]))
    assert finish(backend, claim_one(backend, CALLBACKS), "completed")
    assert backend.workflow_prune(-1.0, 100) == 1
    assert backend.workflow_get(inserted.id) is None


def test_a_discarded_callback_lets_its_workflow_be_pruned(backend: Backend) -> None:
    """A dead callback discarded will never run: its workflow is pruned as usual."""
    inserted = backend.workflow_insert(batch(1, events=("on_success",)))
    assert finish(backend, claim_one(backend), "completed")
    assert finish(backend, claim_one(backend, CALLBACKS), "dead", error=error())
    assert backend.workflow_prune(-1.0, 100) == 0
    discard = ActionParams(actor="test", all_matching=True, queue=CALLBACKS, reason="done")
    assert len(backend.job_discard(discard).matched) == 1
    assert backend.workflow_prune(-1.0, 100) == 1
    assert backend.workflow_get(inserted.id) is None


def test_a_replay_refuses_a_dead_callback_whose_workflow_is_gone_saying_what_to_do(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An errands that did not keep a dead callback's workflow pruned it: replayed, the
    callback ran and its ctx.workflow() raised JobNotFound deep in the handler (it died
    again). The replay refuses it, by id or with --all, dry run or not, saying why and
    what to do; a discard still takes it out of the DLQ."""
    inserted = backend.workflow_insert(batch(1, events=("on_success",)))
    assert finish(backend, claim_one(backend), "completed")
    callback = claim_one(backend, CALLBACKS)
    assert finish(backend, callback, "dead", error=error())
    queries = backend.workflows.q  # type: ignore[attr-defined]
    older = queries["wf_prunable"].replace("'completed', ", "'completed', 'dead', ", 1)
    monkeypatch.setitem(queries, "wf_prunable", older)  # the prune of such an errands
    assert backend.workflow_prune(-1.0, 100) == 1
    monkeypatch.undo()
    for dry_run in (True, False):
        by_id = ActionParams(actor="test", ids=[callback.id], dry_run=dry_run)
        every = ActionParams(actor="test", all_matching=True, queue=CALLBACKS, dry_run=dry_run)
        for params in (by_id, every):
            result = backend.job_replay(params)
            assert result.matched == []
            why = result.skipped[callback.id]
            assert f"on_success callback of workflow {inserted.id}, which no longer" in why
            assert f"errands dlq discard {callback.id}" in why
    assert get(backend, callback.id).state == "dead"
    discard = ActionParams(actor="test", ids=[callback.id], reason="its workflow is gone")
    assert backend.job_discard(discard).matched == [callback.id]


def test_a_nested_workflows_callback_yet_to_run_keeps_its_outermost_one(
    backend: Backend,
) -> None:
    """The callbacks of a workflow nested in another read it too: the tree stays while
    one of them waits."""
    inserted = backend.workflow_insert(nested(batch(1, events=("on_settled",)), events=()))
    [inner] = inserted.children.values()
    outer_job, inner_member = _outer_and_inner(backend, inserted.jobs[0].id)
    assert finish(backend, inner_member, "completed")
    assert finish(backend, outer_job, "completed")
    assert backend.workflow_get(inserted.id).settled_at is not None  # type: ignore[union-attr]
    assert backend.workflow_prune(-1.0, 100) == 0  # the inner one's on_settled waits
    assert finish(backend, claim_one(backend, CALLBACKS), "completed")
    assert backend.workflow_prune(-1.0, 100) == 2
    assert backend.workflow_get(inner.id) is None


def test_a_prune_batch_stops_at_its_rows_bound_oldest_first_and_the_next_goes_on(
    backend: Backend, harness: Harness
) -> None:
    """One batch took up to 1,000 workflows whatever their size: 1,000 of 1,000 members
    were a million rows in one transaction. Whole trees go, oldest first, while their
    rows fit; the first goes whatever its size."""
    ids = [backend.workflow_insert(batch(3, events=())).id for _ in range(3)]
    for row in claim_all(backend):
        assert finish(backend, row, "completed")
    for age, workflow_id in zip((300, 100, 200), ids, strict=True):
        harness.backdate_settled(backend, workflow_id, age)
    # each: its row and 3 members; two fit in 10 rows, the third would make 12
    assert backend.workflow_prune(-1.0, 100, rows=10) == 2
    assert [backend.workflow_get(i) is None for i in ids] == [True, False, True]
    assert backend.workflow_prune(-1.0, 100, rows=1) == 1  # bigger than the bound: alone
    assert backend.workflow_get(ids[1]) is None
    assert backend.workflow_prune(-1.0, 100, rows=1) == 0


def test_a_prune_called_without_a_rows_bound_stops_at_the_default_one(
    backend: Backend, harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Called without rows= (by an admin script, a user), a prune had no bound: every
    prunable tree went in one transaction, holding SQLite's write lock or PostgreSQL's
    row locks to the end. It stops at WORKFLOW_PRUNE_ROWS (10,000; 10 here), as the
    leader's batches do."""
    monkeypatch.setattr(base, "WORKFLOW_PRUNE_ROWS", 10)
    ids = [backend.workflow_insert(batch(3, events=())).id for _ in range(3)]
    for row in claim_all(backend):
        assert finish(backend, row, "completed")
    for age, workflow_id in zip((300, 200, 100), ids, strict=True):
        harness.backdate_settled(backend, workflow_id, age)
    assert backend.workflow_prune(-1.0, 100) == 2  # 4 rows each: the third would make 12
    assert [backend.workflow_get(i) is None for i in ids] == [True, True, False]
    assert backend.workflow_prune(-1.0, 100) == 1


def test_an_outcome_marked_as_a_members_lands_fans_in_and_stays_fenced(
    backend: Backend, harness: Harness
) -> None:
    """A worker marks a member's outcome as a member's (from its claimed row), so the write
    goes straight to the members' path: it lands and fans in once; a stale attempt's
    outcome so marked is still refused, and a plain job's outcome with or without the mark
    lands as ever."""
    backend.workflow_insert(batch(2))
    first, last = claim_all(backend)
    harness.expire_lease(backend, first.id)
    rescue = RescueParams(first.id, first.lease_token or "", "retryable", error(), 0.0)
    assert backend.job_rescue_many([rescue]) == [True]
    current = claim_one(backend, suspects=True)

    def marked(row: JobRow) -> FinishParams:
        return FinishParams(row.id, row.lease_token or "", "completed", member=True)

    assert backend.job_finish_many([marked(first)]) == [False]  # stale: refused
    assert backend.job_finish_many([marked(current), marked(last)]) == [True, True]
    assert callbacks(backend) == ["on_settled", "on_success"]
    assert backend.job_finish_many([marked(last)]) == [False]  # delivered again: nothing

    plain_id = backend.job_insert_many([request()])[0].id
    plain = claim_one(backend)
    assert plain.id == plain_id
    assert backend.job_finish_many(
        [FinishParams(plain.id, plain.lease_token or "", "completed", member=False)]
    ) == [True]
    assert get(backend, plain_id).state == "completed"


def test_pruning_keeps_the_finished_members_of_a_workflow_still_running(
    backend: Backend, harness: Harness
) -> None:
    """A and B, then C after both: A completes, B still runs (days, say, waiting for a
    signal). A's row past the retention was pruned, and C then read it as a completed
    parent with no result. Members of a running workflow stay until it settles; a plain
    job as old goes."""
    inserted = backend.workflow_insert(
        spec([("a", []), ("b", []), ("c", [(0, "cancel"), (1, "cancel")])], events=())
    )
    a_id = inserted.jobs[0].id
    a = next(r for r in claim_all(backend) if r.id == a_id)  # b is claimed too: running
    assert finish(backend, a, "completed", result_json='"from a"')
    harness.backdate_finished(backend, a_id, 8 * 86400)
    assert backend.job_prune(older_than=7 * 86400, limit=100) == 0
    assert get(backend, a_id).state == "completed"
    plain = backend.job_insert_many([request(name="plain")])[0].id
    [row] = claim(backend, QUEUE, 10)
    assert row.id == plain and finish(backend, row, "completed")
    harness.backdate_finished(backend, plain, 8 * 86400)
    assert backend.job_prune(older_than=7 * 86400, limit=100) == 1  # the plain job goes


WEEK = 7 * 86400


def test_a_settled_workflows_members_stay_until_it_settled_longer_ago_than_the_retention(
    backend: Backend, harness: Harness
) -> None:
    """A member that finished a week before its workflow settled was pruned at the first
    prune after the settle: WorkflowHandle.result() and the callbacks, run just after,
    read it as gone. Retention counts from the workflow's settling, for it and its
    members alike."""
    inserted = backend.workflow_insert(spec([("a", []), ("b", [])], events=()))
    for row in claim_all(backend):
        assert finish(backend, row, "completed", result_json='"done"')
    a_id, b_id = (j.id for j in inserted.jobs)
    harness.backdate_finished(backend, a_id, 8 * 86400)  # finished long before the settle
    assert backend.job_prune(older_than=WEEK, limit=100) == 0
    assert backend.workflow_prune(older_than=WEEK, limit=100) == 0
    assert get(backend, a_id).result == '"done"'
    harness.backdate_finished(backend, b_id, 8 * 86400)
    harness.backdate_settled(backend, inserted.id, 8 * 86400)
    assert backend.workflow_prune(older_than=WEEK, limit=100) == 1
    assert backend.workflow_get(inserted.id) is None
    assert backend.job_prune(older_than=WEEK, limit=100) == 2  # its members with it


def test_a_nested_workflow_stays_while_its_outer_workflow_runs(
    backend: Backend, harness: Harness
) -> None:
    """An inner workflow that settled long ago was pruned (with its members) while its
    outer one still ran, whose result then read it as gone: a nested workflow goes with
    its outermost one."""
    inserted = backend.workflow_insert(nested(batch(1, events=())))
    [inner] = inserted.children.values()
    outer_job, inner_member = _outer_and_inner(backend, inserted.jobs[0].id)
    assert finish(backend, inner_member, "completed")  # the inner workflow settles
    assert backend.workflow_get(inner.id).settled_at is not None  # type: ignore[union-attr]
    harness.backdate_settled(backend, inner.id, 8 * 86400)
    harness.backdate_finished(backend, inner_member.id, 8 * 86400)
    assert backend.workflow_prune(older_than=WEEK, limit=100) == 0  # the outer one runs
    assert backend.job_prune(older_than=WEEK, limit=100) == 0
    assert backend.workflow_get(inner.id) is not None
    assert finish(backend, outer_job, "completed")  # the outer one settles: kept a week
    assert backend.workflow_prune(older_than=WEEK, limit=100) == 0
    harness.backdate_settled(backend, inserted.id, 8 * 86400)
    harness.backdate_finished(backend, outer_job.id, 8 * 86400)
    assert backend.workflow_prune(older_than=WEEK, limit=100) == 0  # its on_success waits
    assert finish(backend, claim_one(backend, CALLBACKS), "completed")
    assert backend.workflow_prune(older_than=WEEK, limit=100) == 2  # outer and inner
    assert backend.workflow_get(inner.id) is None
    assert backend.job_prune(older_than=WEEK, limit=100) == 2


def _failed_long_ago_then_replayed(backend: Backend, harness: Harness) -> WorkflowInserted:
    """A batch of two that settled failed 8 days ago, its dead member replayed now."""
    inserted = backend.workflow_insert(batch(2))
    dead, ok = claim_all(backend)
    assert finish(backend, dead, "dead", error=error())
    assert finish(backend, ok, "completed")
    harness.backdate_settled(backend, inserted.id, 8 * 86400)
    _replay(backend, dead.id)
    return inserted


def test_a_settled_workflow_with_a_replayed_member_pending_is_not_pruned(
    backend: Backend, harness: Harness
) -> None:
    """A failed batch settled longer ago than the retention, and its dead member replayed
    today: the workflow is pending again but kept its old settled_at, so the next prune
    deleted it (and its members) while the replay ran: on_success never fired."""
    _failed_long_ago_then_replayed(backend, harness)
    assert backend.workflow_prune(older_than=WEEK, limit=100) == 0
    assert finish(backend, claim_one(backend), "completed")
    assert callbacks(backend) == ["on_dead", "on_settled", "on_success"]
    assert backend.workflow_prune(older_than=WEEK, limit=100) == 0  # settled again: now


def test_a_workflow_settled_again_after_a_replay_counts_its_retention_from_then(
    backend: Backend, harness: Harness
) -> None:
    """Its dead member replayed and dead again: the workflow settles again (failed, as
    before) and is kept for the retention from then, not pruned at once for its first
    settle of long ago, with the callbacks it just fired reading it."""
    inserted = _failed_long_ago_then_replayed(backend, harness)
    assert finish(backend, claim_one(backend), "dead", error=error())
    assert _state(backend, inserted.id)[0] == "failed"
    assert backend.workflow_prune(older_than=WEEK, limit=100) == 0


def test_members_sharing_a_key_are_refused_as_duplicates_of_each_other_not_of_a_stored_job(
    backend: Backend,
) -> None:
    """Two members with the same job name and key= were refused with "its key= matches
    job 1, already stored": job 1 was the sibling just written in the same (rolled back)
    transaction. The members themselves are named now, in a workflow, across its nested
    ones and among the members one adds; nothing is written."""
    keyed = request(name="member.keyed", key="k")
    twice = WorkflowSpec("wf", "batch", [NodeSpec("a", keyed), NodeSpec("b", keyed)])
    with pytest.raises(ConfigurationError, match="members 'a' and 'b' have the same key= 'k'"):
        backend.workflow_insert(twice)
    inner = WorkflowSpec("inner", "batch", [NodeSpec("c", keyed)])
    outer = WorkflowSpec("wf", "dag", [NodeSpec("a", keyed), NodeSpec("in", None, child=inner)])
    with pytest.raises(ConfigurationError, match="members 'a' and 'in/c' have the same key="):
        backend.workflow_insert(outer)
    assert backend.workflow_list() == [] and claim_all(backend) == []
    inserted = backend.workflow_insert(batch(1))
    adder = claim_one(backend)
    with pytest.raises(ConfigurationError, match=r"members '#1 \(member.keyed\)' and '#2"):
        complete_adding(backend, adder, [keyed] * 2)
    status = backend.workflow_get(inserted.id)
    assert status is not None and (status.total, status.pending) == (1, 1)


def test_a_skipped_parent_reads_as_skipped_not_as_a_cancelled_one(backend: Backend) -> None:
    """A dies, B (skip after A) is skipped, C (after B) runs: C read B with its job's
    state, 'cancelled' (a skipped job is stored cancelled), so ctx.parent_results().failed
    listed B, and a compensation treated it as failed. B reads as 'skipped'."""
    inserted = backend.workflow_insert(
        spec([("a", []), ("b", [(0, "skip")]), ("c", [(1, "cancel")])])
    )
    b_id, c_id = (j.id for j in inserted.jobs[1:])
    assert finish(backend, claim_one(backend), "dead", error=error())
    assert claim_one(backend).id == c_id
    [parent] = backend.workflow_parent_results(c_id)
    assert (parent.job_id, parent.node, parent.state, parent.result_json) == (
        b_id, "b", "skipped", None,
    )  # fmt: skip


def test_a_workflow_cancelled_while_its_members_run_settles_cancelled_without_on_success(
    backend: Backend,
) -> None:
    """The cancel landed while every pending member ran, and each then completed: the
    workflow settled cancelled and fired on_success too; nested, its parent counted it
    cancelled (and cancelled what came after it) although its on_success had run. Now
    it settles cancelled with on_settled only, and its parent counts it cancelled."""
    inserted = backend.workflow_insert(batch(2))
    rows = claim_all(backend)
    assert backend.workflow_cancel(inserted.id, "test") == 0  # both run: asked to stop
    for row in rows:
        assert finish(backend, row, "completed")
    assert callbacks(backend) == ["on_settled"]
    assert _state(backend, inserted.id) == ("cancelled", 2, 0, 0)

    outer = backend.workflow_insert(nested(batch(1), after_it=True, events=EVENTS))
    [inner] = outer.children.values()
    job, inner_member = _outer_and_inner(backend, outer.jobs[0].id)
    assert backend.workflow_cancel(inner.id, "test") == 0
    assert finish(backend, inner_member, "completed")
    assert _state(backend, inner.id) == ("cancelled", 1, 0, 0)
    members = {m.node: m.outcome for m in backend.workflow_members(outer.id)}
    assert members == {"job": None, "inner": "cancelled", "after": "cancelled"}
    assert finish(backend, job, "completed")
    assert callbacks(backend) == ["on_settled"] * 2 + ["outer.on_settled"]  # no on_success


def test_members_added_after_a_cancel_are_added_cancelled_and_never_run(
    backend: Backend,
) -> None:
    """The cancel landed while A ran; A completed adding members: they were inserted
    available and ran, and the workflow stayed running until they ended. They are
    added cancelled now (listed and counted, never claimed), and the workflow settles
    cancelled at once, as it would have without them."""
    inserted = backend.workflow_insert(batch(1))
    adder = claim_one(backend)
    assert backend.workflow_cancel(inserted.id, "test") == 0  # a runs: asked to stop
    added = [request(name="member.added") for _ in range(2)]
    assert complete_adding(backend, adder, added)
    assert claim_all(backend) == []
    status = backend.workflow_get(inserted.id)
    assert status is not None
    assert (status.state, status.total, status.completed, status.cancelled) == (
        "cancelled", 3, 1, 2,
    )  # fmt: skip
    assert callbacks(backend) == ["on_settled"]
    members = [m for m in backend.workflow_members(inserted.id) if m.job_id != adder.id]
    assert [(m.state, m.outcome) for m in members] == [("cancelled", "cancelled")] * 2
    for member in members:  # once, though its end passes the fan-in after the add wrote it
        assert _why(get(backend, member.job_id)) == _cancelled_why()


def test_a_member_replayed_after_its_workflow_was_pruned_adds_jobs_that_run_on_their_own(
    backend: Backend,
) -> None:
    """A dead member replayed after its workflow was pruned runs on its own; adding
    members, it wrote member and pending rows for the workflow that no longer existed
    (its count matched nothing, the pending row was never removed). What it adds is
    stored as plain jobs, outside any workflow, and runs."""
    inserted = backend.workflow_insert(batch(1, events=()))
    assert finish(backend, claim_one(backend), "dead", error=error())
    assert backend.workflow_prune(-1.0, 100) == 1
    _replay(backend, inserted.jobs[0].id)
    assert complete_adding(backend, claim_one(backend), [request(name="member.added")])
    assert backend.workflow_members(inserted.id) == []
    added = claim_one(backend)
    assert added.name == "member.added" and added.workflow_id is None
    assert "workflow" not in get(backend, added.id).meta
    assert finish(backend, added, "completed")


def test_a_nested_workflow_with_a_replayed_member_pending_keeps_its_outer_one_from_pruning(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A nested batch's member dies, the batch is cancelled (settling cancelled: it is a
    cancelled member of its parent, not a dead one), the outer workflow settles, and the
    dead member is replayed: pending again in the nested batch only. The prune looked for
    pending rows of the outermost workflow alone, and deleted both with the replay
    running. Nothing is pruned while a member of the tree is pending. (A replay of a
    cancelled workflow's member is refused now; one let through before that was is
    stored still: the refusal is switched off here to store it.)"""

    def none_refused(job_ids: Any) -> Any:
        yield from ()
        return {}

    monkeypatch.setattr(backend.workflows, "cancelled_among", none_refused)  # type: ignore[attr-defined]
    inserted = backend.workflow_insert(nested(batch(2, events=()), events=()))
    [inner] = inserted.children.values()
    rows = {r.id: r for r in claim_all(backend)}
    dead = rows[inner.jobs[0].id]
    assert finish(backend, dead, "dead", error=error())
    backend.workflow_cancel(inner.id, "test")  # its other member was claimed: it runs
    assert finish(backend, rows[inner.jobs[1].id], "completed")
    assert finish(backend, rows[inserted.jobs[0].id], "completed")
    assert _state(backend, inner.id)[0] == "cancelled"
    assert _state(backend, inserted.id) == ("failed", 1, 0, 0)
    _replay(backend, dead.id)
    assert _state(backend, inner.id) == ("cancelled", 1, 0, 1)
    assert _state(backend, inserted.id)[3] == 0  # not pending again in its parent
    assert backend.workflow_prune(-1.0, 100) == 0
    assert finish(backend, claim_one(backend), "completed")
    assert backend.workflow_prune(-1.0, 100) == 2


def test_a_cancel_flags_every_nested_workflow_before_it_cancels_any_member(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancel flagged the outer workflow, then each nested one in turn: a nested
    batch whose last member completed in between, adding a member (added cancelled by
    the outer flag), settled failed, and the outer workflow fired on_dead for a death
    that never was. Every flag of the tree is set at once: it settles cancelled."""
    inserted = backend.workflow_insert(nested(batch(1, events=()), events=("on_dead",)))
    [inner] = inserted.children.values()
    outer_job, inner_member = _outer_and_inner(backend, inserted.jobs[0].id)
    workflows = backend.workflows  # type: ignore[attr-defined]
    nested_pending = workflows.nested_pending

    def completes_in_between(workflow_id: int) -> Any:
        if workflow_id == inserted.id:  # the outer flag written, the nested ones next
            assert complete_adding(backend, inner_member, [request(name="member.added")])
        return (yield from nested_pending(workflow_id))

    monkeypatch.setattr(workflows, "nested_pending", completes_in_between)
    backend.workflow_cancel(inserted.id, "test")
    assert finish(backend, outer_job, "completed")
    states = {w: backend.workflow_get(w) for w in (inserted.id, inner.id)}
    assert [s.state if s else None for s in states.values()] == ["cancelled", "cancelled"]
    assert callbacks(backend) == []  # no on_dead


def _outer_running_inner_failed(
    backend: Backend,
) -> tuple[WorkflowInserted, WorkflowInserted, JobRow, JobRow]:
    """A workflow whose job member runs and whose nested batch failed (its one member
    dead): the outer one still runs, the nested one settled failed. The workflow, the
    nested one, the job's claimed row, the nested member's dead row."""
    inserted, inner, job, inner_member = _nested_member_dead(backend)
    assert _state(backend, inner.id) == ("failed", 0, 1, 0)
    assert _state(backend, inserted.id) == ("running", 0, 1, 1)
    return inserted, inner, job, inner_member


def test_a_member_replayed_before_its_outer_workflows_cancel_is_cancelled_saying_why(
    backend: Backend,
) -> None:
    """A dead member of a failed nested workflow is replayed (re-opening the nested one
    in its parent), then the outer workflow is cancelled: the replayed member was
    cancelled with nothing in its errors (the nested workflow, settled when the cancel
    was requested, was never flagged), and the nested one stayed failed. It says "the
    workflow was cancelled", and the nested workflow settles cancelled again."""
    inserted, inner, job, inner_member = _outer_running_inner_failed(backend)
    _replay(backend, inner_member.id)
    assert backend.workflow_cancel(inserted.id, "ops") == 1  # the replayed member
    replayed = get(backend, inner_member.id)
    assert replayed.state == "cancelled"
    assert _why(replayed) == _cancelled_why(replayed.attempt)
    assert finish(backend, job, "completed")  # completed anyway
    assert _state(backend, inner.id) == ("cancelled", 0, 0, 0)
    assert backend.workflow_get(inner.id).cancelled == 1  # type: ignore[union-attr]
    assert _state(backend, inserted.id) == ("cancelled", 1, 0, 0)
    members = {m.node: m.outcome for m in backend.workflow_members(inserted.id)}
    assert members == {"job": "completed", "inner": "cancelled"}
    assert "on_success" not in callbacks(backend)
    assert "outer.on_success" not in callbacks(backend)


def test_a_member_of_a_cancelled_outer_workflow_is_refused_a_replay_and_never_runs(
    backend: Backend,
) -> None:
    """The outer workflow is cancelled while its nested one had failed (settled, so not
    pending in it: the cancel passed it by), then a dead member of the nested one is
    replayed: the replay re-opened the nested workflow and the member ran, inside a
    cancelled workflow (and its success fired the nested one's on_success). The replay
    is refused, saying why; the member stays dead, nothing runs."""
    inserted, inner, job, inner_member = _outer_running_inner_failed(backend)
    assert backend.workflow_cancel(inserted.id, "ops") == 0  # the job runs: asked to stop
    for dry_run in (True, False):
        result = backend.job_replay(
            ActionParams(actor="ops", ids=[inner_member.id], dry_run=dry_run)
        )
        assert result.matched == []
        assert result.skipped == {
            inner_member.id: f"its workflow {inserted.id} was cancelled: a cancelled "
            "workflow's members do not run again (discard the job, or enqueue it anew)"
        }
    assert get(backend, inner_member.id).state == "dead"
    assert claim_all(backend) == []
    assert _state(backend, inner.id) == ("failed", 0, 1, 0)
    assert finish(backend, job, "completed")
    assert _state(backend, inserted.id) == ("cancelled", 1, 1, 0)
    # the same refusal when the replay selects by filter
    result = backend.job_replay(ActionParams(actor="ops", all_matching=True))
    assert result.matched == [] and list(result.skipped) == [inner_member.id]
    assert claim_all(backend) == []


def test_a_replay_landing_between_the_cancel_request_and_its_members_is_refused(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replay commits once the cancel was requested, before the cancel reads which
    nested workflows are pending: refused as after the whole cancel; nothing runs."""
    inserted, _, job, inner_member = _outer_running_inner_failed(backend)
    workflows = backend.workflows  # type: ignore[attr-defined]
    nested_pending = workflows.nested_pending
    refused: list[dict[int, str]] = []

    def replay_in_between(workflow_id: int) -> Any:
        if workflow_id == inserted.id and not refused:
            result = backend.job_replay(ActionParams(actor="ops", ids=[inner_member.id]))
            assert result.matched == []
            refused.append(result.skipped)
        return (yield from nested_pending(workflow_id))

    monkeypatch.setattr(workflows, "nested_pending", replay_in_between)
    backend.workflow_cancel(inserted.id, "ops")
    assert list(refused[0]) == [inner_member.id]
    assert get(backend, inner_member.id).state == "dead"
    assert claim_all(backend) == []
    assert finish(backend, job, "completed")
    assert _state(backend, inserted.id) == ("cancelled", 1, 1, 0)


def test_a_reopened_nested_workflow_cancelled_while_its_replayed_member_runs_fires_no_success(
    backend: Backend,
) -> None:
    """The replayed member of a failed nested workflow runs when the outer workflow is
    cancelled, and completes anyway: the nested workflow turned succeeded and fired
    on_success, inside a cancelled workflow. It settles cancelled again, on_success never
    fires, and its parent counts it cancelled."""
    inserted, inner, job, inner_member = _outer_running_inner_failed(backend)
    _replay(backend, inner_member.id)
    replayed = claim_one(backend)
    assert backend.workflow_cancel(inserted.id, "ops") == 0  # both run: asked to stop
    assert finish(backend, replayed, "completed")
    assert _state(backend, inner.id) == ("cancelled", 1, 0, 0)
    assert errors_of(get(backend, replayed.id))[-1]["message"] == "boom"  # completed: as it was
    assert finish(backend, job, "completed")
    assert _state(backend, inserted.id) == ("cancelled", 1, 0, 0)
    assert callbacks(backend) == ["on_dead", "on_settled", "outer.on_dead", "outer.on_settled"]
