"""Workflows: batches, chains and DAGs of jobs with an exactly-once fan-in.

Build one, then store it in one transaction with ``app.enqueue_workflow``::

    wf = errands.Workflow("import-42", on_success=notify.bind(import_id=42))
    a = wf.add(fetch.bind(url=u))
    b = wf.add(parse.bind(), after=[a])
    c = wf.add(report.bind(), after=[b])
    handle = app.enqueue_workflow(wf)

A member runs when every parent it is added ``after`` has ended; a parent that died or
was cancelled makes it ``cancel`` (the default), ``skip``, or ``run_anyway`` by the
edge's policy. The callbacks run once each: ``on_success`` when every member completed,
``on_settled`` when every member ended (whatever the outcome), ``on_dead`` when the first
member dies. docs/workflows.md describes the guarantees and how they are proven.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from . import offloop
from .backends.workflow_store import POLICIES, MemberRow, NodeSpec, WorkflowRow, WorkflowSpec
from .definition import BoundJob, check_text
from .errors import ConfigurationError, ErrandsError, JobNotFound
from .results import Pacer

if TYPE_CHECKING:
    from .app import App
    from .handle import JobHandle

NAME_MAX_BYTES = 200
WORKFLOW_STATES = ("running", "succeeded", "failed", "cancelled")
WAIT_POLL_FIRST = 0.02  # seconds between status reads while waiting, at first ...
WAIT_POLL_MAX = 0.5  # ... backing off to this


class WorkflowFailed(ErrandsError):
    """The workflow settled without every member completing (``failed`` names them)."""

    def __init__(self, message: str, *, workflow_id: int, failed: dict[str, str]) -> None:
        super().__init__(message)
        self.workflow_id = workflow_id
        self.failed = failed


@dataclass(frozen=True)
class Node:
    """A member of a workflow being built (what ``Workflow.add`` returns)."""

    workflow: Workflow = field(repr=False, compare=False)
    index: int
    name: str


@dataclass(frozen=True)
class Edge:
    """``after=[errands.Edge(node, "run_anyway")]``: a parent with its own failure policy."""

    parent: Node
    on_failure: str = "cancel"


class Workflow:
    """A DAG of jobs (or, without ``after``, a batch) and its callbacks, not yet stored."""

    kind = "dag"

    def __init__(
        self,
        name: str,
        *,
        on_success: BoundJob | None = None,
        on_settled: BoundJob | None = None,
        on_dead: BoundJob | None = None,
    ) -> None:
        if not isinstance(name, str) or not name.strip():
            raise ConfigurationError("a workflow needs a name: errands.Workflow('import-42')")
        self.name = check_text("workflow name", name, NAME_MAX_BYTES)
        self.nodes: list[tuple[Node, BoundJob | Workflow, tuple[Edge, ...]]] = []
        self._names: set[str] = set()  # the node names taken (a set: 10,000 adds stay linear)
        self.callbacks: dict[str, BoundJob] = {}
        for event, job in (("on_success", on_success), ("on_settled", on_settled),
                           ("on_dead", on_dead)):  # fmt: skip
            if job is not None:
                self.callbacks[event] = _bound(job, f"{event}=")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} members={len(self.nodes)}>"

    def __len__(self) -> int:
        return len(self.nodes)

    def add(
        self,
        job: BoundJob | Workflow,
        *,
        after: Iterable[Node | Edge] | Node | Edge | None = (),
        on_failure: str = "cancel",
        name: str | None = None,
    ) -> Node:
        """Add a member; it runs once every node of ``after`` ended (``on_failure``: what
        it does when one of them died or was cancelled, unless an :class:`Edge` says).
        ``after`` is a list of nodes (or edges), one node, or None (no parents).

        A member may be a whole workflow or batch (nested): it starts at once, is pending
        here until it settles (after its own callbacks), and then counts as completed
        (succeeded), dead (failed) or cancelled; nodes may run after it."""
        parents = _parents(after)
        if isinstance(job, Workflow):
            bound: BoundJob | Workflow = self._nested(job, parents)
            default = f"{job.name}#{len(self.nodes)}"
        else:
            bound = _bound(job, "add()")
            default = f"{bound.request.name}#{len(self.nodes)}"
        node_name = name if name is not None else default
        check_text("node name", node_name, NAME_MAX_BYTES)
        if node_name in self._names:
            raise ConfigurationError(
                f"workflow {self.name!r} has a node named {node_name!r} already; pass another name="
            )
        edges = tuple(_edge(p, on_failure, self) for p in parents)
        if edges and self.kind == "batch":
            raise ConfigurationError(
                f"batch {self.name!r}: members of a batch run side by side; use "
                "errands.Workflow for members that run after others"
            )
        if len({e.parent.index for e in edges}) != len(edges):
            raise ConfigurationError(f"node {node_name!r}: a parent is listed twice in after=")
        node = Node(self, len(self.nodes), node_name)
        self.nodes.append((node, bound, edges))
        self._names.add(node_name)
        return node

    def _nested(self, child: Workflow, after: Sequence[Node | Edge]) -> Workflow:
        if child is self or self in child.descendants():
            raise ConfigurationError(f"workflow {self.name!r} cannot contain itself")
        if after:
            raise ConfigurationError(
                f"nested workflow {child.name!r} starts at once: it cannot be added after= "
                "other nodes (nodes may run after it)"
            )
        if not child.nodes:
            raise ConfigurationError(
                f"nested workflow {child.name!r} has no members; add some first"
            )
        return child

    def descendants(self) -> list[Workflow]:
        """The workflows nested in this one, at any depth."""
        found: list[Workflow] = []
        for _, member, _ in self.nodes:
            if isinstance(member, Workflow):
                found += [member, *member.descendants()]
        return found

    def jobs(self) -> list[BoundJob]:
        """The job members of this workflow itself (not of nested ones), in node order."""
        return [m for _, m, _ in self.nodes if isinstance(m, BoundJob)]

    def spec(
        self,
        requests: Sequence[Any],
        callbacks: dict[str, Any],
        children: dict[int, WorkflowSpec] | None = None,
    ) -> WorkflowSpec:
        """The store's view, with the requests the App prepared (hooks applied): one per
        job member, in order, and the specs of nested workflows by node index."""
        if not self.nodes:
            raise ConfigurationError(
                f"workflow {self.name!r} has no members; add some with wf.add(job.bind(...))"
            )
        given = iter(requests)
        nested = children or {}
        return WorkflowSpec(
            name=self.name,
            kind=self.kind,
            nodes=[
                NodeSpec(
                    node=node.name,
                    request=None if isinstance(member, Workflow) else next(given),
                    after=tuple(e.parent.index for e in edges),
                    policies=tuple(e.on_failure for e in edges),
                    child=nested.get(node.index),
                )
                for node, member, edges in self.nodes
            ],
            callbacks=callbacks,
        )


class Batch(Workflow):
    """Jobs that run side by side, with callbacks when they end (Sidekiq's batches)."""

    kind = "batch"


def _bound(job: Any, where: str) -> BoundJob:
    if not isinstance(job, BoundJob):
        raise ConfigurationError(
            f"workflow {where} takes a job made with job.bind(...), got {type(job).__name__}"
        )
    return job


def _parents(after: Any) -> list[Node | Edge]:
    """``after=`` as a list: one node (or edge) is a list of one, None no parents."""
    if after is None:
        return []
    if isinstance(after, (Node, Edge)):
        return [after]
    if isinstance(after, (str, bytes)) or not isinstance(after, Iterable):
        raise ConfigurationError(
            f"after= takes the nodes wf.add() returned (after=[a, b], or after=a), got "
            f"{type(after).__name__}"
        )
    return list(after)


def _edge(parent: Any, on_failure: str, workflow: Workflow) -> Edge:
    edge = parent if isinstance(parent, Edge) else Edge(parent, on_failure)
    if not isinstance(edge.parent, Node):
        raise ConfigurationError(
            f"after= takes the nodes wf.add() returned, got {type(edge.parent).__name__}"
        )
    if edge.parent.workflow is not workflow:
        raise ConfigurationError(
            f"node {edge.parent.name!r} belongs to another workflow; add it to this one"
        )
    if edge.on_failure not in POLICIES:
        raise ConfigurationError(
            f"on_failure={edge.on_failure!r}: choose one of {', '.join(POLICIES)}"
        )
    return edge


# -- the Celery canvas shorthands ------------------------------------------------------
def chain(*jobs: BoundJob, name: str = "chain") -> Workflow:
    """Each job after the one before it (Celery's ``chain``)."""
    wf = Workflow(name)
    previous: Node | None = None
    for job in jobs:
        previous = wf.add(job, after=[previous] if previous is not None else [])
    return wf


def group(*jobs: BoundJob, name: str = "group", **callbacks: BoundJob) -> Batch:
    """Jobs side by side (Celery's ``group``), with batch callbacks if given."""
    batch = Batch(name, **callbacks)
    for job in jobs:
        batch.add(job)
    return batch


def chord(header: Iterable[BoundJob], body: BoundJob, *, name: str = "chord") -> Workflow:
    """``body`` once every job of ``header`` completed (Celery's ``chord``); it reads their
    results with ``ctx.parent_results()``."""
    wf = Workflow(name)
    parents = [wf.add(job) for job in header]
    wf.add(body, after=parents, name="body")
    return wf


def map_jobs(job: Any, items: Iterable[Any], *, name: str = "map") -> Batch:
    """One member per item (Celery's ``map``): ``job.bind(**item)`` for a dict, else
    ``job.bind(item)``."""
    batch = Batch(name)
    for item in items:
        batch.add(job.bind(**item) if isinstance(item, dict) else job.bind(item))
    return batch


# -- handles ----------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkflowStatus:
    """A workflow's counts by outcome, kept with each member's end (one row read)."""

    id: int
    name: str
    kind: str
    state: str  # running, succeeded, failed, cancelled
    total: int
    pending: int
    completed: int
    dead: int
    cancelled: int
    skipped: int
    callbacks: dict[str, int | None]  # event -> the callback job's id once inserted
    cancel_requested: bool
    created_at: float
    settled_at: float | None

    @property
    def settled(self) -> bool:
        return self.settled_at is not None

    @classmethod
    def of(cls, row: WorkflowRow) -> WorkflowStatus:
        import json

        events = json.loads(row.callbacks)
        fired = {"on_success": row.on_success_job, "on_settled": row.on_settled_job,
                 "on_dead": row.on_dead_job}  # fmt: skip
        return cls(
            id=row.id, name=row.name, kind=row.kind, state=row.state, total=row.total,
            pending=row.pending, completed=row.completed, dead=row.dead,
            cancelled=row.cancelled, skipped=row.skipped,
            callbacks={event: fired[event] for event in events},
            cancel_requested=row.cancel_requested, created_at=row.created_at,
            settled_at=row.settled_at,
        )  # fmt: skip


@dataclass(frozen=True)
class Member:
    """One member of a workflow: a job, or (``job_id`` negative) a nested workflow."""

    job_id: int
    node: str
    job_name: str | None
    state: str | None  # the job's state (None once its row was pruned)
    outcome: str | None  # None while pending
    parents: list[int]

    @property
    def workflow_id(self) -> int | None:
        """A nested workflow member's workflow id (its ``job_id`` is minus that)."""
        return -self.job_id if self.job_id < 0 else None

    @classmethod
    def of(cls, row: MemberRow) -> Member:
        return cls(row.job_id, row.node, row.name, row.state, row.outcome, row.parents)


class WorkflowHandle:
    """A stored workflow: its status, members, result, cancel and wait."""

    def __init__(
        self,
        app: App,
        workflow_id: int,
        jobs: dict[str, JobHandle] | None = None,
        children: dict[str, WorkflowHandle] | None = None,
    ):
        self.app = app
        self.id = workflow_id
        self.jobs = jobs or {}  # node name -> handle (from enqueue_workflow)
        self.children = children or {}  # node name -> a nested workflow's handle

    def __repr__(self) -> str:
        return f"<WorkflowHandle {self.id}>"

    def status(self) -> WorkflowStatus:
        return self.app.workflow_status(self.id)

    async def astatus(self) -> WorkflowStatus:
        """:meth:`status` for async code (read in a worker thread).

        .. versionadded:: 0.2
        """
        await self.app.abackend()  # opened once, off the executor (see App.abackend)
        return await offloop.run(self.status)

    def members(self) -> list[Member]:
        return self.app.workflow_members(self.id)

    def cancel(self, actor: str = "api") -> int:
        """Cancel pending members (dependents included) and ask running ones to stop;
        the number cancelled at once."""
        return self.app.cancel_workflow(self.id, actor=actor)

    async def acancel(self, actor: str = "api") -> int:
        """:meth:`cancel` for async code (in a worker thread: the cancel is not undone
        when the awaiting task is cancelled).

        .. versionadded:: 0.2
        """
        await self.app.abackend()
        return await offloop.run(self.cancel, actor)

    def wait(self, timeout: float | timedelta | None = None) -> WorkflowStatus:
        """Wait until every member ended (the workflow settled); its final status.
        ResultTimeout when ``timeout`` seconds pass first, also while the store cannot
        be read (its reads are made again until then; see errands.results.Pacer)."""
        return self._settle(_Settling(self.id, timeout))

    def _settle(self, settling: _Settling) -> WorkflowStatus:
        while (status := settling.settled(settling.pacer.read(self.status))) is None:
            time.sleep(settling.pause())
        return status

    async def await_(self, timeout: float | timedelta | None = None) -> WorkflowStatus:
        """:meth:`wait` for async code: the status is read in a worker thread and the
        pauses are awaited, so the event loop never blocks. (Named as PEP 8 names what
        would be a keyword: ``a`` + ``wait`` is ``await``.)

        .. versionadded:: 0.2
        """
        return await self._asettle(_Settling(self.id, timeout))

    async def _asettle(self, settling: _Settling) -> WorkflowStatus:
        await settling.pacer.opened(self.app, settling.what())
        while (status := settling.settled(await settling.pacer.aread(self.status))) is None:
            await asyncio.sleep(settling.pause())
        return status

    def result(self, timeout: float | timedelta | None = None) -> dict[str, Any]:
        """Wait for the workflow, then every member's result by node name. Raises
        WorkflowFailed, naming the members that did not complete, unless all did. The
        results are read within the same ``timeout`` (they were read after it, waiting
        for a connection the pool's 30 s, then raising its PoolTimeout)."""
        settling = _Settling(self.id, timeout)
        status = self._settle(settling)
        read = functools.partial(self._results, status, settling)
        while (results := settling.pacer.read(read)) is None:
            time.sleep(settling.pause())
        return results

    async def aresult(self, timeout: float | timedelta | None = None) -> dict[str, Any]:
        """:meth:`result` for async code (the members' results read in a worker thread).

        .. versionadded:: 0.2
        """
        settling = _Settling(self.id, timeout)
        status = await self._asettle(settling)
        read = functools.partial(self._results, status, settling)
        while (results := await settling.pacer.aread(read)) is None:
            await asyncio.sleep(settling.pause())
        return results

    def _results(self, status: WorkflowStatus, settling: _Settling) -> dict[str, Any]:
        """The settled workflow's results by node name, or WorkflowFailed (a nested
        workflow's within the time left)."""
        members = self.members()
        failed = {m.node: m.outcome or "?" for m in members if m.outcome != "completed"
                  and m.outcome != "skipped"}  # fmt: skip
        if failed or status.state != "succeeded":
            # none failed: cancelled while its members ran, each of which then completed
            why = ", ".join(f"{node} {outcome}" for node, outcome in sorted(failed.items())) or (
                "no member failed; its cancel was requested"
                if status.cancel_requested
                else "no member failed"
            )
            raise WorkflowFailed(
                f"workflow {self.id} ({status.name}) {status.state}: {why}",
                workflow_id=self.id,
                failed=failed,
            )
        results: dict[str, Any] = {}
        for member in members:
            if member.workflow_id is not None:
                nested = self.app.workflow(member.workflow_id)
                results[member.node] = nested.result(timeout=settling.pacer.left())
                continue
            if member.outcome == "skipped":
                results[member.node] = None
                continue
            try:
                results[member.node] = self.app.job_result(member.job_id)
            except JobNotFound:
                results[member.node] = None  # pruned
        return results


class _Settling:
    """One wait for a workflow to settle, round by round: :meth:`WorkflowHandle.wait`
    and :meth:`WorkflowHandle.await_` drive it, in the thread or in a task. Nothing
    pushes a workflow's end: it polls, backing off from WAIT_POLL_FIRST to
    WAIT_POLL_MAX."""

    def __init__(self, workflow_id: int, timeout: float | timedelta | None) -> None:
        self.id = workflow_id
        self.pacer = Pacer(None, WAIT_POLL_MAX, timeout, first=WAIT_POLL_FIRST)
        self.last: WorkflowStatus | None = None

    def settled(self, status: WorkflowStatus | None) -> WorkflowStatus | None:
        """``status`` once the workflow settled, else None (``status`` None: the store
        could not be read; the last status read is kept for the timeout's words)."""
        self.last = status or self.last
        return status if status is not None and status.settled else None

    def what(self) -> str:
        last = self.last
        if last is None:
            return f"workflow {self.id} is still running"
        return (
            f"workflow {self.id} ({last.name}) has {last.pending} of {last.total} members "
            "still pending"
        )

    def pause(self) -> float:
        """How long until the next read; ResultTimeout once the time is up."""
        return self.pacer.next(self.what())


@dataclass(frozen=True)
class ParentResult:
    """One parent of the running member: its node, how it ended and its result."""

    job_id: int
    node: str
    state: str | None  # its job's state; 'skipped' for a skipped parent (its job cancelled)
    result: Any  # None unless completed (and when larger than the page's byte cap)
    truncated: bool = False  # the result was larger than max_bytes: read it with get_job


@dataclass(frozen=True)
class ParentResults:
    """A page of ``ctx.parent_results()``; pass ``next_after`` for the next page."""

    items: list[ParentResult]
    next_after: int | None  # None: this was the last page

    def __iter__(self) -> Any:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    @property
    def failed(self) -> list[ParentResult]:
        """The parents that died or were cancelled (a ``run_anyway`` member sees them)."""
        return [p for p in self.items if p.state in ("dead", "cancelled", "discarded")]

    @property
    def skipped(self) -> list[ParentResult]:
        """The parents skipped by their own edges' policy ``skip``: not failed (the
        members after one carry on as if it had completed), with no result."""
        return [p for p in self.items if p.state == "skipped"]

    def by_node(self) -> dict[str, Any]:
        return {p.node: p.result for p in self.items}
