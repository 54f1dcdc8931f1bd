"""The soak's workflow checks (W1-W5, tests/soak/workflows.py) fail on rows made up to
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
