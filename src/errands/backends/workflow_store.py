"""Workflows in the store: the statement programs of batches, chains and DAGs, written
once over each backend's named queries (``workflows.sql``) and run on either backend.

The fan-in (:meth:`WorkflowStore.fan_in`) runs inside the transaction of every write that
can end a member (a worker's finish, ``ctx.transaction()``'s commit, a rescue, a release
or suspension that ends a cancel-requested job, an operator's cancel, a signal wait that
times out to dead): members leave the workflow's *set* of pending members
(``errands_workflow_pending``, one row each) in the same transaction as their own
fenced terminal write, and the transaction that empties the set inserts the callbacks,
each guarded by a column set once under the workflow's row lock. A second delivery of
the same outcome finds the member gone from the set and changes nothing; a stale attempt
never gets its terminal write, so never reaches the fan-in.

The fan-in is set-based: the members a finish ends leave the set, are counted and resolve
their edges in one statement each, and the dependents they free are decided, released
or cancelled in one statement each, so a finish costs a handful of statements whether it
ends one member or 500, and a root's end releases 10,000 dependents as cheaply.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

from ..errors import ConfigurationError
from ..faults import fault_point
from ..jobs import EnqueueRequest
from .base import FinishParams, InsertResult
from .program import Program, Stmt

KINDS = ("batch", "dag")
POLICIES = ("cancel", "run_anyway", "skip")
EVENTS = ("on_success", "on_settled", "on_dead")
ENDED = frozenset({"completed", "dead", "cancelled", "discarded"})
# A member's outcome in its workflow (a discarded job counts as dead); the counts' columns.
OUTCOMES = ("completed", "dead", "cancelled", "skipped")
CANCELLABLE = frozenset({"available", "scheduled", "retryable", "waiting"})
FAILED = frozenset({"dead", "cancelled"})
# a nested workflow's settled state -> its outcome as a member of its parent
NESTED_OUTCOME = {"succeeded": "completed", "failed": "dead", "cancelled": "cancelled"}

# ctx.add_to_workflow marks the child requests it adds with this meta key (they travel
# with the completion as ctx.enqueue's children do); the store takes them apart.
WORKFLOW_ADD = "workflow_add"
# Why a member that never ran was cancelled with its workflow (in its errors).
CANCELLED_WHY = "the workflow was cancelled"
# A dependent's own delay, counted from its release (see release_delay).
RELEASE_DELAY = "release_delay"
# Below every member id: nested workflows are members with negative ids (minus their own).
FIRST = -(2**62)

InsertJobs = Callable[[Sequence[EnqueueRequest]], Program[list[InsertResult]]]
# Members without keys written already joined to their workflow (workflow_id set, the
# dependents at the given indexes 'waiting'): a sync bulk path (PostgreSQL's COPY).
InsertJoined = Callable[[Sequence[EnqueueRequest], int, Sequence[int]], Program[list[InsertResult]]]
Notify = Callable[[set[str]], Program[None]]


class ReleaseWakeup(Protocol):
    """A store whose release of dependents sends their wake-up itself (PostgreSQL)."""

    def params(self) -> dict[str, Any]:
        """The release statement's wake-up parameters (its channel, what to skip)."""
        ...

    def sent(self, queues: set[str]) -> None:
        """The release statement ran, these queues released: record the wake-ups."""
        ...


@dataclass(frozen=True)
class NodeSpec:
    """One member to insert: its node name, job, and parents (indexes into the spec)."""

    node: str
    request: EnqueueRequest | None  # None for a nested workflow
    after: tuple[int, ...] = ()
    policies: tuple[str, ...] = ()  # one per parent
    child: WorkflowSpec | None = None  # a nested workflow: a member that ends as it settles


@dataclass(frozen=True)
class WorkflowSpec:
    name: str
    kind: str
    nodes: Sequence[NodeSpec]
    callbacks: dict[str, EnqueueRequest] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkflowInserted:
    id: int
    jobs: list[InsertResult]  # the job members', in node order
    children: dict[int, WorkflowInserted] = field(default_factory=dict)  # by node index


@dataclass(frozen=True)
class Settled:
    """A workflow a transaction settled (or, after replays, turned succeeded)."""

    id: int
    name: str
    kind: str
    state: str
    fired: list[str]  # the callbacks it inserted


@dataclass(frozen=True)
class OrphanedCallback:
    """A dead callback's workflow and event, that workflow no longer stored."""

    workflow_id: int
    event: str


@dataclass(frozen=True)
class WorkflowRow:
    id: int
    name: str
    kind: str
    state: str  # running, succeeded, failed, cancelled
    total: int
    completed: int
    dead: int
    cancelled: int
    skipped: int
    callbacks: str  # JSON: event -> the callback's stored request
    on_success_job: int | None
    on_settled_job: int | None
    on_dead_job: int | None
    cancel_requested: bool
    created_at: float
    settled_at: float | None

    @property
    def pending(self) -> int:
        return self.total - self.completed - self.dead - self.cancelled - self.skipped


@dataclass(frozen=True)
class MemberRow:
    job_id: int
    node: str
    name: str | None  # None once the job's row was pruned
    state: str | None
    outcome: str | None  # None while pending; completed, dead, cancelled, skipped
    parents: list[int]


@dataclass(frozen=True)
class ParentResultRow:
    job_id: int
    node: str
    state: str | None
    result_json: str | None
    size: int


def split_children(
    outcome: FinishParams,
) -> tuple[list[EnqueueRequest], list[EnqueueRequest]]:
    """A completion's children: plain ones (ctx.enqueue), and members it adds to its own
    workflow (``workflow_adds`` and the children ctx.add_to_workflow marked)."""
    plain: list[EnqueueRequest] = []
    adds = list(outcome.workflow_adds)
    for child in outcome.children:
        if child.meta.get(WORKFLOW_ADD):
            meta = {k: v for k, v in child.meta.items() if k != WORKFLOW_ADD}
            adds.append(replace(child, meta=meta))
        else:
            plain.append(child)
    return plain, adds


def release_delay(request: EnqueueRequest) -> dict[str, float]:
    """A dependent's ``delay=`` counts from its release (when its last parent ends), not
    from its insert: the meta key ``release_delay`` carries it to ``wf_release``, which
    makes the dependent scheduled that long after. A ``run_at=`` is kept as is (the
    dependent then runs at its release or at ``run_at``, whichever is later)."""
    if request.run_at is None and request.delay > 0:
        return {RELEASE_DELAY: float(request.delay)}
    return {}


def request_to_json(request: EnqueueRequest) -> dict[str, Any]:
    return asdict(request)


def request_from_json(data: dict[str, Any]) -> EnqueueRequest:
    return EnqueueRequest(**data)


def workflow_row(r: Sequence[Any]) -> WorkflowRow:
    return WorkflowRow(
        id=int(r[0]), name=r[1], kind=r[2], state=r[3], total=int(r[4]), completed=int(r[5]),
        dead=int(r[6]), cancelled=int(r[7]), skipped=int(r[8]), callbacks=r[9] or "{}",
        on_success_job=r[10], on_settled_job=r[11], on_dead_job=r[12],
        cancel_requested=bool(r[13]), created_at=float(r[14]),
        settled_at=None if r[15] is None else float(r[15]),
    )  # fmt: skip


def verdict(edges: Iterable[Sequence[Any]]) -> str:
    """What a dependent whose parents all ended does: ``run``, ``cancel`` or ``skip``.

    A parent that died or was cancelled is a failed parent; a skipped one is not. Policy
    ``cancel`` on any failed parent cancels; else ``skip`` on any failed parent skips;
    else (no failure, or ``run_anyway``) the dependent runs."""
    policies = {policy for _, policy, outcome in edges if outcome in FAILED}
    if "cancel" in policies:
        return "cancel"
    if "skip" in policies:
        return "skip"
    return "run"


def check_keys(where: str, members: Iterable[tuple[str, EnqueueRequest]]) -> None:
    """Refuse members stored together that share a job name and ``key=``: the second
    would be the first (keys are unique per job name), and the store's refusal named the
    sibling just written in the same transaction as a job "already stored"."""
    seen: dict[tuple[str, str], str] = {}
    for node, request in members:
        if request.key is None:
            continue
        first = seen.get((request.name, request.key))
        seen[request.name, request.key] = node
        if first is not None:
            raise ConfigurationError(
                f"{where}: members {first!r} and {node!r} have the same key= "
                f"{request.key!r} (job {request.name}); a key names one job. Give each "
                "member its own key=, or drop the key= of members"
            )


def spec_members(spec: WorkflowSpec, prefix: str = "") -> list[tuple[str, EnqueueRequest]]:
    """Every job member of ``spec`` and of the workflows nested in it, by node path."""
    found: list[tuple[str, EnqueueRequest]] = []
    for node in spec.nodes:
        if node.request is not None:
            found.append((prefix + node.node, node.request))
        if node.child is not None:
            found += spec_members(node.child, f"{prefix}{node.node}/")
    return found


class WorkflowStore:
    """The workflow programs of one backend: its named queries ``q``, how it inserts jobs
    in a transaction (``insert``), binds a list (``array``) and wakes workers (``notify``)."""

    def __init__(
        self,
        q: dict[str, str],
        insert: InsertJobs,
        array: Callable[[list[Any]], Any],
        notify: Notify | None = None,
        insert_joined: InsertJoined | None = None,
        rows: Callable[[list[list[Any]]], Any] | None = None,
        release_wakeup: ReleaseWakeup | None = None,
    ) -> None:
        self.q = q
        # Where the release of dependents NOTIFYs their queues in its own statement
        # (PostgreSQL): the wake-up's parameters for that statement, asked before it, and
        # what to call with the queues it released; else ``notify`` wakes them after.
        self.release_wakeup = release_wakeup
        self.insert_jobs = insert
        self.array = array
        self.notify = notify
        self.insert_joined = insert_joined
        self.rows = rows
        self._local = threading.local()

    def columns(self, **columns: Sequence[Any]) -> dict[str, Any]:
        """Parallel lists as a statement's parameters: one array each (PostgreSQL's
        unnest takes them side by side), or, given ``rows``, one parameter ``rows`` holding
        them row by row in the order given (SQLite: a join of one json_each per list on its
        key has no index, and costs the product of their lengths)."""
        if self.rows is not None:
            return {"rows": self.rows([list(r) for r in zip(*columns.values(), strict=True)])}
        return {name: self.array(list(values)) for name, values in columns.items()}

    def take_settled(self) -> list[Settled]:
        """The workflows this thread's transactions settled since the last call (a backend
        clears the list when a finish starts; the caller reads it once that committed)."""
        settled = getattr(self._local, "settled", [])
        self._local.settled = []
        return list(settled)

    def _settled(self, row: WorkflowRow, state: str, fired: list[str]) -> None:
        if not hasattr(self._local, "settled"):
            self._local.settled = []
        self._local.settled.append(Settled(row.id, row.name, row.kind, state, fired))

    def take_released(self) -> set[str]:
        """The queues into which this thread's fan-ins since the last call released
        dependents or inserted callbacks (read once the transaction committed: a worker
        that serves one of them claims at once, without waiting for its wake-up)."""
        released: set[str] = getattr(self._local, "released", set())
        self._local.released = set()
        return set(released)

    def _released(self, queues: set[str]) -> None:
        if not hasattr(self._local, "released"):
            self._local.released = set()
        self._local.released.update(queues)

    def forget(self) -> None:
        """A write starts on this thread: what fan-ins did before it is not its own."""
        self.take_fanned()
        self.take_settled()
        self.take_released()

    def mark(self) -> tuple[int, frozenset[str], bool]:
        """Where this thread's reports stand now, for :meth:`back_to`."""
        local = self._local
        return (
            len(getattr(local, "settled", [])),
            frozenset(getattr(local, "released", set())),
            bool(getattr(local, "fanned", False)),
        )

    def back_to(self, mark: tuple[int, frozenset[str], bool]) -> None:
        """Drop what this thread's fan-ins reported since ``mark``: a transaction rolled
        back (it never happened), keeping what earlier writes committed and have yet to
        report (:meth:`forget` dropped those too)."""
        settled, released, fanned = mark
        local = self._local
        local.settled = getattr(local, "settled", [])[:settled]
        local.released = set(released)
        local.fanned = fanned

    def take_fanned(self) -> bool:
        """Whether a fan-in ran in this thread since the last call (the backends' finish
        reaches fault point ``after_fan_in_commit`` once its transaction committed)."""
        fanned = getattr(self._local, "fanned", False)
        self._local.fanned = False
        return bool(fanned)

    # -- inserting ---------------------------------------------------------------------
    def insert(self, spec: WorkflowSpec, *, bulk: bool = False) -> Program[WorkflowInserted]:
        """The workflow row, its members (dependents waiting), edges and pending set.
        ``bulk``: the connection is sync, so the store's bulk path may write the members
        already joined (``insert_joined``: no second write of every member's row)."""
        check_keys(f"workflow {spec.name!r}", spec_members(spec))
        return (yield from self._insert(spec, bulk))

    def _insert(self, spec: WorkflowSpec, bulk: bool) -> Program[WorkflowInserted]:
        q = self.q
        callbacks = {event: request_to_json(r) for event, r in spec.callbacks.items()}
        rows = yield Stmt(
            q["wf_insert"],
            {
                "name": spec.name,
                "kind": spec.kind,
                "total": len(spec.nodes),
                "callbacks": json.dumps(callbacks, separators=(",", ":")),
            },
        )
        workflow_id = int(rows[0][0])
        # A nested workflow is a member whose id is minus its workflow id (job ids are
        # positive): it is pending in this one until it settles (see _leave_parent).
        ids: list[int] = [0] * len(spec.nodes)
        children: dict[int, WorkflowInserted] = {}
        for i, node in enumerate(spec.nodes):
            if node.child is not None:
                children[i] = yield from self._insert(node.child, bulk)
                ids[i] = -children[i].id
        jobs = [i for i, n in enumerate(spec.nodes) if n.request is not None]
        results = yield from self._members(
            workflow_id,
            [n.request for n in spec.nodes if n.request is not None],
            [spec.nodes[i].node for i in jobs],
            blocked=[k for k, i in enumerate(jobs) if spec.nodes[i].after],
            bulk=bulk,
        )
        for i, result in zip(jobs, results, strict=True):
            ids[i] = result.id
        if children:
            nested = {"workflow_id": workflow_id, "ids": self.array([ids[i] for i in children])}
            names = self.columns(
                ids=[ids[i] for i in children], nodes=[spec.nodes[i].node for i in children]
            )
            yield Stmt(q["wf_members_insert"], {"workflow_id": workflow_id, **names})
            yield Stmt(q["wf_pending_insert"], nested)
        parents, dependents, policies = [], [], []
        for i, node in enumerate(spec.nodes):
            for parent, policy in zip(node.after, node.policies, strict=True):
                parents.append(ids[parent])
                dependents.append(ids[i])
                policies.append(policy)
        if parents:
            yield Stmt(
                q["wf_edges_insert"],
                {
                    "workflow_id": workflow_id,
                    **self.columns(parents=parents, children=dependents, policies=policies),
                },
            )
        return WorkflowInserted(workflow_id, results, children)

    def add(self, workflow_id: int, requests: Sequence[EnqueueRequest]) -> Program[None]:
        """Members a running member adds to its own workflow (with its completion, before
        it leaves the pending set: the workflow cannot settle in between)."""
        if not requests:
            return
        check_keys(
            f"ctx.add_to_workflow (workflow {workflow_id})",
            [(f"#{i + 1} ({r.name})", r) for i, r in enumerate(requests)],
        )
        # Its workflow and those it is nested in, locked first, in id order, as the fan-in
        # after it locks them: counted first, a nested workflow's row was held while its
        # parent's was waited for, and a fan-in of a sibling held the parent's and waited.
        locked = yield from self._lock_up((), [workflow_id])
        if workflow_id not in locked:
            # Pruned (the adder is a dead member replayed since, which runs on its own):
            # what it adds runs on its own too, as jobs outside any workflow.
            yield from self.insert_jobs(requests)
            return
        # Its cancel (or that of one it is nested in) was requested: nothing more runs in
        # it. The members are added cancelled (listed, counted, never run); it settles
        # cancelled as it would have.
        cancelled = list(range(len(requests))) if any(locked.values()) else []
        added = yield from self._members(
            workflow_id, requests, [r.name for r in requests], blocked=cancelled
        )
        yield Stmt(self.q["wf_add_total"], {"id": workflow_id, "n": len(requests)})
        if cancelled:
            yield from self._stop([(r.id, "cancel", CANCELLED_WHY) for r in added])
            yield from self.fan_in([r.id for r in added])

    def lock_fan_in(self, job_ids: Sequence[int]) -> Program[None]:
        """Lock now, in one statement, what ``fan_in(job_ids)`` locks first: a batch of
        finishes some of which add members (``add``, which locks its own workflows) then
        takes every lock of its fan-in in id order, not one workflow's ahead of others."""
        yield Stmt(self.q["wf_lock_pending"], {"ids": self.array(list(job_ids))})

    def _members(
        self,
        workflow_id: int,
        requests: Sequence[EnqueueRequest],
        nodes: Sequence[str],
        blocked: Sequence[int],
        bulk: bool = False,
    ) -> Program[list[InsertResult]]:
        q = self.q
        if not requests:
            return []
        waits = set(blocked)
        tagged = [
            replace(
                r,
                meta={
                    **r.meta,
                    "workflow": workflow_id,
                    "node": node,
                    **(release_delay(r) if i in waits else {}),
                },
            )
            for i, (r, node) in enumerate(zip(requests, nodes, strict=True))
        ]
        joined = (
            bulk
            and self.insert_joined is not None
            and len(tagged) > 1
            and all(r.key is None for r in tagged)
        )
        if joined and self.insert_joined is not None:
            results = yield from self.insert_joined(tagged, workflow_id, blocked)
        else:
            results = yield from self.insert_jobs(tagged)
        for node, result in zip(nodes, results, strict=True):
            if result.deduplicated:
                raise ConfigurationError(
                    f"workflow member {node!r}: its key= matches job {result.id}, already "
                    "stored; a workflow's members are new jobs. Drop the key= of members (give "
                    "the workflow a unique name instead), or wait for that job"
                )
        ids = [r.id for r in results]
        params = {"workflow_id": workflow_id, "ids": self.array(ids)}
        yield Stmt(
            q["wf_members_insert"],
            {"workflow_id": workflow_id, **self.columns(ids=ids, nodes=list(nodes))},
        )
        yield Stmt(q["wf_pending_insert"], params)
        if not joined:
            blocked_ids = self.array([ids[i] for i in blocked])
            yield Stmt(q["wf_jobs_join"], {**params, "blocked": blocked_ids})
        return results

    # -- the fan-in -------------------------------------------------------------------
    def fan_in(self, job_ids: Sequence[int]) -> Program[None]:
        """Run in the transaction that just wrote these jobs' outcomes (any job: those not
        pending in a workflow are ignored at the cost of one index probe)."""
        q = self.q
        ids = list(dict.fromkeys(job_ids))
        if not ids:
            return
        # The workflows these jobs are pending in, with those they are nested in, locked
        # (in id order, as every writer takes them); none: nothing to do (a job outside
        # workflows, a second delivery of an end already counted).
        rows = yield Stmt(q["wf_lock_pending"], {"ids": self.array(ids)})
        if not rows:
            return
        fault_point("before_fan_in", job_ids=ids)
        self._local.fanned = True
        # One workflow locked: it is nested in none (its parents would be locked with it),
        # so when it settles there is no parent to look up.
        nested = len(rows) > 1
        cancelling = {int(r[0]) for r in rows if r[1]}
        dags = {int(r[0]) for r in rows if r[2] == "dag"}  # a batch has no edges to resolve
        work: list[tuple[int, str | None]] = [(i, None) for i in ids]
        queues: set[str] = set()
        while work:
            touched: dict[int, bool] = {}  # workflow -> a member died in this round
            rows_now: dict[int, Sequence[Any]] = {}  # each one's row, as its counts left it
            while work:  # the members given, then the dependents their ends cancel or skip
                work = yield from self._end_members(
                    work, cancelling, dags, touched, rows_now, queues
                )
            for workflow_id, died in sorted(touched.items()):
                state = yield from self._settle(workflow_id, died, rows_now.get(workflow_id))
                if state is not None and nested:  # settled now: a nested one ends in its parent
                    parent = yield from self._leave_parent(workflow_id, cancelling, dags)
                    if parent is not None:
                        work.append((-workflow_id, NESTED_OUTCOME[state]))
        if queues:
            self._released(queues)
            if self.notify is not None and self.release_wakeup is None:
                yield from self.notify(queues)

    def _end_members(
        self,
        batch: Sequence[tuple[int, str | None]],
        cancelling: set[int],
        dags: set[int],
        touched: dict[int, bool],
        rows_now: dict[int, Sequence[Any]],
        queues: set[str],
    ) -> Program[list[tuple[int, str | None]]]:
        """Members' ends, set-based (a handful of statements however many members end and
        however many dependents they have): out of the pending set, counted, their
        dependents decided. A member is a job id, or minus a nested workflow's id (then its
        outcome is given: ``(member, outcome)``). The dependents this cancels or skips are
        returned: they end in turn."""
        q, array = self.q, self.array
        given: dict[int, str | None] = {}
        for member, forced in batch:
            given.setdefault(member, forced)
        ended = yield from self._leave(given, rows_now)
        if not ended:
            return []
        # Jobs ended cancelled in a workflow whose cancel was requested (by the cancel, or
        # asked to stop by it while they ran): its cancel ended them, which their errors say
        # (the dependents and added members it cancelled say so already: left as they are).
        noted = [m for m, w, o in ended if m > 0 and o == "cancelled" and w in cancelling]
        if noted:
            yield Stmt(q["wf_note_cancelled"], {"ids": array(noted), "message": CANCELLED_WHY})
        for _, workflow_id, outcome in ended:
            touched[workflow_id] = touched.get(workflow_id, False) or outcome == "dead"
        parents = [(m, o) for m, w, o in ended if w in dags]
        if not parents:
            return []
        rows = yield from self._ready(parents)
        ready: dict[int, tuple[int, list[tuple[int, str, str | None]]]] = {}
        for child, workflow_id, parent, policy, outcome in rows:
            ready.setdefault(int(child), (int(workflow_id), []))[1].append(
                (int(parent), policy, outcome)
            )
        release: list[int] = []
        blocked: list[tuple[int, str, str]] = []  # dependent, decision, why
        for child, (workflow_id, edges) in sorted(ready.items()):
            if workflow_id in cancelling:
                blocked.append((child, "cancel", CANCELLED_WHY))
                continue
            decision = verdict(edges)
            if decision == "run":
                release.append(child)
                continue
            failed = ", ".join(str(p) for p, _, o in edges if o in FAILED)
            blocked.append((child, decision, f"parent job {failed} failed (policy {decision})"))
        if release:
            wakeup = self.release_wakeup
            params = {"ids": array(release), **(wakeup.params() if wakeup else {})}
            released = yield Stmt(q["wf_release_many"], params)
            woken = {str(r[0]) for r in released}
            if wakeup is not None:
                wakeup.sent(woken)
            queues.update(woken)
        if not blocked:
            return []
        stopped = yield from self._stop(blocked)
        return [(c, "skipped" if d == "skip" else None) for c, d, _ in blocked if c in stopped]

    def _stop(self, blocked: Sequence[tuple[int, str, str]]) -> Program[set[int]]:
        """Waiting members that will not run, ``(member, decision, why)``: cancelled, or
        skipped (decision ``skip``), each with its reason in its errors. Those stopped."""
        skip = [d == "skip" for _, d, _ in blocked]
        rows = yield Stmt(
            self.q["wf_end_blocked_many"],
            self.columns(
                ids=[c for c, _, _ in blocked],
                types=["Skipped" if s else "Cancelled" for s in skip],
                kinds=["skipped" if s else "cancelled" for s in skip],
                messages=[why for _, _, why in blocked],
            ),
        )
        return {int(r[0]) for r in rows}

    def _leave(
        self, given: dict[int, str | None], rows_now: dict[int, Sequence[Any]]
    ) -> Program[list[tuple[int, int, str]]]:
        """The members given that ended leave the set, once (a job still retrying stays
        pending; a second delivery of the same end finds its row gone), each with its
        outcome (``given``'s forced one, else its job's state; discarded counts as dead),
        counted in its workflow, whose row as the counts leave it goes to ``rows_now``.
        Returns (member, its workflow, its outcome), by member. One statement where the
        backend has ``wf_leave_count`` (PostgreSQL), three otherwise."""
        q, array = self.q, self.array
        ids, ends = array(list(given)), array(sorted(ENDED))
        ended: list[tuple[int, int, str]] = []  # member, its workflow, its outcome
        if "wf_leave_count" in q:
            forced = array([given[m] for m in given])
            counted = yield Stmt(q["wf_leave_count"], {"ids": ids, "forced": forced, "ended": ends})
            for r in counted:
                rows_now[int(r[0])] = r[:17]
                ended += [(int(m), int(r[0]), str(o)) for m, o in json.loads(r[17])]
            return sorted(ended)
        left = yield Stmt(q["wf_leave_ended"], {"ids": ids, "ended": ends})
        if not left:
            return []
        counts: dict[int, list[int]] = {}  # workflow -> completed, dead, cancelled, skipped
        for member, workflow_id, state in sorted((int(r[0]), int(r[1]), r[2]) for r in left):
            outcome = given[member] or ("dead" if state == "discarded" else str(state))
            ended.append((member, workflow_id, outcome))
            counts.setdefault(workflow_id, [0, 0, 0, 0])[OUTCOMES.index(outcome)] += 1
        yield Stmt(
            q["wf_member_outcomes"],
            self.columns(ids=[m for m, _, _ in ended], outcomes=[o for _, _, o in ended]),
        )
        workflows = sorted(counts)  # each locked already (wf_lock_pending)
        # The counts move; each workflow's row comes back as they left it, with whether a
        # member is still pending (what settling it needs: no read of its own).
        counted = yield Stmt(
            q["wf_count_many"],
            self.columns(
                ids=workflows,
                **{name: [counts[w][i] for w in workflows] for i, name in enumerate(OUTCOMES)},
            ),
        )
        rows_now.update((int(r[0]), r) for r in counted)
        return ended

    def _ready(self, parents: list[tuple[int, str]]) -> Program[list[Sequence[Any]]]:
        """The edges out of ``parents`` (members that just ended, with their outcomes)
        carry those outcomes; the dependents none of whose parents is still to end, with
        all their edges (read once, here): (child, workflow, parent, policy, outcome).
        One statement where the backend has ``wf_resolve_ready`` (PostgreSQL), two
        otherwise."""
        q = self.q
        edges = self.columns(parents=[m for m, _ in parents], outcomes=[o for _, o in parents])
        if "wf_resolve_ready" in q:
            rows: list[Sequence[Any]] = yield Stmt(q["wf_resolve_ready"], edges)
            return rows
        resolved = yield Stmt(q["wf_edges_resolve_many"], edges)
        children = sorted({int(r[0]) for r in resolved})
        if not children:
            return []
        rows = yield Stmt(q["wf_ready_edges"], {"children": self.array(children)})
        return rows

    def _lock_up(
        self, job_ids: Sequence[int], workflows: Sequence[int] = ()
    ) -> Program[dict[int, bool]]:
        """Lock ``workflows``, those ``job_ids`` are members of, and the workflows these
        are nested in, in id order: the one order every writer takes them in (no two
        transactions each hold one while waiting for the other's). Each one locked (those
        that exist), with whether its cancel was requested."""
        rows = yield Stmt(
            self.q["wf_lock_up"],
            {"ids": self.array(list(job_ids)), "workflows": self.array(list(workflows))},
        )
        return {int(r[0]): bool(r[1]) for r in rows}

    def _leave_parent(
        self, workflow_id: int, cancelling: set[int], dags: set[int]
    ) -> Program[int | None]:
        """A nested workflow that just settled: lock its parent (if it has one; the fan-in
        locked it already, with its own), which its end is then counted in. Its id."""
        rows = yield Stmt(self.q["wf_pending_of"], {"ids": self.array([-workflow_id])})
        if not rows:
            return None
        parent = int(rows[0][0])
        yield Stmt(self.q["wf_lock"], {"id": parent})
        [raw] = yield Stmt(self.q["wf_get_row"], {"id": parent})
        row = workflow_row(raw)
        if row.cancel_requested:
            cancelling.add(parent)
        if row.kind == "dag":
            dags.add(parent)
        return parent

    def _settle(
        self, workflow_id: int, died: bool, raw: Sequence[Any] | None = None
    ) -> Program[str | None]:
        """Fire ``on_dead`` on a first death; when the pending set is empty, settle the
        workflow and fire its callbacks. The state it settled in now (or, settled before,
        is in once its replayed members ended again), else None. ``raw``: its row as this
        transaction's last count left it (``wf_settle_row``'s columns), else read here."""
        q = self.q
        if raw is None:
            [raw] = yield Stmt(q["wf_settle_row"], {"id": workflow_id})
        row, pending = workflow_row(raw), bool(raw[16])  # and whether a member is pending
        callbacks = json.loads(row.callbacks)
        fired: dict[str, int] = {}  # event -> the callback job inserted now
        if died and row.on_dead_job is None and "on_dead" in callbacks:
            fired["on_dead"] = yield from self._fire(row, "on_dead", callbacks["on_dead"])
        state: str | None = None  # the state it settles in now (None: unchanged)
        if not pending:
            failed = row.dead + row.cancelled > 0
            if row.settled_at is None:
                # A cancelled workflow settles cancelled, whatever its members' outcomes (a
                # cancel may land while every pending member runs, and each then complete):
                # on_settled fires, never on_success; a parent counts it cancelled.
                state = "cancelled" if row.cancel_requested else "failed" if failed else "succeeded"
                success = state == "succeeded"
                events = ["on_settled"] + (["on_success"] if success else [])
            elif row.cancel_requested:
                # Settled before, re-opened by a replay, and cancelled while a replayed
                # member was pending (its own cancel, or that of one it is nested in): it
                # settles cancelled again, whatever the replayed members' ends; no
                # callback fires (on_settled had), never on_success.
                state = None if row.state == "cancelled" else "cancelled"
                events = []
            elif row.state == "failed" and not failed:
                # Settled before: the members replayed since (see reenter) all ended again.
                state = "succeeded"
                events = [] if row.on_success_job is not None else ["on_success"]
            else:
                events = []
            for event in events:
                if event in callbacks:
                    fired[event] = yield from self._fire(row, event, callbacks[event])
        if state is not None or fired or not pending:
            # One write settles it (again, after a replay: its retention counts from now)
            # and records the callbacks: each column set once, under the workflow's lock
            # (the callbacks' exactly-once guard).
            yield Stmt(
                q["wf_settle_fire"],
                {
                    "id": workflow_id,
                    "state": state,
                    "settled": not pending,
                    **{e: fired.get(e) for e in EVENTS},
                },
            )
        if pending:
            return None
        if state is None:
            return row.state  # still failed: a nested one re-entered in its parent ends again
        self._settled(row, state, [e for e in fired if e != "on_dead"])
        return state

    def _fire(self, row: WorkflowRow, event: str, stored: dict[str, Any]) -> Program[int]:
        """Insert the ``event`` callback (keyed); its job id, for ``wf_settle_fire``."""
        fault_point("before_callback_insert", workflow_id=row.id, event=event)
        request = request_from_json(stored)
        request = replace(
            request,
            key=f"errands-workflow-{row.id}-{event}",
            unique_for=None,
            meta={**request.meta, "workflow_callback": {"workflow": row.id, "event": event}},
        )
        [result] = yield from self.insert_jobs([request])
        self._released({request.queue})
        return result.id

    # -- operators ---------------------------------------------------------------------
    def orphaned_callbacks_among(
        self, job_ids: Sequence[int]
    ) -> Program[dict[int, OrphanedCallback]]:
        """Of these jobs, the dead callbacks whose workflow is gone, each with its event
        and workflow. A replay refuses them: run again, ``ctx.workflow()`` raised
        JobNotFound deep in the handler, and the job died again. A dead callback keeps its
        workflow from the prune (wf_prunable), so only an errands that did not (it pruned
        the workflow of a callback in the DLQ) leaves one: no lock is needed to read it."""
        if not job_ids:
            return {}
        rows = yield Stmt(self.q["wf_dead_callbacks_among"], {"ids": self.array(list(job_ids))})
        fired: dict[int, OrphanedCallback] = {}
        for job_id, workflow, event in rows:
            try:
                fired[int(job_id)] = OrphanedCallback(int(str(workflow)), str(event))
            except ValueError:  # not errands' own mark: not a callback it fired
                continue
        if not fired:
            return {}
        workflows = sorted({c.workflow_id for c in fired.values()})
        found = yield Stmt(self.q["wf_existing"], {"ids": self.array(workflows)})
        kept = {int(r[0]) for r in found}
        return {i: c for i, c in fired.items() if c.workflow_id not in kept}

    def members_among(self, job_ids: Sequence[int]) -> Program[list[int]]:
        """Which of these jobs are workflow members (of a workflow not pruned)."""
        rows = yield Stmt(self.q["wf_members_among"], {"ids": self.array(list(job_ids))})
        return [int(r[0]) for r in rows]

    def lock_members_of(self, job_ids: Sequence[int]) -> Program[None]:
        """Lock the workflows these jobs are members of, and those these are nested in,
        before locking the jobs: the order every fan-in that may change a waiting member
        (release it, cancel it) takes them in."""
        yield from self._lock_up(job_ids)

    def cancelled_among(self, job_ids: Sequence[int]) -> Program[dict[int, int]]:
        """Which of these jobs are members of a workflow whose cancel was requested, or of
        one nested in such a workflow: each with the nearest such workflow. A replay
        refuses them (read after lock_members_of, which waits for a cancel's request to
        commit): a cancelled workflow's members do not run again."""
        if not job_ids:
            return {}
        rows = yield Stmt(self.q["wf_cancelled_among"], {"ids": self.array(list(job_ids))})
        return {int(r[0]): int(r[1]) for r in rows}

    def reenter(self, job_ids: Sequence[int]) -> Program[None]:
        """Replayed dead members are pending in their workflow again (after job_replay
        in the same transaction, which locked their workflows first: lock_members_of);
        see docs/workflows.md, "Replaying a member". Their dependents still waiting (for
        another parent) wait for their new end. A nested workflow that had failed, one of
        whose members is replayed, is pending again in its parent in turn (it then ends
        there again as it settles again).

        Set-based, level by level: the members, then the failed workflows they re-open,
        then those these re-open; four statements a level however many members."""
        q = self.q
        members = list(dict.fromkeys(job_ids))
        while members:
            rows = yield Stmt(q["wf_reenter"], {"ids": self.array(members)})
            back = sorted((int(r[0]), int(r[1])) for r in rows)  # member, its workflow
            if not back:
                return
            again = [m for m, _ in back]
            yield Stmt(
                q["wf_member_outcomes"], self.columns(ids=again, outcomes=[None] * len(again))
            )
            yield Stmt(q["wf_reopen_edges"], {"ids": self.array(again)})
            uncounted: dict[int, int] = {}  # workflow -> its members no longer dead
            for _, workflow_id in back:
                uncounted[workflow_id] = uncounted.get(workflow_id, 0) + 1
            workflows = sorted(uncounted)
            yield Stmt(  # the counts move back (each row locked already)
                q["wf_count_many"],
                self.columns(
                    ids=workflows,
                    completed=[0] * len(workflows),
                    dead=[-uncounted[w] for w in workflows],
                    cancelled=[0] * len(workflows),
                    skipped=[0] * len(workflows),
                ),
            )
            members = [-w for w in workflows]  # up to their parents, where nested in one

    def prune(self, older_than: float, limit: int, rows: int) -> Program[int]:
        """Delete up to ``limit`` outermost workflows settled more than ``older_than``
        seconds ago, oldest first, each with the workflows nested in it, and their members,
        edges and pending rows; their jobs are pruned as jobs are, once their workflow is
        gone (a member is kept while its workflow is). Returns how many workflows went.

        ``rows`` bounds the rows one call deletes (workflows, members and edges): the trees
        are taken oldest first while their rows fit, the first whatever its size (a tree
        is deleted whole, as its insert wrote it whole). 1,000 workflows of 1,000 members
        were a million rows in one transaction, every lock held until its end."""
        q = self.q
        prunable = {"older_than": older_than, "limit": limit, "root": None}
        found = yield Stmt(q["wf_prunable"], prunable)
        trees: list[tuple[int, list[int]]] = []
        taken = 0
        for (root,) in found:
            tree, todo = [], [int(root)]
            while todo:  # the nested ones, before the members rows that name them go
                workflow_id = todo.pop()
                tree.append(workflow_id)
                nested = yield Stmt(q["wf_nested"], {"id": workflow_id})
                todo.extend(int(r[0]) for r in nested)
            [(size,)] = yield Stmt(q["wf_tree_rows"], {"ids": self.array(tree)})
            size = int(size) + len(tree)
            if trees and taken + size > rows:
                break  # the next call starts with it (oldest first)
            taken += size
            trees.append((int(root), tree))
        # Every tree locked at once, as a replay locks them (in id order, before it makes
        # a member pending again; tree after tree, a prune holding a later tree's lower id
        # waited for an earlier one's higher one that a replay of both held: deadlock),
        # then each asked again: a replay that committed meanwhile keeps its tree, and one
        # after the delete finds no member to re-enter (no pending row left for a
        # workflow that is gone).
        yield from self._lock_up((), sorted({i for _, tree in trees for i in tree}))
        gone = 0
        for root, tree in trees:
            if not (yield Stmt(q["wf_prunable"], {**prunable, "root": root})):
                continue
            for workflow_id in tree:
                for query in ("wf_delete_edges", "wf_delete_members", "wf_delete_pending"):
                    yield Stmt(q[query], {"id": workflow_id})
                yield Stmt(q["wf_delete"], {"id": workflow_id})
            gone += len(tree)
        return gone

    def nested_pending(self, workflow_id: int) -> Program[list[int]]:
        """The ids of the nested workflows not yet settled in this one."""
        rows = yield Stmt(self.q["wf_nested_pending"], {"id": workflow_id})
        return [int(r[0]) for r in rows]

    def cancel_running(self, workflow_id: int) -> Program[int]:
        """Ask the workflow's running members to stop (no workflow lock: a member's finish
        locks its job row, then the workflow's)."""
        rows = yield Stmt(self.q["wf_cancel_running"] + "\nRETURNING id", {"id": workflow_id})
        return len(rows)

    def request_cancel(self, workflow_id: int) -> Program[None]:
        """Flag the workflow and those nested in it cancelled (see wf_request_cancel).
        It and the workflows it is nested in are locked first, in a statement of their
        own: a replay that re-opens a nested one locks them too, so it committed before
        (the flag statement, reading after the lock, sees it re-opened and flags it) or
        waits and then finds the flag (and refuses, see cancelled_among). Read in the
        flag statement itself, a re-open committed while it waited for the lock was
        missed: the nested workflow stayed unflagged, and its replayed member could
        complete it succeeded (on_success fired) before the cancel reached it."""
        yield from self._lock_up((), [workflow_id])
        yield Stmt(self.q["wf_request_cancel"], {"id": workflow_id})

    def cancel_pending(self, workflow_id: int) -> Program[int]:
        """Cancel every member not running, under the workflow's lock, and fan in."""
        q = self.q
        yield from self.request_cancel(workflow_id)
        ended = []
        for job_id, state in (yield Stmt(q["wf_pending_members"], {"id": workflow_id})):
            if state in CANCELLABLE and (yield Stmt(q["wf_cancel_member"], {"id": job_id})):
                ended.append(int(job_id))
        yield from self.fan_in(ended)
        return len(ended)

    # -- reading ------------------------------------------------------------------------
    def get(self, workflow_id: int) -> Program[WorkflowRow | None]:
        rows = yield Stmt(self.q["wf_get_row"], {"id": workflow_id})
        return workflow_row(rows[0]) if rows else None

    def listing(
        self, state: str | None, before_id: int | None, limit: int
    ) -> Program[list[WorkflowRow]]:
        rows = yield Stmt(
            self.q["wf_list"], {"state": state, "before_id": before_id, "limit": limit}
        )
        return [workflow_row(r) for r in rows]

    def members(self, workflow_id: int, after: int, limit: int) -> Program[list[MemberRow]]:
        after = FIRST if after == 0 else after  # 0: from the start, nested members included
        rows = yield Stmt(self.q["wf_members"], {"id": workflow_id, "after": after, "limit": limit})
        return [
            MemberRow(int(r[0]), r[1], r[2], r[3], r[4], [int(p) for p in json.loads(r[5] or "[]")])
            for r in rows
        ]

    def parent_results(
        self, child_id: int, after: int, limit: int
    ) -> Program[list[ParentResultRow]]:
        after = FIRST if after == 0 else after  # 0: from the start, nested parents included
        rows = yield Stmt(
            self.q["wf_parent_results"], {"child": child_id, "after": after, "limit": limit}
        )
        return [ParentResultRow(int(r[0]), r[1], r[2], r[3], int(r[4] or 0)) for r in rows]
