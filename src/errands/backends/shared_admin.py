"""The admin-side methods whose SQL differs per backend but whose Python does not:
listing jobs, the audit log, replay, discard and cancel, the worker registry, finding
jobs by key, counts per queue.

A backend's admin mixin inherits :class:`SharedAdmin` and supplies four primitives over
the named queries of its own ``queries.sql``: ``_statement(query)`` (a query's SQL, to run
on a caller's connection), ``_read_rows(query, params)`` (in a read connection),
``_write_count(query, params)`` (in a write transaction of its own, returning the rows
changed) and ``_transaction()`` (a write transaction, yielding a function that runs
queries in it).
"""

from __future__ import annotations

import functools
import json
import logging
import random
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import CancelIncomplete, InvalidTransition, JobNotFound
from ..jobs import JobRow, listed_by_priority, to_datetime
from . import base
from .base import (
    EDITABLE_STATES,
    ActionParams,
    ActionResult,
    AuditEvent,
    CancelResult,
    EditParams,
    ExpiredWait,
    FairKeyFigures,
    FairWeight,
    FinishParams,
    JobEdit,
    ListParams,
    SignalResult,
    WaitTimeoutParams,
    WorkerInfo,
)
from .fair import HALF_LIFE, fold_params
from .program import Program, Stmt, run, unwrap_connection

if TYPE_CHECKING:
    from .workflow_store import (
        MemberRow,
        OrphanedCallback,
        ParentResultRow,
        Settled,
        WorkflowRow,
        WorkflowStore,
    )

T = TypeVar("T")
SIGNAL_REFUSED = ("completed", "cancelled", "discarded")
# An operator's write transaction that the server aborts to break a lock cycle (with a
# worker's finish, a fan-in, or another operator) runs again, this many times at most.
LOCK_CONFLICT_TRIES = 5
# The jobs one statement of a bulk replay or discard changes (and audits, and re-enters in
# their workflows): each statement, and the client's work between two, stays short however
# many jobs; on SQLite, also the jobs of one write transaction (see _dead_action).
BULK_CHUNK = 5_000
BULK_PAUSE = 0.005  # seconds between two such write transactions (SQLite)
log = logging.getLogger("errands.admin")


def listing_query(params: ListParams) -> str:
    """The statement that lists jobs: available jobs of one queue by priority and due time
    (the order of the index that holds them: see ListParams.after), the others newest
    first."""
    if listed_by_priority(params.state, params.queue):
        return "job_list_due" if params.after is None else "job_list_due_after"
    return "job_list"


def listing_values(params: ListParams) -> dict[str, Any]:
    """The parameters of :func:`listing_query`'s statement."""
    priority, due, after_id = params.after or (None, None, None)
    return {
        "state": params.state,
        "queue": params.queue,
        "name": params.name,
        "before_id": params.before_id,
        "parent_id": params.parent_id,
        "limit": params.limit,
        "after_priority": priority,
        "after_due": due,  # SQLite: the stored float itself
        "after_at": to_datetime(due),  # PostgreSQL: its microsecond, exactly
        "after_id": after_id,
    }


class TxRun:
    """Runs a backend's named queries (``run(query_name, params=None)`` -> cursor), and
    statement programs (``run.program(p)``), inside one open transaction."""

    def __init__(self, conn: Any, queries: dict[str, str], no_params: Any) -> None:
        self.conn = conn
        self.queries = queries
        self.no_params = no_params

    def __call__(self, query: str, params: dict[str, Any] | None = None) -> Any:
        return self.conn.execute(self.queries[query], params or self.no_params)

    def program(self, program: Program[T]) -> T:
        return run(self.conn, program)


def suspend_program(
    queries: dict[str, str],
    outcome: FinishParams,
    fan_in: Callable[[list[int]], Program[None]] | None = None,
) -> Program[bool]:
    """A suspension's fenced write (ctx.wait_for_signal), then the resume that follows at
    once when the signal is already stored: run inside one transaction. A cancel
    requested meanwhile ends the job instead: a workflow member then fans in. A fair
    key's usage is folded first, under the same fence."""
    if outcome.fair is not False:
        yield Stmt(
            queries["fair_fold"], fold_params(outcome.id, outcome.lease_token, ran=outcome.ran)
        )
    suspended = yield Stmt(
        queries["job_suspend"],
        {
            "id": outcome.id,
            "token": outcome.lease_token,
            "signal": outcome.wait_signal,
            "timeout": outcome.wait_timeout,
        },
    )
    if not suspended:
        return False  # stale: the lease is no longer this attempt's
    if suspended[0][1] == "cancelled":
        if suspended[0][2] is not None and fan_in is not None:
            yield from fan_in([outcome.id])
        return True
    yield Stmt(queries["job_resume_if_signalled"], {"id": outcome.id})
    return True


class SharedAdmin:
    STATE_QUERY = "job_state"  # reads one job's state (locking its row where the store can)

    if TYPE_CHECKING:  # each backend's admin mixin defines these

        def _statement(self, query: str) -> str: ...

        def _read_rows(self, query: str, params: dict[str, Any] | None = None) -> list[Any]: ...

        def _write_count(self, query: str, params: dict[str, Any]) -> int: ...

        def _transaction(self) -> AbstractContextManager[TxRun]: ...

        workflows: WorkflowStore

    def _lock_conflict(self, exc: BaseException) -> bool:
        """Whether the store aborted a transaction to break a deadlock (or a serialization
        conflict): the whole transaction can simply run again. Never, on SQLite (one
        writer at a time)."""
        return False

    def _write_tx(self, action: str, body: Callable[[TxRun], T]) -> T:
        """Run ``body`` in a write transaction of its own; when the store aborts it to
        break a lock cycle, run it again (from the start, seeing what the other side
        committed): an operator never sees a deadlock. Any other error propagates."""
        for attempt in range(1, LOCK_CONFLICT_TRIES + 1):
            mark = self.workflows.mark()
            try:
                with self._transaction() as run:
                    return body(run)
            except Exception as exc:
                if attempt == LOCK_CONFLICT_TRIES or not self._lock_conflict(exc):
                    raise
                # What the rolled-back try's fan-ins settled never happened: reported with
                # the try that commits, it was announced twice (events and metrics). What
                # the caller's earlier writes committed stays to be reported.
                self.workflows.back_to(mark)
                log.info("%s: the store broke a lock cycle (%s); running it again", action, exc)
                time.sleep(random.uniform(0.0, 0.01 * attempt))  # jitter
        raise AssertionError("unreachable")  # pragma: no cover

    def _read_program(self, factory: Callable[[], Program[T]]) -> T:
        """Run the program ``factory()`` makes on a read connection."""
        with self._transaction() as run:  # a backend may read more cheaply (overrides)
            return run.program(factory())

    # -- workflows -----------------------------------------------------------------------
    def workflow_get(self, workflow_id: int) -> WorkflowRow | None:
        return self._read_program(lambda: self.workflows.get(workflow_id))

    def workflow_list(
        self, state: str | None = None, before_id: int | None = None, limit: int = 100
    ) -> list[WorkflowRow]:
        return self._read_program(lambda: self.workflows.listing(state, before_id, limit))

    def workflow_members(
        self, workflow_id: int, after: int = 0, limit: int = 1000
    ) -> list[MemberRow]:
        return self._read_program(lambda: self.workflows.members(workflow_id, after, limit))

    def workflow_parent_results(
        self, job_id: int, after: int = 0, limit: int = 100
    ) -> list[ParentResultRow]:
        return self._read_program(lambda: self.workflows.parent_results(job_id, after, limit))

    def workflow_prune(self, older_than: float, limit: int, rows: int | None = None) -> int:
        # Bounded whoever calls: unbounded, one call deleted every prunable tree in one
        # transaction (read at the call, so that a test can shrink it).
        bound = base.WORKFLOW_PRUNE_ROWS if rows is None else rows
        with self._transaction() as run:
            return run.program(self.workflows.prune(older_than, limit, bound))

    def workflow_take_settled(self) -> list[Settled]:
        return self.workflows.take_settled()

    def workflow_take_released(self) -> set[str]:
        return self.workflows.take_released()

    def workflow_cancel(self, workflow_id: int, actor: str) -> int:
        """Cancel a workflow's pending members and ask its running ones to stop. The
        request comes first, with its audit row, in one transaction: the workflow and every
        workflow nested in it are marked cancelled (from then on each settles
        ``cancelled``). The rest runs in short transactions (see _apply_cancel); when one
        of them fails, CancelIncomplete says the cancel was requested and may be partly
        applied, and running it again finishes it. The number of jobs cancelled at once."""
        if self.workflow_get(workflow_id) is None:
            raise JobNotFound(f"no workflow with id {workflow_id}")

        def request(run: TxRun) -> None:
            run.program(self.workflows.request_cancel(workflow_id))
            run(
                "audit_insert",
                {
                    "actor": actor,
                    "action": "workflow_cancel",
                    "job_id": None,
                    "detail": json.dumps({"workflow": workflow_id}),
                },
            )

        self._write_tx("workflow_cancel", request)
        try:
            return self._apply_cancel(workflow_id)
        except Exception as exc:
            raise CancelIncomplete(
                f"workflow {workflow_id}: its cancel was requested (audited; it settles "
                f"cancelled), but cancelling its members stopped part way ({exc}): some may "
                "still be pending. Run the cancel again to finish it",
                workflow_id=workflow_id,
            ) from exc

    def _apply_cancel(self, workflow_id: int) -> int:
        """A requested cancel's effect, each step safe to repeat: cancel its nested
        workflows (each the same way); ask running members to stop, without the workflow's
        lock (a member's finish takes its job's lock before the workflow's); cancel the
        pending ones under the lock; ask again for members claimed in between."""
        nested = self._read_program(lambda: self.workflows.nested_pending(workflow_id))
        cancelled = sum(self._apply_cancel(child) for child in nested)

        def ask_running(run: TxRun) -> int:
            return run.program(self.workflows.cancel_running(workflow_id))

        def cancel_pending(run: TxRun) -> int:
            return run.program(self.workflows.cancel_pending(workflow_id))

        self._write_tx("workflow_cancel", ask_running)
        cancelled += self._write_tx("workflow_cancel", cancel_pending)
        self._write_tx("workflow_cancel", ask_running)
        return cancelled

    def _replayed(self, ids: list[int], queues: set[str] | None = None) -> None:
        """Called once a replay committed (PostgreSQL wakes the listeners of ``queues``,
        those of the jobs when not given)."""

    def audit_list(self, limit: int = 100, job_id: int | None = None) -> list[AuditEvent]:
        return [
            AuditEvent(id=r[0], at=r[1], actor=r[2], action=r[3], job_id=r[4],
                       detail=json.loads(r[5]))
            for r in self._read_rows("audit_list", {"limit": limit, "job_id": job_id})
        ]  # fmt: skip

    def db_now(self) -> float:
        return float(self._read_rows("db_now")[0][0])

    # -- admin actions -------------------------------------------------------------------
    # A replay or discard is set-based, BULK_CHUNK jobs at a time: a statement changes
    # every job still dead among them, one writes their audit rows, one forgets their steps
    # (replay --fresh), a few re-enter the workflow members among them. Four statements per
    # job took a minute for 100,000 jobs, holding every row's lock (PostgreSQL) or the
    # write lock (SQLite, where 1,000,000 kept every other writer out for three minutes).
    # PostgreSQL runs every chunk in one transaction: all or nothing. SQLite commits each
    # chunk in a write transaction of its own (BULK_COMMITS), letting the application's
    # writers in between: a larger action that fails part way keeps the chunks done, and
    # the same action again does the rest (see docs/operations.md). A dry run is a plain
    # read: no write transaction, no row lock.
    BULK_COMMITS = False  # whether each chunk of a bulk action commits on its own

    def _dead_action(self, params: ActionParams, query: str, action: str) -> ActionResult:
        if params.dry_run:
            return self._dead_preview(params, replay=action == "replay")
        if params.all_matching:  # read first, without a lock; each is changed only if dead
            ids = [int(r[0]) for r in self._read_rows("job_ids_matching", _matching(params))]
        else:
            ids = list(dict.fromkeys(params.ids))
        result = ActionResult(matched=[], skipped={})
        queues: set[str] = set()
        parts = _chunks(ids) if self.BULK_COMMITS or not ids else [ids]  # the transactions
        for n, part in enumerate(parts):
            if n:
                time.sleep(BULK_PAUSE)  # the writers waiting for the lock take it now
            done, touched = self._write_tx(
                action,
                functools.partial(
                    self._dead_action_tx, params=params, query=query, action=action, ids=part
                ),
            )
            result.matched.extend(done.matched)
            result.skipped.update(done.skipped)
            queues |= touched
        if action == "replay" and result.matched:
            self._replayed(result.matched, queues)
        return result

    def _dead_preview(self, params: ActionParams, replay: bool) -> ActionResult:
        """What a replay or discard would do now, read without a lock: the dead jobs
        matching (``all_matching``), or which of the ids given are dead, and why not (a
        replay also refuses the members of cancelled workflows)."""
        if params.all_matching:
            rows = self._read_rows("job_ids_matching", _matching(params))
            matched = [int(r[0]) for r in rows]
            skipped: dict[int, str] = {}
        else:
            ids = list(dict.fromkeys(params.ids))
            states: dict[int, str] = {}
            for chunk in _chunks(ids):
                states.update(self.job_states(chunk))
            matched = [i for i in ids if states.get(i) == "dead"]
            skipped = _why_not_dead(ids, states)
        if replay:
            refused = self._cancelled_members(matched)
            for chunk in _chunks(matched):
                found = self._read_program(
                    functools.partial(self.workflows.orphaned_callbacks_among, chunk)
                )
                refused.update({i: _why_orphaned(i, c) for i, c in found.items()})
            matched = [i for i in matched if i not in refused]
            skipped.update(refused)
        return ActionResult(matched=matched, skipped=skipped)

    def _cancelled_members(self, ids: list[int]) -> dict[int, str]:
        """Of ``ids``, the members of a cancelled workflow (read without a lock: a dry
        run's preview), each with why a replay refuses it."""
        refused: dict[int, str] = {}
        for chunk in _chunks(ids):
            found = self._read_program(functools.partial(self.workflows.cancelled_among, chunk))
            refused.update({i: _why_cancelled(w) for i, w in found.items()})
        return refused

    def _dead_action_tx(
        self, run: TxRun, params: ActionParams, query: str, action: str, ids: list[int]
    ) -> tuple[ActionResult, set[str]]:
        """``query`` (job_replay, job_discard) on those of ``ids`` still dead, in ``run``'s
        transaction, BULK_CHUNK at a time (each statement, and the client's work between
        two, stays short: the server ends errands' own transactions idle for 1 to 5 s).
        What it did, and the queues of the jobs it changed."""
        replay = action == "replay"
        members: set[int] = set()
        if replay:
            for chunk in _chunks(ids):
                members.update(run.program(self.workflows.members_among(chunk)))
            # Their workflows (and those these are nested in) are locked first, all at
            # once in id order, as a fan-in locks them, then the jobs: a replay and a
            # settling fan-in never hold one lock each while waiting for the other's.
            run.program(self.workflows.lock_members_of(sorted(members)))
        matched: list[int] = []
        skipped: dict[int, str] = {}
        if members:
            # Members of a cancelled workflow (or of one nested in it) stay dead: replayed,
            # one ran inside the cancelled workflow (a nested one that had failed, settled
            # when the cancel came, was re-opened by it), and whatever it then completed
            # fired callbacks. Read under the locks just taken: a cancel requested before
            # this transaction is seen; one requested after it flags the workflows this
            # re-opens, and cancels the replayed members, saying why.
            refused: dict[int, int] = {}
            for chunk in _chunks(sorted(members)):
                refused.update(run.program(self.workflows.cancelled_among(chunk)))
            if refused:
                out = [i for i in ids if i in refused]
                states: dict[int, str] = {}
                for chunk in _chunks(out):
                    found = run("job_states", {"ids": self._id_list(chunk)}).fetchall()
                    states.update((int(r[0]), str(r[1])) for r in found)
                if not params.all_matching:  # one not dead: said as for any job
                    skipped.update(_why_not_dead(out, states))
                skipped.update(
                    {i: _why_cancelled(refused[i]) for i in out if states.get(i) == "dead"}
                )
                ids = [i for i in ids if i not in refused]
                members -= set(refused)
        if replay:
            # Dead callbacks whose workflow is gone (pruned by an errands that did not keep
            # it for them) stay dead: run, ctx.workflow() raised JobNotFound in the handler.
            orphaned: dict[int, OrphanedCallback] = {}
            for chunk in _chunks(ids):
                orphaned.update(run.program(self.workflows.orphaned_callbacks_among(chunk)))
            skipped.update({i: _why_orphaned(i, c) for i, c in orphaned.items()})
            ids = [i for i in ids if i not in orphaned]
        queues: set[str] = set()
        detail = json.dumps(action_detail(params))
        for chunk in _chunks(ids):
            values = {"ids": self._id_list(chunk), "actor": params.actor, "reason": params.reason}
            changed = {int(r[0]): str(r[1]) for r in run(query, values).fetchall()}  # id: queue
            done = [i for i in chunk if i in changed]
            if not params.all_matching and len(done) < len(chunk):
                # Each id given and left alone, with why. (A job matching the filter that
                # is no longer dead since it was read is left out, as a listing now would.)
                rest = [i for i in chunk if i not in changed]
                found = run("job_states", {"ids": self._id_list(rest)}).fetchall()
                skipped.update(_why_not_dead(rest, {int(r[0]): str(r[1]) for r in found}))
            if not done:
                continue
            matched += done
            queues.update(changed.values())
            if replay and params.fresh:
                run("steps_delete_many", {"ids": self._id_list(done)})
            if again := [i for i in done if i in members]:
                run.program(self.workflows.reenter(again))
            audit = {"actor": params.actor, "action": action, "detail": detail}
            run("audit_insert_many", {**audit, "ids": self._id_list(done)})
        return ActionResult(matched=matched, skipped=skipped), queues

    def job_replay(self, params: ActionParams) -> ActionResult:
        return self._dead_action(params, "job_replay", "replay")

    def job_discard(self, params: ActionParams) -> ActionResult:
        if not (params.reason and params.reason.strip()):
            raise InvalidTransition("discard needs a reason: pass --reason TEXT (reason=...)")
        return self._dead_action(params, "job_discard", "discard")

    def job_cancel(self, job_id: int, actor: str) -> CancelResult:
        return self._write_tx("cancel", lambda run: self._cancel_tx(run, job_id, actor))

    def _cancel_tx(self, run: TxRun, job_id: int, actor: str) -> CancelResult:
        # The locks in the order of the writers this may meet. A waiting workflow member
        # (a dependent): its workflows first, as the fan-in that may release it takes
        # them. A job a worker may claim: the job first, as the worker's finish takes it
        # before its workflows (and a claim skips it meanwhile); a running one is only
        # flagged. A cycle left (say, with a workflow cancel) is broken by the store and
        # this runs again (_write_tx).
        seen = run("wf_job_state", {"id": job_id}).fetchone()
        if seen is not None and seen[0] == "waiting":
            run.program(self.workflows.lock_members_of([job_id]))
        row = run(self.STATE_QUERY, {"id": job_id}).fetchone()
        if row is None:
            raise JobNotFound(f"no job with id {job_id}")
        previous = row[0]
        if previous in ("available", "scheduled", "retryable", "waiting"):
            run("job_cancel_pending", {"id": job_id})
            run.program(self.workflows.fan_in([job_id]))
            state = "cancelled"
        elif previous == "running":
            run("job_cancel_running", {"id": job_id})
            state = "running"
        else:
            raise InvalidTransition(
                f"job {job_id} is {previous}; only scheduled, available, retryable, "
                "waiting or running jobs can be cancelled"
            )
        run(
            "audit_insert",
            {
                "actor": actor,
                "action": "cancel",
                "job_id": job_id,
                "detail": json.dumps({"previous_state": previous}),
            },
        )
        return CancelResult(id=job_id, previous_state=previous, state=state)

    # -- editing pending jobs ------------------------------------------------------------
    def job_edit(self, params: EditParams) -> ActionResult:
        result = self._write_tx("edit", lambda run: self._edit_tx(run, params))
        if result.matched and not params.dry_run:
            self._replayed(result.matched)  # wake the (new) queues' workers
        return result

    def _edit_tx(self, run: TxRun, params: EditParams) -> ActionResult:
        # The jobs are locked in id order (in the caller's, two edits of the same jobs in
        # opposite orders each held half and waited for the other's): two edits queue up
        # instead of deadlocking, and a cycle left (with a cancel, say) is broken by the
        # store and this runs again (_write_tx).
        matched: list[int] = []
        skipped: dict[int, str] = {}
        set_run_at = params.run_at is not None or params.delay is not None
        edits = sorted({e.id: e for e in params.edits}.values(), key=lambda e: e.id)
        for edit in edits:
            row = run(self.STATE_QUERY, {"id": edit.id}).fetchone()  # locks it (PostgreSQL)
            if row is None:
                skipped[edit.id] = "no such job"
                continue
            if row[0] not in EDITABLE_STATES:
                skipped[edit.id] = (
                    f"not pending (state {row[0]}): only scheduled, available or "
                    "retryable jobs can be edited"
                )
                continue
            if params.dry_run:
                matched.append(edit.id)
                continue
            changed = run(
                "job_edit",
                {
                    "id": edit.id,
                    "set_run_at": set_run_at,
                    "run_at": params.run_at,
                    "delay": params.delay if params.delay is not None else 0.0,
                    "priority": params.priority,
                    "queue": params.queue,
                    "args": edit.args_json,
                    "concurrency_key": edit.concurrency_key,
                    "concurrency_limit": edit.concurrency_limit,
                    "rate_limit": edit.rate_limit,
                    "rate_period": edit.rate_period,
                    "fair_key": edit.fair_key,
                    "keys": edit.keys,
                },
            ).rowcount
            if changed != 1:  # pragma: no cover - the row is locked and was pending
                skipped[edit.id] = "changed state meanwhile"
                continue
            matched.append(edit.id)
            run(
                "audit_insert",
                {
                    "actor": params.actor,
                    "action": "edit",
                    "job_id": edit.id,
                    "detail": json.dumps(edit_detail(params, edit)),
                },
            )
        return ActionResult(matched=matched, skipped=skipped)

    # -- durable signals ----------------------------------------------------------------
    def job_signal(self, job_id: int, name: str, payload_json: str, actor: str) -> SignalResult:
        with self._transaction() as run:
            row = run(self.STATE_QUERY, {"id": job_id}).fetchone()  # locks it (PostgreSQL)
            if row is None:
                raise JobNotFound(f"no job with id {job_id}")
            previous = row[0]
            if previous in SIGNAL_REFUSED:
                raise InvalidTransition(
                    f"job {job_id} is {previous}: no run of it will ever read a signal; only "
                    "jobs that may still run (pending, running, waiting, dead) take signals"
                )
            run(
                "signal_insert",
                {"job_id": job_id, "name": name, "payload": payload_json, "actor": actor},
            )
            resumed = run("job_resume_if_signalled", {"id": job_id}).rowcount == 1
            run(
                "audit_insert",
                {
                    "actor": actor,
                    "action": "signal",
                    "job_id": job_id,
                    "detail": json.dumps({"signal": name, "resumed": resumed}),
                },
            )
        if resumed:
            self._replayed([job_id])  # wake the queue's workers
        return SignalResult(id=job_id, previous_state=previous, resumed=resumed)

    def signal_get(self, job_id: int, name: str) -> str | None:
        rows = self._read_rows("signal_get", {"job_id": job_id, "name": name})
        return None if not rows else str(rows[0][0])

    def job_list_expired_waits(self, limit: int) -> list[ExpiredWait]:
        return [
            ExpiredWait(*r) for r in self._read_rows("job_list_expired_waits", {"limit": limit})
        ]

    def job_expire_waits(self, timeouts: Sequence[WaitTimeoutParams]) -> list[bool]:
        if not timeouts:
            return []
        with self._transaction() as run:
            answers = [
                run(
                    "job_expire_wait",
                    {
                        "id": t.id,
                        "signal": t.wait_signal,
                        "state": t.state,
                        "error": json.dumps(t.error),
                        "delay": t.delay,
                        "attempt": t.attempt,
                    },
                ).rowcount
                == 1
                for t in timeouts
            ]
            dead = [
                t.id for t, ok in zip(timeouts, answers, strict=True) if ok and t.state == "dead"
            ]
            run.program(self.workflows.fan_in(dead))
        return answers

    # -- reading -------------------------------------------------------------------------
    def job_get(self, job_id: int, conn: Any = None) -> JobRow | None:
        if conn is None:
            rows = self._read_rows("job_get", {"id": job_id})
        else:  # the caller's connection: its open transaction's writes are visible
            cursor = unwrap_connection(conn).execute(self._statement("job_get"), {"id": job_id})
            rows = cursor.fetchall()
        return JobRow(*rows[0]) if rows else None

    def job_list(self, params: ListParams) -> list[JobRow]:
        rows = self._read_rows(listing_query(params), listing_values(params))
        return [JobRow(*r) for r in rows]

    def job_find_by_key(self, key: str, limit: int = 50) -> list[JobRow]:
        return [
            JobRow(*r) for r in self._read_rows("job_find_by_key", {"key": key, "limit": limit})
        ]

    def job_states(self, ids: Sequence[int]) -> dict[int, str]:
        if not ids:
            return {}
        rows = self._read_rows("job_states", {"ids": self._id_list(list(ids))})
        return {int(r[0]): str(r[1]) for r in rows}

    def job_get_many(self, ids: Sequence[int]) -> list[JobRow]:
        if not ids:
            return []
        return [
            JobRow(*r) for r in self._read_rows("job_get_many", {"ids": self._id_list(list(ids))})
        ]

    def _id_list(self, ids: list[int]) -> Any:
        """A list of ids as the store's ``job_states`` query binds it."""
        return ids

    def job_count_by_queue(self, state: str) -> dict[str, int]:
        return {q: int(n) for q, n in self._read_rows("job_count_by_queue", {"state": state})}

    def job_names(self, limit: int = 1000) -> list[str]:
        return [str(r[0]) for r in self._read_rows("job_names", {"limit": limit})]

    def queue_forget(self, name: str, actor: str) -> bool:
        with self._transaction() as run:
            forgotten = run("queue_forget", {"name": name}).rowcount > 0
            if forgotten:
                run(
                    "audit_insert",
                    {
                        "actor": actor,
                        "action": "forget",
                        "job_id": None,
                        "detail": json.dumps({"queue": name}),
                    },
                )
        return forgotten

    # -- fair claiming --------------------------------------------------------------------
    def fair_weight_set(self, key: str, weight: float | None, actor: str) -> None:
        with self._transaction() as run:
            if weight is None:
                run("fair_weight_delete", {"key": key})
            else:
                run("fair_weight_set", {"key": key, "weight": weight, "actor": actor})
            run(
                "audit_insert",
                {
                    "actor": actor,
                    "action": "fair_weight",
                    "job_id": None,
                    "detail": json.dumps({"key": key, "weight": weight}),
                },
            )

    def fair_weights(self) -> list[FairWeight]:
        return [
            FairWeight(str(r[0]), float(r[1]), r[2], r[3])
            for r in self._read_rows("fair_weights_list")
        ]

    def fair_figures(self, queue: str) -> list[FairKeyFigures]:
        return [
            FairKeyFigures(
                key=str(r[0]), recent_seconds=float(r[1]), seconds_total=float(r[2]),
                attempts=int(r[3]), dwell_total=float(r[4]), running=int(r[5]), due=int(r[6]),
                weight=float(r[7]),
            )
            for r in self._read_rows("fair_usage_list", {"queue": queue, "half_life": HALF_LIFE})
        ]  # fmt: skip

    # -- the worker registry ---------------------------------------------------------------
    def worker_register(self, info: WorkerInfo) -> None:
        self._write_count(
            "worker_register",
            {
                "id": info.id,
                "host": info.host,
                "pid": info.pid,
                "queues": info.queues,
                "concurrency": info.concurrency,
                "version": info.version,
                "jobs": None if info.jobs is None else json.dumps(sorted(info.jobs)),
                "beat_seconds": info.beat_seconds,
            },
        )

    def worker_heartbeat(self, worker_id: str, in_flight: int, processed: int) -> bool:
        return bool(
            self._write_count(
                "worker_heartbeat",
                {"id": worker_id, "in_flight": in_flight, "processed": processed},
            )
        )

    def worker_deregister(self, worker_id: str) -> None:
        self._write_count("worker_deregister", {"id": worker_id})

    def worker_list(self) -> list[WorkerInfo]:
        return [
            WorkerInfo(
                id=r[0], host=r[1], pid=r[2], queues=r[3], concurrency=r[4], started_at=r[5],
                heartbeat_at=r[6], in_flight=r[7], processed=r[8], version=r[9],
                heartbeat_age=max(r[10], 0.0), jobs=_names(r[11]), beat_seconds=r[12],
            )
            for r in self._read_rows("worker_list")
        ]  # fmt: skip

    def job_count_pending_by_name(self) -> dict[str, int]:
        return {str(r[0]): int(r[1]) for r in self._read_rows("job_count_pending_by_name")}

    def worker_prune(self, older_than: float) -> int:
        return self._write_count("worker_prune", {"older_than": older_than})

    def fair_usage_prune(self, older_than: float, limit: int) -> int:
        return self._write_count("fair_usage_prune", {"older_than": older_than, "limit": limit})


def edit_detail(params: EditParams, edit: JobEdit) -> dict[str, Any]:
    """The audit detail of an edit: what changed (never the arguments' values, which may
    be sensitive)."""
    detail: dict[str, Any] = {}
    if params.run_at is not None:
        detail["run_at"] = params.run_at
    if params.delay is not None:
        detail["delay"] = params.delay
    if params.priority is not None:
        detail["priority"] = params.priority
    if params.queue is not None:
        detail["queue"] = params.queue
    if edit.args_json is not None:
        detail["args"] = "replaced"
    return detail


def _chunks(ids: list[int]) -> list[list[int]]:
    """``ids`` in slices of at most BULK_CHUNK, in order."""
    return [ids[i : i + BULK_CHUNK] for i in range(0, len(ids), BULK_CHUNK)]


def _matching(params: ActionParams) -> dict[str, Any]:
    """``job_ids_matching``'s parameters: the dead jobs of a bulk action's filters."""
    return {"state": "dead", "queue": params.queue, "name": params.name}


def _why_cancelled(workflow_id: int) -> str:
    """Why a replay refuses a member of a cancelled workflow (or of one nested in it)."""
    return (
        f"its workflow {workflow_id} was cancelled: a cancelled workflow's members do not "
        "run again (discard the job, or enqueue it anew)"
    )


def _why_orphaned(job_id: int, callback: OrphanedCallback) -> str:
    """Why a replay refuses a dead callback whose workflow is gone."""
    return (
        f"it is the {callback.event} callback of workflow {callback.workflow_id}, which no "
        "longer exists (pruned while the callback was dead, by an errands that did not keep "
        "such workflows): run again, its ctx.workflow() would raise JobNotFound. Discard it "
        f"(errands dlq discard {job_id} --reason ...), or enqueue its job anew"
    )


def _why_not_dead(ids: Sequence[int], states: dict[int, str]) -> dict[int, str]:
    """Why each of ``ids`` that is not dead cannot be replayed or discarded."""
    skipped: dict[int, str] = {}
    for job_id in ids:
        state = states.get(job_id)
        if state is None:
            skipped[job_id] = "no such job"
        elif state != "dead":
            skipped[job_id] = f"not in the dead-letter queue (state {state})"
    return skipped


def action_detail(params: ActionParams) -> dict[str, Any]:
    """The audit detail of a replay or discard: its reason, and whether it was fresh."""
    detail: dict[str, Any] = {}
    if params.reason:
        detail["reason"] = params.reason
    if params.fresh:
        detail["fresh"] = True
    return detail


def _names(stored: Any) -> tuple[str, ...] | None:
    """A worker's job types as recorded (a JSON list), None when it recorded none."""
    if stored is None:
        return None
    try:
        names = json.loads(stored)
    except (TypeError, ValueError):
        return None
    return tuple(str(n) for n in names) if isinstance(names, list) else None
