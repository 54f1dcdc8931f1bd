"""Workflows in the chaos soak (issue 18): batches and DAGs beside the job mix, and the
invariants the checker holds them to.

The workload spreads :class:`Sizes` over the run (after each batch of the mix, the
workflows due by then): ``batches`` batches of ``batch_size`` members (every
``DEAD_BATCH_EVERY``-th with one member that dies) and ``dags`` DAGs round
:data:`DAG_SHAPES` (a chain, a diamond, a DAG whose root dies with ``cancel``, ``skip``
and ``run_anyway`` dependents, a nested batch with a node after it, a failing nested
batch with each policy after it, a batch whose member adds members while it runs, a wide
fan-out/fan-in). At full size that is issue 18's 1,000 batches of 100 members and 200
DAGs. Their members are the mix's own job types (``soak.fast``, ``soak.flaky``,
``soak.doomed``, and ``soak.wf_grow``, which adds members), so every execution leaves a
``run`` row that I4 accounts for like any other, and the worker kills, freezes, cut
connections and server restarts strike them as they strike the rest. Their callbacks are
``soak.wf_callback``, which records the workflow's status as it saw it.

The checks, over every workflow the store holds (an enqueue retried after a lost commit
may have stored one twice: both must hold; a nested workflow is checked as its own too):

- W1 no stuck workflow: each settled, with an empty pending set;
- W2 outcomes: each ends in its shape's state, each member in its node's outcome (a
  ``cancel`` dependent of a dead parent cancelled, a ``skip`` one skipped, a
  ``run_anyway`` one completed), and the counts on its row are its members' outcomes;
- W3 every callback exactly once: one callback job per event that was due (none for an
  event that was not), and it completed;
- W4 never early: each callback began after every member had ended (a nested workflow's
  end: when it settled; members added while running included), and saw no member
  pending (``ctx.workflow()``);
- W5 dependents after their parents: each dependent began after each parent ended, and
  a dependent a failed parent cancelled or skipped never ran;
- W6 nested workflows: each nested member is a workflow of its node's shape, settled
  (with its own callbacks, W3) no later than its parent, and counted in its parent as its
  state says (succeeded: completed, failed: dead);
- W7 members added while running: exactly those of the attempt that completed (a
  failed or lost attempt adds none), each completed.
"""

from __future__ import annotations

import functools
import json
import math
import random
import re
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import soak_app

import errands

from .records import Findings, Run
from .store import Store, as_json

PREFIX = "soak-wf"
EVENTS = ("on_success", "on_settled", "on_dead")
DAG_SHAPES = ("chain", "diamond", "failing", "nested", "nestedfail", "grow", "fan")
DEAD_BATCH_EVERY = 5  # every 5th batch has one member that dies (a failed batch)
GROW_ADDS = 3  # members soak.wf_grow adds to its own workflow (soak_app)
ADDED_NODE = "soak.fast"  # the node name of the members it adds (their job's name)
NESTED_OUTCOME = {"succeeded": "completed", "failed": "dead", "cancelled": "cancelled"}


@dataclass(frozen=True)
class Sizes:
    """How many workflows a run carries, spread over it: ``batches`` batches of
    ``batch_size`` members and ``dags`` DAGs (round :data:`DAG_SHAPES`)."""

    batches: int
    batch_size: int
    dags: int

    def jobs(self) -> int:
        """About how many member and callback jobs they make (to pace the mix)."""
        dag_jobs = sum(_jobs(shape_of(s)) for s in DAG_SHAPES) / len(DAG_SHAPES)
        return round(self.batches * (self.batch_size + 2) + self.dags * dag_jobs)

    def callbacks(self) -> int:
        """About how many callbacks fire (on_settled always, on_success or on_dead)."""
        return round(2 * self.batches + 2.5 * self.dags)


@dataclass(frozen=True)
class Shape:
    """A workflow shape: its nodes (name, job kind, parents with policies), the state it
    must settle in, and each node's outcome. A node of kind ``wf:<shape>`` is a nested
    workflow of that shape; ``added``: members its ``grow`` node adds while it runs."""

    nodes: tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...]
    state: str
    outcomes: dict[str, str]
    batch: bool = False
    added: int = 0


def _batch(size: int, dead: bool = False) -> Shape:
    kinds = ["flaky" if i % 3 == 1 else "fast" for i in range(size)]
    if dead:
        kinds[-1] = "doomed"
    outcome = {"fast": "completed", "flaky": "completed", "doomed": "dead"}
    return Shape(
        tuple((f"m{i}", kind, ()) for i, kind in enumerate(kinds)),
        "failed" if dead else "succeeded",
        {f"m{i}": outcome[kind] for i, kind in enumerate(kinds)},
        batch=True,
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
    # a nested batch: its members, then its own callbacks, then the node after it
    "inner": _batch(3),
    "nested": Shape(
        (("inner", "wf:inner", ()), ("after", "fast", (("inner", "cancel"),))),
        "succeeded",
        {"inner": "completed", "after": "completed"},
    ),
    # a nested batch that fails: a dead member of its parent, each policy after it
    "innerdead": _batch(3, dead=True),
    "nestedfail": Shape(
        (
            ("inner", "wf:innerdead", ()),
            ("cancelled", "fast", (("inner", "cancel"),)),
            ("skipped", "fast", (("inner", "skip"),)),
            ("anyway", "fast", (("inner", "run_anyway"),)),
        ),
        "failed",
        {"inner": "dead", "cancelled": "cancelled", "skipped": "skipped", "anyway": "completed"},
    ),
    # a batch whose member adds members (its first attempt adds them, then fails)
    "grow": Shape(
        (("seed", "grow", ()), ("m1", "fast", ())),
        "succeeded",
        {"seed": "completed", "m1": "completed"},
        batch=True,
        added=GROW_ADDS,
    ),
    # a wide fan-out / fan-in
    "fan": Shape(
        (
            ("root", "fast", ()),
            *(
                (f"m{i}", "flaky" if i % 4 == 1 else "fast", (("root", "cancel"),))
                for i in range(8)
            ),
            ("sink", "fast", tuple((f"m{i}", "cancel") for i in range(8))),
        ),
        "succeeded",
        {"root": "completed", "sink": "completed", **{f"m{i}": "completed" for i in range(8)}},
    ),
}


@functools.cache
def shape_of(key: str) -> Shape:
    """The shape a workflow's name carries: one of :data:`SHAPES`, or ``batch<N>`` /
    ``batchdead<N>`` (a batch of N members; the dead one's last member dies)."""
    if key in SHAPES:
        return SHAPES[key]
    found = re.fullmatch(r"(batch|batchdead)(\d+)", key)
    if found is None:
        raise KeyError(key)
    return _batch(int(found[2]), dead=found[1] == "batchdead")


def _key(name: Any) -> str:
    return str(name).split("-")[2]


def _jobs(shape: Shape) -> int:
    """Its jobs: members (nested ones' too, members added) and about two callbacks."""
    nested = sum(_jobs(shape_of(k[3:])) for _, k, _ in shape.nodes if k.startswith("wf:"))
    return len(shape.nodes) + shape.added + nested + 2


def due_events(shape: Shape) -> set[str]:
    failed = any(o in ("dead", "cancelled") for o in shape.outcomes.values())
    died = "dead" in shape.outcomes.values()
    return {"on_settled"} | ({"on_dead"} if died else set()) | (set() if failed else {"on_success"})


def build(key: str, seq: int, rng: random.Random) -> errands.Workflow:
    """The workflow ``soak-wf-<shape>-<seq>`` with every callback (members without keys:
    a workflow's members are new jobs); a nested one is ``soak-wf-<its shape>-<seq>``."""
    shape = shape_of(key)
    name = f"{PREFIX}-{key}-{seq}"
    callbacks = {e: soak_app.wf_callback.bind(event=e) for e in EVENTS}
    wf: errands.Workflow = (
        errands.Batch(name, **callbacks) if shape.batch else errands.Workflow(name, **callbacks)
    )
    nodes: dict[str, errands.Node] = {}
    for node, kind, parents in shape.nodes:
        after = [errands.Edge(nodes[p], policy) for p, policy in parents]
        member = build(kind[3:], seq, rng) if kind.startswith("wf:") else _member(kind, seq, rng)
        nodes[node] = wf.add(member, after=after, name=node)
    return wf


def _member(kind: str, seq: int, rng: random.Random) -> errands.BoundJob:
    if kind == "flaky":
        return soak_app.flaky.bind(n=seq, fail_times=1)
    if kind == "doomed":
        return soak_app.doomed.bind(n=seq)
    if kind == "grow":
        return soak_app.wf_grow.bind(n=seq, adds=GROW_ADDS)
    if kind == "delayed":  # its delay counts from its release
        return soak_app.fast.bind(n=seq, delay=round(rng.uniform(0.1, 0.5), 2))
    return soak_app.fast.bind(n=seq)


class WorkflowFeed:
    """What the workload thread calls between its batches of the mix: the workflows due
    by then, so that ``sizes``' batches and DAGs are spread evenly over the mix."""

    def __init__(
        self,
        app: errands.App,
        rng: random.Random,
        retrying: Callable[[Callable[[], Any]], Any],
        next_seq: Callable[[], int],
        enqueued: dict[int, str],
        sizes: Sizes,
    ) -> None:
        self.app = app
        self.rng = rng
        self.retrying = retrying
        self.next_seq = next_seq
        self.enqueued = enqueued  # acknowledged: workflow id -> shape (the ledger's)
        self.sizes = sizes
        self.batches = 0
        self.dags = 0

    def after_batch(self, progress: float) -> None:
        """``progress``: the share of the mix enqueued so far (1.0: all of it)."""
        share = min(max(progress, 0.0), 1.0)
        due_batches = math.ceil(self.sizes.batches * share - 1e-9)
        due_dags = math.ceil(self.sizes.dags * share - 1e-9)
        while self.batches < due_batches or self.dags < due_dags:
            # interleaved: whichever kind is further behind its share goes next
            if self.dags >= due_dags or (
                self.batches < due_batches
                and self.batches / max(self.sizes.batches, 1) <= self.dags / max(self.sizes.dags, 1)
            ):
                self.batches += 1
                dead = self.batches % DEAD_BATCH_EVERY == 0
                self.enqueue_one(f"batch{'dead' if dead else ''}{self.sizes.batch_size}")
            else:
                self.enqueue_one(DAG_SHAPES[self.dags % len(DAG_SHAPES)])
                self.dags += 1

    def enqueue_one(self, key: str) -> None:
        wf = build(key, self.next_seq(), self.rng)
        handle = self.retrying(lambda: self.app.enqueue_workflow(wf))
        self.enqueued[handle.id] = key


# -- the checks -------------------------------------------------------------------------------
@dataclass
class Member:
    job_id: int  # minus the workflow's id for a nested workflow
    node: str
    outcome: str | None
    state: str | None
    finished_at: float | None  # a nested workflow's: when it settled


@dataclass
class Snapshot:
    """What the store holds of workflows once the run drained."""

    # workflow id -> (name, state, completed, dead, cancelled, skipped, total)
    flows: dict[int, tuple[Any, ...]]
    members: dict[int, list[Member]]  # by workflow id
    pending: Counter[int]  # rows left in each workflow's pending set
    callbacks: dict[tuple[int, str], list[tuple[int, str]]]  # (wf, event) -> (job, state)
    settled: dict[int, float | None] = field(default_factory=dict)  # workflow id -> settled_at


def load(store: Store) -> Snapshot:
    e = store.epoch
    flows, settled = {}, {}
    for r in store.query(
        "SELECT id, name, state, completed, dead, cancelled, skipped, total, "
        f"{e('settled_at')} FROM {{s}}errands_workflows"
    ):
        flows[int(r[0])] = r[1:8]
        settled[int(r[0])] = None if r[8] is None else float(r[8])
    members: dict[int, list[Member]] = defaultdict(list)
    for wf, job_id, node, outcome, state, finished in store.query(
        f"SELECT m.workflow_id, m.job_id, m.node, m.outcome, j.state, {e('j.finished_at')} "
        "FROM {s}errands_workflow_members AS m LEFT JOIN {s}errands_jobs AS j ON j.id = m.job_id"
    ):
        job_id = int(job_id)
        if job_id < 0:  # a nested workflow: it ended in its parent when it settled
            finished = settled.get(-job_id)
        members[int(wf)].append(Member(job_id, node, outcome, state, finished))
    pending = Counter(
        int(r[0]) for r in store.query("SELECT workflow_id FROM {s}errands_workflow_pending")
    )
    callbacks: dict[tuple[int, str], list[tuple[int, str]]] = defaultdict(list)
    for job_id, meta, state in store.query(
        "SELECT id, meta, state FROM {s}errands_jobs WHERE name = 'soak.wf_callback'"
    ):
        cb = (as_json(meta) or {}).get("workflow_callback") or {}
        callbacks[(int(cb.get("workflow", 0)), str(cb.get("event")))].append((job_id, state))
    return Snapshot(flows, members, pending, callbacks, settled)


def check(
    out: Findings,
    store: Store,
    enqueued: dict[int, str],
    by_job: dict[int, list[Run]],
) -> None:
    verify(out, load(store), enqueued, by_job)


WHAT = {
    "W1": "workflow(s) stuck (not settled, or members still pending)",
    "W2": "workflow(s) whose state or members' outcomes are not their shape's",
    "W2 counts": "workflow(s) whose counts are not their members' outcomes",
    "W3": "callback(s) not fired exactly once, or not completed",
    "W4": "callback(s) that began before every member had ended",
    "W5": "dependent(s) that ran before a parent ended, or that should not run",
    "W6": "nested workflow(s) not settled, of the wrong shape or outcome in their parent, "
    "or settled after it",
    "W7": "workflow(s) whose members added while running are not exactly those of the "
    "attempt that completed, or did not all complete",
}


def verify(
    out: Findings, snap: Snapshot, enqueued: dict[int, str], by_job: dict[int, list[Run]]
) -> None:
    flows, members, pending, callbacks = snap.flows, snap.members, snap.pending, snap.callbacks
    ours = {i: row for i, row in flows.items() if str(row[0]).startswith(PREFIX + "-")}
    missing = sorted(set(enqueued) - set(ours))
    if missing:
        out.fail("W1", f"{len(missing)} acknowledged workflow(s) missing from the store", missing)
    problems: dict[str, list[Any]] = defaultdict(list)
    for wf, (name, state, completed, dead, cancelled, skipped, total) in sorted(ours.items()):
        shape = shape_of(_key(name))
        mine = members[wf]
        if state == "running" or pending[wf]:
            problems["W1"].append((wf, name, state, pending[wf]))
            continue
        declared = {node for node, _, _ in shape.nodes}
        outcomes = {m.node: m.outcome for m in mine if m.node in declared}
        named = Counter(m.node for m in mine if m.node in declared)
        if state != shape.state or outcomes != shape.outcomes or max(named.values(), default=0) > 1:
            problems["W2"].append((wf, name, state, outcomes))
        added = [m for m in mine if m.node not in declared]
        if len(added) != shape.added or any(
            m.node != ADDED_NODE or m.outcome != "completed" for m in added
        ):
            problems["W7"].append((wf, name, [(m.job_id, m.node, m.outcome) for m in added]))
        counts = Counter(m.outcome for m in mine)
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
        problems["W6"].extend(_nested(wf, shape, mine, snap))
    _figures(out, snap, ours, enqueued, len(missing) + len(problems["W1"]))
    for invariant, found in sorted(problems.items()):
        if found:
            out.fail(invariant.split()[0], f"{len(found)} {WHAT[invariant]}", found)


def _figures(
    out: Findings, snap: Snapshot, ours: dict[int, Any], enqueued: dict[int, str], stuck: int
) -> None:
    shapes = Counter(re.sub(r"\d+$", "", _key(row[0])) for row in ours.values())
    nested = {-m.job_id for wf in ours for m in snap.members.get(wf, []) if m.job_id < 0}
    out.figures["workflows (acknowledged / stored)"] = (
        f"{len(enqueued)} / {len(set(ours) - nested)} (+ {len(nested)} nested)"
    )
    out.figures["workflows by shape"] = dict(sorted(shapes.items()))
    out.figures["workflow states"] = dict(Counter(str(row[1]) for row in ours.values()))
    jobs = [m for wf in ours for m in snap.members.get(wf, []) if m.job_id > 0]
    expected = sum(_members(shape_of(key)) for key in enqueued.values())
    ended = sum(1 for m in jobs if m.outcome is not None)
    out.figures["workflow members (expected / enqueued / ended)"] = (
        f"{expected} / {len(jobs)} / {ended}"
    )
    fired = Counter(
        event for (wf, event), jobs_ in snap.callbacks.items() if wf in ours for _ in jobs_
    )
    out.figures["workflow callbacks fired"] = {e: fired[e] for e in EVENTS}
    out.figures["workflows stuck"] = stuck


def _members(shape: Shape) -> int:
    """The member jobs of an acknowledged workflow (nested ones' and those added too)."""
    nested = sum(_members(shape_of(k[3:])) for _, k, _ in shape.nodes if k.startswith("wf:"))
    jobs = sum(1 for _, k, _ in shape.nodes if not k.startswith("wf:"))
    return jobs + shape.added + nested


def _nested(wf: int, shape: Shape, mine: list[Member], snap: Snapshot) -> list[Any]:
    """W6: each nested member is a workflow of the shape its node says, settled no later
    than its parent, counted in it as its state says."""
    kinds = {node: kind for node, kind, _ in shape.nodes}
    wrong: list[Any] = []
    for m in mine:
        kind = kinds.get(m.node, "")
        if (m.job_id < 0) != kind.startswith("wf:"):
            wrong.append((wf, m.node, "nested?", m.job_id))
            continue
        if m.job_id > 0:
            continue
        child = snap.flows.get(-m.job_id)
        if child is None:
            wrong.append((wf, m.node, "missing", -m.job_id))
            continue
        settled, parent_settled = snap.settled.get(-m.job_id), snap.settled.get(wf)
        if (
            _key(child[0]) != kind[3:]
            or m.outcome != NESTED_OUTCOME.get(str(child[1]))
            or settled is None
            or parent_settled is None
            or settled > parent_settled
        ):
            wrong.append((wf, m.node, -m.job_id, child[:2], m.outcome, settled, parent_settled))
    return wrong


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
