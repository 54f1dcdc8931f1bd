"""Workflows in the chaos soak (issue 18): batches and small DAGs beside the job mix, and
the invariants the checker holds them to.

The workload enqueues one workflow every ``EVERY`` batches of the mix (a few dozen jobs
at the CI size), round the shapes of :data:`SHAPES`; their members are the mix's own job
types (``soak.fast``, ``soak.flaky``, ``soak.doomed``), so every execution leaves a
``run`` row that I4 accounts for like any other, and the worker kills, freezes, cut
connections and server restarts strike them as they strike the rest. Their callbacks are
``soak.wf_callback``, which records the workflow's status as it saw it.

The checks (W1-W5), over every workflow the store holds (an enqueue retried after a
lost commit may have stored one twice: both must hold):

- W1 no stuck workflow: each settled, with an empty pending set;
- W2 outcomes: each ends in its shape's state, each member in its node's outcome (a
  ``cancel`` dependent of a dead parent cancelled, a ``skip`` one skipped, a
  ``run_anyway`` one completed), and the counts on its row are its members' outcomes;
- W3 every callback exactly once: one callback job per event that was due (none for an
  event that was not), and it completed;
- W4 never early: each callback began after every member had ended, and saw no member
  pending (``ctx.workflow()``);
- W5 dependents after their parents: each dependent began after each parent ended, and
  a dependent a failed parent cancelled or skipped never ran.
"""

from __future__ import annotations

import json
import random
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import soak_app

import errands

from .records import Findings, Run
from .store import Store, as_json

EVERY = 5  # batches of the mix between two workflows
PREFIX = "soak-wf"
EVENTS = ("on_success", "on_settled", "on_dead")


@dataclass(frozen=True)
class Shape:
    """A workflow shape: its nodes (name, job kind, parents with policies), the state it
    must settle in, and each node's outcome."""

    nodes: tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...]
    state: str
    outcomes: dict[str, str]


def _batch(size: int) -> Shape:
    kinds = ["flaky" if i % 3 == 1 else "fast" for i in range(size)]
    return Shape(
        tuple((f"m{i}", kind, ()) for i, kind in enumerate(kinds)),
        "succeeded",
        {f"m{i}": "completed" for i in range(size)},
    )


SHAPES: dict[str, Shape] = {
    "batch": _batch(5),
    "diamond": Shape(
        (
            ("a", "fast", ()),
            ("b", "flaky", (("a", "cancel"),)),
            ("c", "fast", (("a", "cancel"),)),
            ("d", "fast", (("b", "cancel"), ("c", "cancel"))),
        ),
        "succeeded",
        dict.fromkeys("abcd", "completed"),
    ),
    "chain": Shape(
        (
            ("a", "fast", ()),
            ("b", "delayed", (("a", "cancel"),)),
            ("c", "fast", (("b", "cancel"),)),
        ),
        "succeeded",
        dict.fromkeys("abc", "completed"),
    ),
    "failing": Shape(
        (
            ("root", "doomed", ()),
            ("cancelled", "fast", (("root", "cancel"),)),
            ("skipped", "fast", (("root", "skip"),)),
            ("anyway", "fast", (("root", "run_anyway"),)),
            ("after_skip", "fast", (("skipped", "cancel"),)),
            ("after_cancel", "fast", (("cancelled", "skip"),)),
        ),
        "failed",
        {
            "root": "dead",
            "cancelled": "cancelled",
            "skipped": "skipped",
            "anyway": "completed",
            "after_skip": "completed",
            "after_cancel": "skipped",
        },
    ),
}


def due_events(shape: Shape) -> set[str]:
    failed = any(o in ("dead", "cancelled") for o in shape.outcomes.values())
    died = "dead" in shape.outcomes.values()
    return {"on_settled"} | ({"on_dead"} if died else set()) | (set() if failed else {"on_success"})


def build(shape_name: str, seq: int, rng: random.Random) -> errands.Workflow:
    """The workflow ``soak-wf-<shape>-<seq>`` with every callback (members without keys:
    a workflow's members are new jobs)."""
    shape = SHAPES[shape_name]
    name = f"{PREFIX}-{shape_name}-{seq}"
    callbacks = {e: soak_app.wf_callback.bind(event=e) for e in EVENTS}
    wf: errands.Workflow = (
        errands.Batch(name, **callbacks)
        if shape_name == "batch"
        else errands.Workflow(name, **callbacks)
    )
    nodes: dict[str, errands.Node] = {}
    for node, kind, parents in shape.nodes:
        after = [errands.Edge(nodes[p], policy) for p, policy in parents]
        nodes[node] = wf.add(_member(kind, seq, rng), after=after, name=node)
    return wf


def _member(kind: str, seq: int, rng: random.Random) -> errands.BoundJob:
    if kind == "flaky":
        return soak_app.flaky.bind(n=seq, fail_times=1)
    if kind == "doomed":
        return soak_app.doomed.bind(n=seq)
    if kind == "delayed":  # its delay counts from its release
        return soak_app.fast.bind(n=seq, delay=round(rng.uniform(0.1, 0.5), 2))
    return soak_app.fast.bind(n=seq)


class WorkflowFeed:
    """What the workload thread calls between its batches: a workflow every ``EVERY``."""

    def __init__(
        self,
        app: errands.App,
        rng: random.Random,
        retrying: Callable[[Callable[[], Any]], Any],
        next_seq: Callable[[], int],
        enqueued: dict[int, str],
    ) -> None:
        self.app = app
        self.rng = rng
        self.retrying = retrying
        self.next_seq = next_seq
        self.enqueued = enqueued  # acknowledged: workflow id -> shape (the ledger's)
        self._turn = 0

    def after_batch(self, batches: int) -> None:
        if batches % EVERY == 0:
            self.enqueue_one()

    def enqueue_one(self) -> None:
        shape = list(SHAPES)[self._turn % len(SHAPES)]
        self._turn += 1
        wf = build(shape, self.next_seq(), self.rng)
        handle = self.retrying(lambda: self.app.enqueue_workflow(wf))
        self.enqueued[handle.id] = shape


# -- the checks -------------------------------------------------------------------------------
@dataclass
class Member:
    job_id: int
    node: str
    outcome: str | None
    state: str | None
    finished_at: float | None


@dataclass
class Snapshot:
    """What the store holds of workflows once the run drained."""

    # workflow id -> (name, state, completed, dead, cancelled, skipped, total)
    flows: dict[int, tuple[Any, ...]]
    members: dict[int, list[Member]]  # by workflow id
    pending: Counter[int]  # rows left in each workflow's pending set
    callbacks: dict[tuple[int, str], list[tuple[int, str]]]  # (wf, event) -> (job, state)


def load(store: Store) -> Snapshot:
    e = store.epoch
    flows = {
        int(r[0]): r[1:]
        for r in store.query(
            "SELECT id, name, state, completed, dead, cancelled, skipped, total "
            "FROM {s}errands_workflows"
        )
    }
    members: dict[int, list[Member]] = defaultdict(list)
    for wf, job_id, node, outcome, state, finished in store.query(
        f"SELECT m.workflow_id, m.job_id, m.node, m.outcome, j.state, {e('j.finished_at')} "
        "FROM {s}errands_workflow_members AS m LEFT JOIN {s}errands_jobs AS j ON j.id = m.job_id"
    ):
        members[int(wf)].append(Member(int(job_id), node, outcome, state, finished))
    pending = Counter(
        int(r[0]) for r in store.query("SELECT workflow_id FROM {s}errands_workflow_pending")
    )
    callbacks: dict[tuple[int, str], list[tuple[int, str]]] = defaultdict(list)
    for job_id, meta, state in store.query(
        "SELECT id, meta, state FROM {s}errands_jobs WHERE name = 'soak.wf_callback'"
    ):
        cb = (as_json(meta) or {}).get("workflow_callback") or {}
        callbacks[(int(cb.get("workflow", 0)), str(cb.get("event")))].append((job_id, state))
    return Snapshot(flows, members, pending, callbacks)


def check(
    out: Findings,
    store: Store,
    enqueued: dict[int, str],
    by_job: dict[int, list[Run]],
) -> None:
    verify(out, load(store), enqueued, by_job)


def verify(
    out: Findings, snap: Snapshot, enqueued: dict[int, str], by_job: dict[int, list[Run]]
) -> None:
    flows, members, pending, callbacks = snap.flows, snap.members, snap.pending, snap.callbacks
    ours = {i: row for i, row in flows.items() if str(row[0]).startswith(PREFIX + "-")}
    missing = sorted(set(enqueued) - set(ours))
    shapes = Counter(str(row[0]).split("-")[2] for row in ours.values())
    out.figures["workflows (enqueued / stored, by shape)"] = (
        f"{len(enqueued)} / {len(ours)} {dict(shapes)}"
    )
    out.figures["workflow states"] = dict(Counter(str(row[1]) for row in ours.values()))
    if missing:
        out.fail("W1", f"{len(missing)} acknowledged workflow(s) missing from the store", missing)
    problems: dict[str, list[Any]] = defaultdict(list)
    for wf, (name, state, completed, dead, cancelled, skipped, total) in sorted(ours.items()):
        shape = SHAPES[str(name).split("-")[2]]
        mine = members[wf]
        if state == "running" or pending[wf]:
            problems["W1"].append((wf, name, state, pending[wf]))
            continue
        outcomes = {m.node: m.outcome for m in mine}
        counts = Counter(m.outcome for m in mine)
        if state != shape.state or outcomes != shape.outcomes:
            problems["W2"].append((wf, name, state, outcomes))
        if (completed, dead, cancelled, skipped, total) != (
            counts["completed"], counts["dead"], counts["cancelled"], counts["skipped"], len(mine),
        ):  # fmt: skip
            problems["W2 counts"].append((wf, (completed, dead, cancelled, skipped, total)))
        for event in EVENTS:
            fired = callbacks.get((wf, event), [])
            if len(fired) != (event in due_events(shape)):
                problems["W3"].append((wf, name, event, fired))
            for job_id, cb_state in fired:
                if cb_state != "completed":
                    problems["W3"].append((wf, event, job_id, cb_state))
                early = _early(event, mine, by_job.get(job_id, []))
                if early:
                    problems["W4"].append((wf, name, event, early))
        problems["W5"].extend(_dependents(wf, shape, mine, by_job))
    for invariant, found in sorted(problems.items()):
        if found:
            what = {
                "W1": "workflow(s) stuck (not settled, or members still pending)",
                "W2": "workflow(s) whose state or members' outcomes are not their shape's",
                "W2 counts": "workflow(s) whose counts are not their members' outcomes",
                "W3": "callback(s) not fired exactly once, or not completed",
                "W4": "callback(s) that began before every member had ended",
                "W5": "dependent(s) that ran before a parent ended, or that should not run",
            }[invariant]
            out.fail(invariant.split()[0], f"{len(found)} {what}", found)


def _early(event: str, mine: list[Member], runs: list[Run]) -> list[Any]:
    """The runs of a callback that began before its moment: ``on_dead`` before a member
    died; the others before every member ended, or seeing one still pending."""
    if event == "on_dead":
        died = [m.finished_at or 0.0 for m in mine if m.outcome == "dead"]
        moment = min(died, default=float("inf"))
    else:
        moment = max((m.finished_at or float("inf")) for m in mine)
    return [
        (r.at, r.detail)
        for r in runs
        if r.kind == "run"
        and (r.at < moment or (event != "on_dead" and json.loads(r.detail or "{}").get("pending")))
    ]


def _dependents(
    wf: int, shape: Shape, mine: list[Member], by_job: dict[int, list[Run]]
) -> list[Any]:
    by_node = {m.node: m for m in mine}
    wrong = []
    for node, _, parents in shape.nodes:
        member = by_node.get(node)
        if member is None:
            continue
        runs = [r.at for r in by_job.get(member.job_id, []) if r.kind == "run"]
        if shape.outcomes[node] in ("cancelled", "skipped") and runs:
            wrong.append((wf, node, "ran", len(runs)))
        for parent, _ in parents:
            ended = by_node[parent].finished_at
            if runs and (ended is None or min(runs) < ended):
                wrong.append((wf, node, "before", parent))
    return wrong
