"""The storage contract every backend implements (internal, may change between releases).

Methods are named ``noun_verb`` and take one params object, so a new field never breaks
a caller (River's driver shape). Dialect differences are capability flags on
:class:`Capabilities`, never ``if backend == ...`` in the worker.

Fencing rule: every write to a running job names the lease token its claim returned.
A write whose token no longer matches changes nothing and is reported back as rejected.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol

from ..jobs import EnqueueRequest, JobRow, Step

if TYPE_CHECKING:
    from .fair import Weigher
    from .workflow_store import (
        MemberRow,
        ParentResultRow,
        Settled,
        WorkflowInserted,
        WorkflowRow,
        WorkflowSpec,
    )

FinishState = Literal["completed", "retryable", "dead", "cancelled", "waiting"]

PROMOTE_BATCH = 1000  # due jobs job_promote_due relabels in one statement
# The rows (workflows, members, edges) one workflow_prune call deletes, about, when its
# caller names no bound: 1,000 workflows of 1,000 members were a million rows in one
# transaction, its locks held (and SQLite's write lock) until the end. A tree bigger than
# this goes alone. The maintenance leader's batches use it too.
WORKFLOW_PRUNE_ROWS = 10_000

# A caller's deadline (time.monotonic()) for the store calls it makes in this context:
# set by a wait around its reads (errands.results.Pacer), and carried by contextvars into
# the thread asyncio.to_thread runs them in. A store that waits for a connection (the
# PostgreSQL pool's checkout, 30 s by default) waits no longer than the time left, and
# at least DEADLINE_FLOOR: a read at the deadline (result(timeout=0)) still takes a free
# connection, which psycopg_pool refuses with a timeout of 0.
# A deadline may also move (a callable read at each call): the maintenance leader's
# duties wait no later than its leadership's end, which each renewal pushes back.
_DEADLINE: ContextVar[float | Callable[[], float] | None] = ContextVar(
    "errands_store_deadline", default=None
)
DEADLINE_FLOOR = 0.05
# Whether the deadline bounds the waits of the calls' statements for a lock another
# session holds too (lock_wait: PostgreSQL's lock_timeout), not only those for a
# connection. Unless the caller says otherwise (see calls_until).
_LOCK_WAITS: ContextVar[bool] = ContextVar("errands_store_lock_waits", default=False)


@contextmanager
def calls_until(
    deadline: float | Callable[[], float] | None, *, lock_waits: bool = True
) -> Iterator[None]:
    """Store calls made inside wait for a connection no later than ``deadline``
    (time.monotonic(), or a callable giving it at each call; None: no limit of the
    caller's); SQLite's for its write lock too. ``lock_waits``: on PostgreSQL, so do
    their statements' waits for a lock another session holds (a row a user's open
    transaction updated, ``LOCK TABLE``): each call then runs in a transaction of its
    own whose lock_timeout is the time left, which costs a call made of one statement
    two more round trips (its BEGIN and COMMIT)."""
    token = _DEADLINE.set(deadline)
    locks = _LOCK_WAITS.set(lock_waits and deadline is not None)
    try:
        yield
    finally:
        _LOCK_WAITS.reset(locks)
        _DEADLINE.reset(token)


_STOP: ContextVar[threading.Event | None] = ContextVar("errands_calls_stop", default=None)


@contextmanager
def calls_until_stopped(stop: threading.Event) -> Iterator[None]:
    """Store calls made inside stop waiting for SQLite's write lock once ``stop`` is set
    (they raise DatabaseBusy): a stopping worker's claim, waiting for a file another
    process held locked, held the stop for up to write_timeout (60 s by default)."""
    token = _STOP.set(stop)
    try:
        yield
    finally:
        _STOP.reset(token)


def stop_asked() -> bool:
    """Whether the caller's stop (:func:`calls_until_stopped`) was asked for."""
    stop = _STOP.get()
    return stop is not None and stop.is_set()


def connection_wait(default: float) -> float:
    """How long a store call may wait for a connection here: ``default``, or the time
    left before the caller's deadline (at least DEADLINE_FLOOR) when that is sooner."""
    deadline = _DEADLINE.get()
    if deadline is None:
        return default
    if callable(deadline):
        deadline = deadline()
    return min(default, max(deadline - time.monotonic(), DEADLINE_FLOOR))


def lock_wait() -> float | None:
    """How long a statement of a store call made here may wait for a lock another
    session holds: the time left before the caller's deadline (at least DEADLINE_FLOOR)
    when it bounds lock waits (:func:`calls_until`); None: for as long as it takes."""
    deadline = _DEADLINE.get()
    if deadline is None or not _LOCK_WAITS.get():
        return None
    if callable(deadline):
        deadline = deadline()
    return max(deadline - time.monotonic(), DEADLINE_FLOOR)


@dataclass(frozen=True)
class Capabilities:
    listen_notify: bool = False  # push wake-ups when jobs are inserted
    skip_locked: bool = False  # concurrent claimers never wait on each other's rows
    caller_connection: str = ""  # type name of the connection enqueue(conn=) accepts
    single_writer: bool = False  # an open write transaction locks out every other writer


class InsertResult(NamedTuple):
    """What an insert stored: the job's id, or the id of the job already holding its key
    (``deduplicated``). A tuple: a bulk enqueue builds one per job."""

    id: int
    deduplicated: bool


@dataclass(frozen=True)
class QueueClaim:
    name: str
    limit: int  # at most this many from this queue in one claim


@dataclass(frozen=True)
class ClaimParams:
    """Claim up to ``limit`` due jobs, visiting ``queues`` in order, each up to its own cap."""

    queues: Sequence[QueueClaim]
    limit: int
    worker_id: str
    lease_seconds_default: float
    suspects: bool = False  # claim only rescued jobs, else only unrescued ones
    # The job types the claimer can run (None: any). A worker never claims a job type its
    # code does not define: during a rolling deploy, a job a newer release enqueued waits
    # for a worker that knows it instead of burning its attempts on one that does not.
    names: Sequence[str] | None = None


# Slots, not frozen: one is built for every attempt, and a frozen dataclass sets each of
# its 15 fields through object.__setattr__ (3.2 us a job against 0.8). Treat it as
# immutable all the same: build a changed copy with dataclasses.replace.
@dataclass(slots=True)
class FinishParams:
    """The outcome of one attempt, fenced by ``lease_token``."""

    id: int
    lease_token: str
    state: FinishState
    result_json: str | None = None
    error: dict[str, Any] | None = None
    delay: float = 0.0  # for retryable: seconds after database now
    children: Sequence[EnqueueRequest] = ()  # inserted with a completion, only if it lands
    # state "waiting" (ctx.wait_for_signal): the signal awaited, and for how long (None:
    # no limit). The suspension gives the attempt back uncharged; a signal already sent
    # (or sent at the same moment) makes the job available at once instead.
    wait_signal: str | None = None
    wait_timeout: float | None = None
    # a workflow member's completion: members it adds to its own workflow (ctx.add_to_workflow)
    workflow_adds: Sequence[EnqueueRequest] = ()
    # Fair queues (the fold of the attempt's worker time into its key's usage):
    # whether the job has a fair key, as its claimed row said (False: the write skips the
    # fold altogether; None: not known, the write looks at the row), and the seconds its
    # handler ran (None: counted from the claim to this write).
    fair: bool | None = None
    ran: float | None = None
    # Whether the job is a workflow member, as its claimed row said (True: the write goes
    # straight to the members' path with its fan-in; None or False: it is tried as a
    # plain job first, as a row without the column cannot tell).
    member: bool | None = None


@dataclass(frozen=True)
class LeaseRef:
    id: int
    lease_token: str
    lease_seconds: float
    progress: float | None = None  # ctx.progress to store with this heartbeat (None: as is)
    progress_message: str | None = None
    fair: bool | None = None  # a release: whether the job has a fair key (as FinishParams)


@dataclass(frozen=True)
class HeartbeatResult:
    """What a heartbeat found, as ``(job id, lease token)`` pairs: one worker may hold a
    stale attempt and a newer attempt of the same job at once, and only the lease whose
    token still matches was extended."""

    extended: frozenset[tuple[int, str]]  # leases still ours, now extended
    cancel_requested: frozenset[tuple[int, str]]  # of those, the ones an operator cancelled


# What a graceful-stop release records on the job (its errors list, kind "released").
RELEASED = (
    "released at shutdown: the worker stopped before the handler finished; the attempt is "
    "not charged and the job runs again"
)


@dataclass(frozen=True)
class ExpiredLease:
    id: int
    name: str
    queue: str
    lease_token: str
    attempt: int
    max_attempts: int
    rescues: int
    cancel_requested: bool
    lease_owner: str | None
    fair: bool | None = None  # whether the job has a fair key


@dataclass(frozen=True)
class RescueParams:
    """Move one expired lease on; fenced by its token and by the lease still being expired."""

    id: int
    lease_token: str
    state: Literal["retryable", "dead", "cancelled"]
    error: dict[str, Any]
    delay: float
    fair: bool | None = None  # whether the job has a fair key (as FinishParams)


@dataclass(frozen=True)
class ExpiredWait:
    """A job waiting for a signal past its ``wait_until`` (the maintenance leader's)."""

    id: int
    name: str
    queue: str
    attempt: int
    max_attempts: int
    wait_signal: str


@dataclass(frozen=True)
class WaitTimeoutParams:
    """End an expired wait as a failed attempt; fenced by the job still in the wait it
    was listed in: waiting for ``wait_signal`` past its ``wait_until`` at ``attempt`` (a
    signal that landed first wins; the plan's state and error were made for that attempt:
    a paused leader's plan for an earlier wait on the same signal, which another leader
    ended meanwhile, would retry a job past its attempts)."""

    id: int
    wait_signal: str
    state: Literal["retryable", "dead"]
    error: dict[str, Any]
    delay: float
    attempt: int  # the waiting row's (ExpiredWait.attempt)


@dataclass(frozen=True)
class SignalResult:
    id: int
    previous_state: str
    resumed: bool  # the job was waiting for this signal and is available again


@dataclass(frozen=True)
class ListParams:
    state: str | None = None
    queue: str | None = None
    name: str | None = None
    limit: int = 100
    before_id: int | None = None  # keyset pagination: newest first, ids below this one
    # Available jobs of one queue (state and queue given) are listed by priority, then
    # due time, then id (a plain queue's claim order, the order of the index that finds
    # them), and paged after this (priority, due time in epoch seconds as stored, id):
    # Job.cursor.
    after: tuple[int, float, int] | None = None
    parent_id: int | None = None  # children of this job


@dataclass(frozen=True)
class QueueStats:
    queue: str
    counts: dict[str, int]
    oldest_available_age: float | None  # seconds the oldest due job has waited
    stalled: int = 0  # running jobs whose lease has expired and which await rescue


@dataclass(frozen=True)
class WorkerInfo:
    id: str
    host: str
    pid: int
    queues: str
    concurrency: int
    version: str
    started_at: float = 0.0
    heartbeat_at: float = 0.0
    in_flight: int = 0
    processed: int = 0
    heartbeat_age: float = 0.0  # seconds since its last heartbeat, by the database clock
    jobs: tuple[str, ...] | None = None  # the job types its code defines (None: not said)
    beat_seconds: float | None = None  # how often it beats (None: a worker before schema 18)


@dataclass(frozen=True)
class CronState:
    """The scheduler's memory of one periodic job (epoch seconds, database clock)."""

    name: str
    last_slot: float | None
    last_job_id: int | None
    next_slot: float | None
    expression: str | None = None  # the schedule the slots so far followed
    timezone: str | None = None


@dataclass(frozen=True)
class QueueSettings:
    """A queue's persisted settings: paused, cluster-wide limits."""

    name: str
    paused: bool = False
    max_running: int | None = None
    rate_limit: int | None = None
    rate_period: float | None = None
    # Some worker's code declares job types with a concurrency key or a rate in this queue
    # (column has_keys; it only ever turns on). Workers before schema version 7 read it to
    # claim the queue through the limited path; newer ones read the limits on the rows.
    jobs_declare_limits: bool = False
    updated_at: float | None = None
    updated_by: str | None = None
    fair: bool = False  # claimed fairly across the jobs' fair keys (errands.backends.fair)
    aging: float | None = None  # seconds due per level a fair queue's job moves up

    @property
    def state(self) -> str:
        """``"paused"`` or ``"active"``: the one word the CLI and the dashboard show."""
        return queue_state(self)


@dataclass(frozen=True)
class FairWeight:
    """A fair key's stored weight (``app.fair_weight``); keys without one weigh 1."""

    key: str
    weight: float
    updated_at: float | None = None
    updated_by: str | None = None


@dataclass(frozen=True)
class FairKeyFigures:
    """One fair key's figures in a queue: worker seconds of recent attempts (decayed, the
    running ones included), in all, its ended attempts, their summed dwell (due ->
    start), the attempts running now, the jobs due now, and its weight."""

    key: str
    recent_seconds: float
    seconds_total: float
    attempts: int
    dwell_total: float
    running: int
    due: int
    weight: float
    # where the weight comes from: "stored" (app.fair_weight(key, w) or the CLI), "code"
    # (the app's fair_weight callable), "default" (1)
    weight_source: str = "default"

    @property
    def mean_dwell(self) -> float | None:
        return self.dwell_total / self.attempts if self.attempts else None


QUEUE_ACTIVE = "active"  # workers claim from it
QUEUE_PAUSED = "paused"  # no worker claims from it; running jobs finish


def queue_state(settings: QueueSettings | None) -> str:
    """A queue's state word; a queue with no stored settings is active."""
    return QUEUE_PAUSED if settings is not None and settings.paused else QUEUE_ACTIVE


@dataclass(frozen=True)
class AuditEvent:
    id: int
    at: float
    actor: str
    action: str
    job_id: int | None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ActionParams:
    """An audited admin action on jobs chosen by id or by filter."""

    actor: str
    ids: Sequence[int] = ()
    all_matching: bool = False
    queue: str | None = None
    name: str | None = None
    reason: str | None = None
    dry_run: bool = False
    fresh: bool = False  # replay only: forget the job's stored steps


@dataclass(frozen=True)
class JobEdit:
    """One job's new arguments (validated by the App), when the edit replaces them, and
    its keys when the App derived them anew (``keys``: new arguments, or a move to
    another queue, where a job type without a fair_key template is keyed ``job:<name>``
    in a fair queue and unkeyed elsewhere), with the key's limit and the job type's rate
    from the same App's definition, as an enqueue stores them."""

    id: int
    args_json: str | None = None
    concurrency_key: str | None = None  # derived from the (new) arguments
    fair_key: str | None = None  # derived from the (new) arguments and the queue
    # write concurrency_key, concurrency_limit, rate_limit, rate_period and fair_key (else
    # they stay)
    keys: bool = False
    # The editing App's concurrency_limit for the job type (None: no key). A claim holds a
    # row to the lower of it and the claiming worker's own, so a row edited by code that
    # had raised the limit kept the old one: its key ran fewer jobs at once than asked.
    concurrency_limit: int | None = None
    # The editing App's rate for the job type (None: no rate). The claim counts a type's
    # starts against the rate stored on its rows, so a row edited by code that had changed
    # the rate kept the old one.
    rate_limit: int | None = None
    rate_period: float | None = None


@dataclass(frozen=True)
class EditParams:
    """An audited edit of pending jobs: what is not None changes, for every job of
    ``edits``; only ``scheduled``, ``available`` and ``retryable`` jobs are changed."""

    actor: str
    edits: Sequence[JobEdit]
    run_at: float | None = None  # epoch seconds; or delay: seconds from database now
    delay: float | None = None
    priority: int | None = None
    queue: str | None = None
    dry_run: bool = False


EDITABLE_STATES = ("scheduled", "available", "retryable")


@dataclass(frozen=True)
class ActionResult:
    matched: list[int]  # the jobs the action applies (or, dry run, would apply) to
    skipped: dict[int, str]  # ids named explicitly that it could not apply to, with why


@dataclass(frozen=True)
class CancelResult:
    id: int
    previous_state: str
    state: str  # "cancelled" at once for pending jobs; "running" with cancel requested


@dataclass(frozen=True)
class StoreHealth:
    """Early signs of a struggling job store (metrics gauges); None where not applicable."""

    dead_tuples: int | None = None  # PostgreSQL: dead row versions in errands_jobs
    live_tuples: int | None = None  # PostgreSQL: live rows in errands_jobs
    oldest_transaction_age: float | None = None  # PostgreSQL: seconds the oldest open one ran
    page_count: int | None = None  # SQLite: pages in the database file
    freelist_count: int | None = None  # SQLite: unused pages in the file
    wal_bytes: int | None = None  # SQLite: size of the write-ahead log file


class Backend(Protocol):
    """A job store. One conformance suite (tests/conformance) holds every backend to it."""

    url: str
    capabilities: Capabilities

    # -- schema ------------------------------------------------------------------
    def migrate(self) -> list[str]:
        """Apply pending numbered migrations; safe when several processes run it at once."""
        ...

    def schema_check(self) -> None:
        """Raise SchemaOutdated, naming the command to run, unless the schema is current."""
        ...

    def close(self) -> None: ...

    # -- enqueue ---------------------------------------------------------------------
    def job_insert_many(
        self, requests: Sequence[EnqueueRequest], conn: Any = None
    ) -> list[InsertResult]:
        """Insert in one transaction (the caller's, when ``conn`` is given)."""
        ...

    async def ajob_insert_many(
        self, requests: Sequence[EnqueueRequest], conn: Any = None
    ) -> list[InsertResult]:
        """:meth:`job_insert_many` for an event loop, which it never blocks: ``conn`` is
        the caller's async connection (an aiosqlite or psycopg ``AsyncConnection``, or an
        SQLAlchemy ``AsyncSession``/``AsyncConnection`` on one), and the jobs commit or
        roll back with its transaction; without one, the store's own connection is used
        in a thread."""
        ...

    # -- the hot path --------------------------------------------------------------
    def job_claim(self, params: ClaimParams) -> list[JobRow]: ...

    def job_finish_many(self, outcomes: Sequence[FinishParams]) -> list[bool]:
        """Write outcomes in one transaction; True where the lease token still matched."""
        ...

    def job_heartbeat_many(self, leases: Sequence[LeaseRef]) -> HeartbeatResult: ...

    def job_release_many(
        self,
        leases: Sequence[LeaseRef],
        message: str = RELEASED,
        *,
        unrun: bool = False,
        prefetched: bool = False,
        delays: Sequence[float] | None = None,
    ) -> list[bool]:
        """Give running jobs back (shutdown): available again, the attempt not charged,
        and recorded in the job's errors (kind ``released``, with ``message``, the attempt
        number and lease token), so the run that follows is explained.

        ``unrun``: their handlers never ran (no child process could be started for them):
        a release like the job's last entry (the same attempt, the same message) is then
        counted in that entry (``times``, its worker, lease token and time the latest's)
        rather than appended. A run's release is always an entry of its own: it names the
        lease token that explains the run (I4).

        ``prefetched``: claimed and never begun (prefetched jobs a stopping worker, or
        one whose lease is in doubt, gives back before a thread took them up): nothing
        happened to them, so nothing is recorded (no entry in errors, ``message`` unused,
        no worker time folded into a fair key's usage) and each is due again in its place
        (its ``run_at`` kept), as if never claimed. Each release appended an entry, so a
        job prefetched at every deploy gained one per deploy, and went to the back of its
        queue. The starts its claim logged for it against rates go back too (one row of
        the claim's token per bucket it counted in), in the same transaction as the
        release, so its next claim counts it once. (SQLite's rate log recorded no token
        before its schema version 17: there such a start stayed counted until its window
        passed.)

        ``delays``: seconds each job waits before it is due again (one per lease; none:
        due at once). A job given a pause is ``retryable`` until its ``run_at`` (now +
        its delay), as after a backoff, still uncharged: a job whose ``ctx.transaction()``
        met a store that cannot write waits a growing pause rather than running again at
        once, in a tight loop for as long as the store cannot write. Unused for
        ``prefetched`` jobs (they keep their ``run_at``)."""
        ...

    # -- maintenance (leader duties) ---------------------------------------------------
    def leader_attempt_elect(self, name: str, owner: str, ttl: float) -> bool: ...

    def leader_resign(self, name: str, owner: str) -> None: ...

    def job_list_expired(self, limit: int) -> list[ExpiredLease]: ...

    def job_rescue_many(self, rescues: Sequence[RescueParams]) -> list[bool]: ...

    def job_promote_due(self, limit: int = PROMOTE_BATCH) -> int:
        """Mark at most ``limit`` scheduled and retryable jobs whose time has come as
        available; how many. (Claims take such jobs as they are: this only relabels.)"""
        ...

    def job_prune(self, older_than: float, limit: int) -> int:
        """Delete completed, cancelled and discarded rows finished before ``older_than`` s ago."""
        ...

    # -- reading -------------------------------------------------------------------------
    def job_get(self, job_id: int, conn: Any = None) -> JobRow | None:
        """One job's row, or None. With ``conn`` — the caller's own connection to this store,
        of the type ``job_insert_many(conn=)`` takes (``capabilities.caller_connection``, or
        a SQLAlchemy Connection/Session on it) — the read runs on that connection, so it
        sees what the caller's open transaction wrote (the Django integration reads a
        task's result this way). The connection is used as given: not checked, committed
        or closed."""
        ...

    def job_list(self, params: ListParams) -> list[JobRow]: ...

    def queue_stats(self) -> list[QueueStats]: ...

    def audit_list(self, limit: int = 100, job_id: int | None = None) -> list[AuditEvent]: ...

    def db_now(self) -> float: ...

    # -- admin actions (audited in the same transaction) --------------------------------
    def job_replay(self, params: ActionParams) -> ActionResult: ...

    def job_discard(self, params: ActionParams) -> ActionResult: ...

    def job_cancel(self, job_id: int, actor: str) -> CancelResult: ...

    def job_edit(self, params: EditParams) -> ActionResult:
        """Edit pending jobs, each a write guarded by its state, audited with the actor in
        the same transaction; ``dry_run`` writes nothing and reports what would change."""
        ...

    # -- durable signals ---------------------------------------------------------------
    def job_signal(self, job_id: int, name: str, payload_json: str, actor: str) -> SignalResult:
        """Store a signal for a job (audited, in one transaction) and, when the job is
        waiting for that name, make it available. Raises JobNotFound, or InvalidTransition
        for a completed, cancelled or discarded job (nothing would ever read it)."""
        ...

    def signal_get(self, job_id: int, name: str) -> str | None:
        """The payload JSON of the first signal ``name`` sent to the job, or None."""
        ...

    def job_list_expired_waits(self, limit: int) -> list[ExpiredWait]: ...

    def job_expire_waits(self, timeouts: Sequence[WaitTimeoutParams]) -> list[bool]: ...

    # -- queues and limits ------------------------------------------------------------------
    def queue_settings(self) -> list[QueueSettings]: ...

    def queue_declare(self, settings: QueueSettings, actor: str) -> None:
        """Store a queue's limits as declared in code (``app.queue``); keeps ``paused``."""
        ...

    def queue_declare_keyed(self, name: str, actor: str) -> None:
        """Mark queue ``name`` as holding job types with per-key limits or rates
        (``jobs_declare_limits``, which only ever turns on), making its row (no limits)
        when it has none: for a queue the caller's code does not declare. Every other
        setting is left as stored, in one statement: another deployment's or an
        operator's, written at any moment, is never put back to an earlier reading."""
        ...

    def queue_set_paused(self, name: str, paused: bool, actor: str) -> None:
        """Pause or resume a queue, audited in the same transaction."""
        ...

    def job_limit_declare(
        self, name: str, queue: str, rate_limit: int | None, rate_period: float | None
    ) -> None: ...

    def fair_weight_set(self, key: str, weight: float | None, actor: str) -> None:
        """Store a fair key's weight (None: back to 1), audited in the same transaction."""
        ...

    def fair_weights(self) -> list[FairWeight]: ...

    def fair_figures(self, queue: str) -> list[FairKeyFigures]:
        """Per fair key of ``queue``: its worker time, dwell and backlog (by key)."""
        ...

    def job_claim_limited(
        self,
        queue: QueueClaim,
        worker_id: str,
        lease_default: float,
        suspects: bool = False,
        names: Sequence[str] | None = None,
        weights: Weigher | None = None,
        express: bool = False,
        turns: int | None = None,
        key_limits: Mapping[str, int] | None = None,
    ) -> list[JobRow]:
        """Claim from a limited queue, one claimer at a time (see backends.limits); only
        job types in ``names`` when it is given (as ``ClaimParams.names``); a fair queue's
        keys without a stored weight weigh what ``weights`` gives them (app.fair_weight).
        ``key_limits``: the claiming worker's own ``concurrency_limit`` per job type (its
        code's): a row is held to the lower of it and the limit stored on the row, so a
        limit lowered in code applies to the rows enqueued before the deploy.
        ``express``: only the next job of each of a fair queue's keys with nothing
        running (a worker's express lane). ``turns``: a suspect claim's round room (the
        fresh claim's after it): in a fair queue it takes the rescued jobs among the first
        ``turns`` of the fair order, at most this claim's ``queue.limit`` of them. The result is a
        ``limits.Claimed``: its ``express`` names the rows that were the first claimed of
        such a key."""
        ...

    def queues_with_limits(self, queues: Sequence[str]) -> set[str]:
        """Which of ``queues`` must be claimed with :meth:`job_claim_limited`: a declared
        cluster-wide limit or rate, or due rows carrying a concurrency key or a rate
        (``job_claim`` never takes those rows)."""
        ...

    def rate_log_prune(self, older_than: float) -> int: ...

    def fair_usage_prune(self, older_than: float, limit: int) -> int:
        """Forget the worker time of fair keys that ended no attempt for ``older_than``
        seconds and have no job running or pending (at most ``limit``): a fair queue with
        a key per user would otherwise keep a row per user ever seen. Their decayed usage
        is nothing by then; their totals (attempts, seconds, dwell) start afresh."""
        ...

    def dead_hooks_due(self, older_than: float, limit: int) -> list[int]:
        """Dead jobs whose ``on_dead`` hooks are due for more than ``older_than`` seconds,
        oldest first, at most ``limit`` (0: none). Records of jobs no longer dead (replayed,
        discarded) are forgotten first. A job's death writes its record in the same
        transaction (a trigger, migration 14), whichever path made it dead."""
        ...

    def dead_hooks_done(self, job_id: int, died_at: float) -> None:
        """The ``on_dead`` hooks of the job's death at ``died_at`` (epoch seconds, its
        finished_at) ran: forget that death's record (a later death keeps its own)."""
        ...

    # -- cron ------------------------------------------------------------------------------
    def cron_states(self) -> list[CronState]: ...

    def cron_save(
        self,
        name: str,
        expression: str,
        timezone: str,
        last_slot: float,
        last_job_id: int | None,
        next_slot: float | None,
        rewind: bool = False,
    ) -> None:
        """Record the latest slot handled (never moving it backwards, but with
        ``rewind``: the database clock was stepped back) and the next one."""
        ...

    # -- effectively-once tools ---------------------------------------------------------
    def step_list(self, job_id: int) -> list[Step]: ...

    def step_store(
        self, job_id: int, name: str, result_json: str, attempt: int, conn: Any = None
    ) -> str:
        """Store a step result unless one exists (also inside ``conn``'s open transaction);
        return the stored JSON, which is the first writer's."""
        ...

    def tx_begin(self) -> Any:
        """Open the transaction ``ctx.transaction()`` hands to a handler."""
        ...

    def tx_finish(self, conn: Any, outcome: FinishParams) -> bool:
        """Write the fenced outcome (and children) in ``conn``'s transaction and commit all
        of it; roll all of it back and return False when the lease token is stale."""
        ...

    def tx_rollback(self, conn: Any) -> None: ...

    def tx_abandon(self, conn: Any) -> None:
        """End ``conn``'s transaction, uncommitted, from another thread than the
        handler's, which may still be running a statement on it: never wait for that
        statement (it is cancelled). The connection is closed (the handler's next use of
        it fails) and given back."""
        ...

    def configure_worker(self, concurrency: int, lease: float | None = None) -> None:
        """A worker in this process runs up to ``concurrency`` handlers at once (called
        once, at its start): size what handlers hold (PostgreSQL: the connections of
        ``ctx.transaction()``), and raise ConfigurationError, naming the setting and the
        fix, when the store cannot serve that many. ``lease``: the app's job lease, which
        sets how long the store lets one of errands' own transactions idle (PostgreSQL)."""
        ...

    # -- the worker registry ------------------------------------------------------------
    def worker_register(self, info: WorkerInfo) -> None: ...

    def worker_heartbeat(self, worker_id: str, in_flight: int, processed: int) -> bool:
        """Update the worker's registry row; False when it has none (forgotten)."""
        ...

    def worker_deregister(self, worker_id: str) -> None: ...

    def worker_list(self) -> list[WorkerInfo]: ...

    def job_count_pending_by_name(self) -> dict[str, int]:
        """Scheduled, available and retryable jobs per job type."""
        ...

    def worker_prune(self, older_than: float) -> int: ...

    # -- wake-ups ------------------------------------------------------------------------
    def listener(self, on_queue: Callable[[str | None], None]) -> Listener | None:
        """A service calling ``on_queue(queue)`` when jobs may be due (None: any queue)."""
        ...

    def result_listener(
        self,
        on_done: Callable[[list[int] | None], None],
        on_listen: Callable[[], None],
        on_lost: Callable[[], None] | None = None,
    ) -> Listener | None:
        """A service calling ``on_done(ids)`` when jobs ended (None: some may have, ask
        :meth:`job_states`), ``on_listen()`` whenever it (re)starts listening, and
        ``on_lost()`` as soon as it stops (its connection lost); its ``listening`` event
        is set while it listens. None: this store cannot push (waiters poll). One per
        process serves every waiter (errands.results)."""
        ...

    def job_states(self, ids: Sequence[int]) -> dict[int, str]:
        """The state of each job of ``ids`` that exists."""
        ...

    def job_get_many(self, ids: Sequence[int]) -> list[JobRow]:
        """The rows of the jobs of ``ids`` that exist, in no set order (one query: the
        result hub reads every job a notification ended at once)."""
        ...

    # -- the dashboard ---------------------------------------------------------------------
    def job_throughput(self, since_seconds: float, bucket_seconds: float) -> list[ThroughputBucket]:
        """Completed and dead jobs and failed attempts per queue and time bucket, oldest first."""
        ...

    def job_find_by_key(self, key: str, limit: int = 50) -> list[JobRow]:
        """Jobs whose idempotency key is ``key``, under any job name, newest first."""
        ...

    def job_count_by_queue(self, state: str) -> dict[str, int]:
        """How many jobs are in ``state``, per queue (cheap for the small states)."""
        ...

    def job_names(self, limit: int = 1000) -> list[str]:
        """The distinct job names stored, in order (one index probe per name)."""
        ...

    def queue_forget(self, name: str, actor: str) -> bool:
        """Delete a queue's stored settings (paused flag, limits), audited; False when it
        had none."""
        ...

    # -- workflows (errands.workflows; the SQL in each backend's workflows.sql) -----------
    def workflow_insert(self, spec: WorkflowSpec, conn: Any = None) -> WorkflowInserted:
        """Store a workflow, its members (dependents waiting), edges and pending set in
        one transaction (the caller's, when ``conn`` is given)."""
        ...

    async def aworkflow_insert(self, spec: WorkflowSpec, conn: Any = None) -> WorkflowInserted:
        """:meth:`workflow_insert` for an event loop (``conn``: the caller's async
        connection, as :meth:`ajob_insert_many` takes)."""
        ...

    def workflow_get(self, workflow_id: int) -> WorkflowRow | None: ...

    def workflow_list(
        self, state: str | None = None, before_id: int | None = None, limit: int = 100
    ) -> list[WorkflowRow]:
        """Workflows newest first (keyset pagination on ``before_id``)."""
        ...

    def workflow_members(
        self, workflow_id: int, after: int = 0, limit: int = 1000
    ) -> list[MemberRow]: ...

    def workflow_parent_results(
        self, job_id: int, after: int = 0, limit: int = 100
    ) -> list[ParentResultRow]:
        """The parents of member ``job_id`` with ids above ``after``, in id order."""
        ...

    def workflow_prune(self, older_than: float, limit: int, rows: int | None = None) -> int:
        """Delete up to ``limit`` workflows settled more than ``older_than`` s ago (their
        own rows), oldest first, and whole trees of nested ones holding about ``rows``
        rows at most (the first whatever its size; None: WORKFLOW_PRUNE_ROWS, so that no
        call holds the store's locks for an unbounded delete); how many went."""
        ...

    def workflow_take_settled(self) -> list[Settled]:
        """The workflows settled by this thread's store calls since the last call (read
        after a finish, rescue or cancel returned: they committed), for events."""
        ...

    def workflow_take_released(self) -> set[str]:
        """The queues into which this thread's last :meth:`job_finish_many` released
        dependents or inserted callbacks (read once it returned: committed). The worker
        that wrote the finish claims them at once, without waiting for a wake-up."""
        ...

    def workflow_cancel(self, workflow_id: int, actor: str) -> int:
        """Cancel pending members, ask running ones to stop (audited); raises
        JobNotFound for an unknown workflow."""
        ...

    # -- health --------------------------------------------------------------------------
    def store_health(self) -> StoreHealth:
        """Table bloat and long-transaction signals (one cheap query; for metrics)."""
        ...

    def wal_trim(self) -> None:
        """The maintenance leader, each tick: SQLite empties its write-ahead log once a
        long reader let it grow past its limit, never waiting on readers or writers;
        nothing on PostgreSQL."""
        ...


class Listener(Protocol):
    self_test_passed: bool | None
    listening: threading.Event  # set while notifications are received

    def start(self) -> None: ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class ThroughputBucket:
    """One queue's outcomes in one time bucket (``at``: bucket start, epoch seconds)."""

    at: float
    queue: str
    completed: int
    dead: int
    failed: int  # failed attempts (retried or not), each counted when its error was recorded


def release_pauses(leases: Sequence[Any], delays: Sequence[float] | None) -> list[float]:
    """The pause of each lease a release gives back (see ``job_release_many``): 0 without
    ``delays``; never negative (nor NaN), at most a year."""
    if delays is None:
        return [0.0] * len(leases)
    if len(delays) != len(leases):
        raise ValueError(f"{len(delays)} release delay(s) for {len(leases)} lease(s)")
    return [min(float(d), 365 * 86400.0) if float(d) > 0 else 0.0 for d in delays]


def writes_several(requests: Sequence[EnqueueRequest]) -> bool:
    """Whether enqueueing ``requests`` takes more than one statement (a batch, or a key:
    its release and lookup); on a caller's autocommit connection such an enqueue runs in
    a transaction of its own, so it is stored whole or not at all."""
    return len(requests) > 1 or requests[0].key is not None


def insert_params(req: EnqueueRequest) -> dict[str, Any]:
    """The named parameters of one job's ``job_insert`` (the same names on every backend)."""
    return {
        "name": req.name,
        "queue": req.queue,
        "args": req.args_json,
        "meta": json.dumps(req.meta, separators=(",", ":")) if req.meta else "{}",
        "priority": req.priority,
        "max_attempts": req.max_attempts,
        "run_at": req.run_at,
        "delay": req.delay,
        "key": req.key,
        "timeout": req.timeout,
        "lease_seconds": req.lease_seconds,
        "parent_id": req.parent_id,
        "unique_for": req.unique_for,
        "concurrency_key": req.concurrency_key,
        "concurrency_limit": req.concurrency_limit,
        "rate_limit": req.rate_limit,
        "rate_period": req.rate_period,
        "fair_key": req.fair_key,
    }


def warn_newer_schema(log: logging.Logger, where: str, current: int, needed: int) -> None:
    """The one warning of a store whose schema is newer than this errands (``where``: the
    store as its backend names it): it runs on it, as the workers of the previous release
    do during a rolling deploy."""
    log.warning(
        "%s has errands schema version %d, newer than this errands (%d): running on it, as "
        "the workers of the previous release do during a rolling deploy; upgrade errands "
        "on this host",
        where, current, needed,
    )  # fmt: skip
