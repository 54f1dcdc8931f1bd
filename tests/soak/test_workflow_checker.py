"""The soak's workflow checks (W1-W7, tests/soak/workflows.py) fail on rows made up to
break each of them, and pass on a workflow that ended as its shape says."""

from __future__ import annotations

import json
from collections import Counter

from .records import Findings, Run
from .workflows import Member, Snapshot, verify

WF = 7


def diamond(**changes: object) -> tuple[Snapshot, dict[int, list[Run]]]:
    """A diamond (a -> b, c -> d) that succeeded: members 1-4 ended at 10, 20, 21, 30;
    on_success (job 5) and on_settled (job 6) ran at 31 and saw nothing pending."""
    members = [
        Member(1, "a", "completed", "completed", 10.0),
        Member(2, "b", "completed", "completed", 20.0),
        Member(3, "c", "completed", "completed", 21.0),
        Member(4, "d", "completed", "completed", 30.0),
    ]
    runs = {
        1: [_run(1, 5.0)],
        2: [_run(2, 15.0)],
        3: [_run(3, 16.0)],
        4: [_run(4, 25.0)],
        5: [_run(5, 31.0, {"pending": 0})],
        6: [_run(6, 31.0, {"pending": 0})],
    }
    snap = Snapshot(
        flows={WF: ("soak-wf-diamond-1", "succeeded", 4, 0, 0, 0, 4)},
        members={WF: members},
        pending=Counter(),
        callbacks={(WF, "on_success"): [(5, "completed")], (WF, "on_settled"): [(6, "completed")]},
    )
    for key, value in changes.items():
        setattr(snap, key, value)
    return snap, runs


def _run(job_id: int, at: float, seen: dict[str, int] | None = None) -> Run:
    detail = json.dumps(seen) if seen is not None else None
    return Run(job_id, 1, f"t{job_id}", "run", "w-1", at, 0.0, 0.0, detail, "soak.fast")


def violations(snap: Snapshot, runs: dict[int, list[Run]]) -> list[str]:
    out = Findings()
    verify(out, snap, {WF: "diamond"}, runs)
    return out.violations


def test_a_workflow_that_ended_as_its_shape_says_passes() -> None:
    assert violations(*diamond()) == []


def test_a_workflow_still_running_or_with_members_pending_is_stuck() -> None:
    snap, runs = diamond(pending=Counter({WF: 1}))
    assert [v[:2] for v in violations(snap, runs)] == ["W1"]


def test_a_callback_fired_twice_or_not_due_is_a_violation() -> None:
    snap, runs = diamond()
    snap.callbacks[(WF, "on_success")].append((8, "completed"))
    runs[8] = [_run(8, 32.0, {"pending": 0})]
    snap.callbacks[(WF, "on_dead")] = [(9, "completed")]
    found = violations(snap, runs)
    assert len(found) == 1 and found[0].startswith("W3: 2 callback"), found


def test_a_callback_that_began_before_the_last_member_ended_is_early() -> None:
    snap, runs = diamond()
    runs[6] = [_run(6, 29.0, {"pending": 1})]
    assert [v[:2] for v in violations(snap, runs)] == ["W4"]


def test_a_dependent_that_ran_before_its_parent_ended_is_a_violation() -> None:
    snap, runs = diamond()
    runs[4] = [_run(4, 20.5)]  # d began after b ended (20) but before c did (21)
    assert [v[:2] for v in violations(snap, runs)] == ["W5"]


def test_counts_that_are_not_the_members_outcomes_are_a_violation() -> None:
    snap, runs = diamond(flows={WF: ("soak-wf-diamond-1", "succeeded", 3, 0, 0, 0, 4)})
    assert [v[:2] for v in violations(snap, runs)] == ["W2"]


NESTED, INNER = 11, 12


def nested(**changes: object) -> tuple[Snapshot, dict[int, list[Run]]]:
    """A nested batch (workflow 12: members 21-23 ended at 10, 11, 12) that settled at 13,
    its callbacks 24 and 25 at 14; its parent (workflow 11) counted it completed, ran
    ``after`` (job 26) at 15 (ended 16), settled at 17; its callbacks 27 and 28 at 18."""
    inner = [Member(21 + i, f"m{i}", "completed", "completed", 10.0 + i) for i in range(3)]
    parent = [
        Member(-INNER, "inner", "completed", None, 13.0),
        Member(26, "after", "completed", "completed", 16.0),
    ]
    runs = {21: [_run(21, 9.0)], 22: [_run(22, 9.5)], 23: [_run(23, 9.8)], 26: [_run(26, 15.0)]}
    for job_id, at in ((24, 14.0), (25, 14.0), (27, 18.0), (28, 18.0)):
        runs[job_id] = [_run(job_id, at, {"pending": 0})]
    snap = Snapshot(
        flows={
            NESTED: ("soak-wf-nested-3", "succeeded", 2, 0, 0, 0, 2),
            INNER: ("soak-wf-inner-3", "succeeded", 3, 0, 0, 0, 3),
        },
        members={NESTED: parent, INNER: inner},
        pending=Counter(),
        callbacks={
            (INNER, "on_success"): [(24, "completed")],
            (INNER, "on_settled"): [(25, "completed")],
            (NESTED, "on_success"): [(27, "completed")],
            (NESTED, "on_settled"): [(28, "completed")],
        },
        settled={NESTED: 17.0, INNER: 13.0},
    )
    for key, value in changes.items():
        setattr(snap, key, value)
    return snap, runs


def nested_violations(snap: Snapshot, runs: dict[int, list[Run]]) -> list[str]:
    out = Findings()
    verify(out, snap, {NESTED: "nested"}, runs)
    return out.violations


def test_a_nested_batch_that_settled_before_its_parent_passes() -> None:
    assert nested_violations(*nested()) == []


def test_a_nested_batch_that_settled_after_its_parent_is_a_violation() -> None:
    snap, runs = nested()
    snap.settled[INNER] = 17.5  # its parent settled at 17, and ran `after` before it too
    found = [v[:2] for v in nested_violations(snap, runs)]
    assert "W6" in found and "W1" not in found, found


def test_a_nested_batch_counted_in_its_parent_against_its_state_is_a_violation() -> None:
    snap, runs = nested()
    snap.members[NESTED][0] = Member(-INNER, "inner", "dead", None, 13.0)
    snap.flows[NESTED] = ("soak-wf-nested-3", "succeeded", 1, 1, 0, 0, 2)
    found = [v[:2] for v in nested_violations(snap, runs)]
    assert "W6" in found, found


def test_a_parent_callback_that_began_before_its_nested_batch_settled_is_early() -> None:
    snap, runs = nested()
    runs[28] = [_run(28, 12.5, {"pending": 0})]  # before the nested batch settled at 13
    assert [v[:2] for v in nested_violations(snap, runs)] == ["W4"]


def grow(added: int) -> tuple[Snapshot, dict[int, list[Run]]]:
    """A batch whose member ``seed`` (job 31) added ``added`` members (jobs 40...)."""
    members = [
        Member(31, "seed", "completed", "completed", 10.0),
        Member(32, "m1", "completed", "completed", 5.0),
        *(Member(40 + i, "soak.fast", "completed", "completed", 12.0) for i in range(added)),
    ]
    runs = {31: [_run(31, 9.0)], 32: [_run(32, 4.0)], 33: [_run(33, 13.0, {"pending": 0})]}
    runs[34] = [_run(34, 13.0, {"pending": 0})]
    total = len(members)
    snap = Snapshot(
        flows={WF: ("soak-wf-grow-4", "succeeded", total, 0, 0, 0, total)},
        members={WF: members},
        pending=Counter(),
        callbacks={
            (WF, "on_success"): [(33, "completed")],
            (WF, "on_settled"): [(34, "completed")],
        },
        settled={WF: 12.5},
    )
    return snap, runs


def grow_violations(snap: Snapshot, runs: dict[int, list[Run]]) -> list[str]:
    out = Findings()
    verify(out, snap, {WF: "grow"}, runs)
    return out.violations


def test_a_member_that_added_exactly_its_members_passes() -> None:
    assert grow_violations(*grow(3)) == []


def test_members_added_by_a_failed_attempt_as_well_are_a_violation() -> None:
    # the first attempt's 3 adds kept beside the second's: 6
    assert [v[:2] for v in grow_violations(*grow(6))] == ["W7"]


def test_members_added_that_never_landed_are_a_violation() -> None:
    assert [v[:2] for v in grow_violations(*grow(2))] == ["W7"]


def test_a_callback_that_began_before_an_added_member_ended_is_early() -> None:
    snap, runs = grow(3)
    runs[34] = [_run(34, 11.0, {"pending": 0})]  # the added members ended at 12
    assert [v[:2] for v in grow_violations(snap, runs)] == ["W4"]


def test_a_large_failed_batch_fires_on_dead_and_on_settled_once() -> None:
    members = [Member(50 + i, f"m{i}", "completed", "completed", 10.0) for i in range(99)]
    members.append(Member(149, "m99", "dead", "dead", 11.0))
    runs = {m.job_id: [_run(m.job_id, 9.0)] for m in members}
    runs[150] = [_run(150, 11.5, {"pending": 3})]  # on_dead: members may still be pending
    runs[151] = [_run(151, 12.0, {"pending": 0})]
    snap = Snapshot(
        flows={WF: ("soak-wf-batchdead100-5", "failed", 99, 1, 0, 0, 100)},
        members={WF: members},
        pending=Counter(),
        callbacks={(WF, "on_dead"): [(150, "completed")], (WF, "on_settled"): [(151, "completed")]},
    )
    out = Findings()
    verify(out, snap, {WF: "batchdead100"}, runs)
    assert out.violations == []
    snap.callbacks[(WF, "on_success")] = [(152, "completed")]  # never due: a member died
    out = Findings()
    verify(out, snap, {WF: "batchdead100"}, runs)
    assert [v[:2] for v in out.violations] == ["W3"]
