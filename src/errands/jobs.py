"""The job record, its states, and the pieces of an enqueue request."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from .errors import ConfigurationError
from .jsontext import loads_stored


class JobState(StrEnum):
    """Where a job is in its life. See DESIGN §2 for the state diagram."""

    SCHEDULED = "scheduled"
    AVAILABLE = "available"
    RUNNING = "running"
    RETRYABLE = "retryable"
    COMPLETED = "completed"
    DEAD = "dead"
    DISCARDED = "discarded"
    CANCELLED = "cancelled"
    WAITING = "waiting"  # suspended in ctx.wait_for_signal: no lease, no slot

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES

    @property
    def is_pending(self) -> bool:
        return self in PENDING_STATES


PENDING_STATES = frozenset({JobState.SCHEDULED, JobState.AVAILABLE, JobState.RETRYABLE})
# A job a handle waits on is over in these states; ``dead`` can still be replayed.
TERMINAL_STATES = frozenset(
    {JobState.COMPLETED, JobState.DEAD, JobState.DISCARDED, JobState.CANCELLED}
)
ALL_STATES = tuple(s.value for s in JobState)


def parse_state(value: str | JobState) -> JobState:
    try:
        return JobState(value)
    except ValueError:
        raise ValueError(
            f"unknown job state {value!r}; choose one of: {', '.join(ALL_STATES)}"
        ) from None


def to_datetime(epoch: float | None) -> datetime | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, tz=UTC)


DUE_MIN, _DUE_MAX = -62_135_596_800.0, 253_402_300_799.0  # years 1 to 9999, as datetime
# The largest id (and row count) a store keeps: SQLite's INTEGER, PostgreSQL's bigint.
ID_MAX = 2**63 - 1


def listed_by_priority(state: str | None, queue: str | None) -> bool:
    """Whether a listing with these filters comes by priority and due time (available
    jobs of one queue: paged with a cursor, :attr:`Job.cursor`) instead of newest first."""
    return state == "available" and bool(queue)


def parse_cursor(text: object) -> tuple[int, float, int]:
    """A listing cursor (:attr:`Job.cursor`, "PRIORITY:DUE:ID") as (priority, due time in
    epoch seconds, id); ConfigurationError naming the form when it is not one."""
    parts = text.split(":") if isinstance(text, str) else []
    try:
        priority, due, job_id = int(parts[0]), float(parts[1]), int(parts[2])
        if (
            len(parts) != 3
            or not -(2**31) <= priority < 2**31
            or not 0 < job_id <= ID_MAX
            or not DUE_MIN <= due <= _DUE_MAX
        ):
            raise ValueError
    except (ValueError, IndexError):
        raise ConfigurationError(
            f"after={text!r}: give the last Job of the previous page, or its cursor "
            "(PRIORITY:DUE_SECONDS:ID, as the dashboard's and the CLI's next-page links "
            "carry it)"
        ) from None
    return priority, due, job_id


@dataclass(frozen=True)
class JobError:
    """One failed attempt: when, which attempt, what was raised, and by which worker."""

    at: datetime
    attempt: int
    type: str
    message: str
    traceback: str | None
    worker: str | None
    kind: str = ""  # permanent, transient, timeout, retry, cancelled, worker_lost, poison
    # Releases in a row for one reason, counted in one entry (kind ``released``): its
    # ``at``, ``worker`` the latest's.
    times: int = 1

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobError:
        return cls(
            at=to_datetime(data.get("at")) or datetime.fromtimestamp(0, tz=UTC),
            attempt=int(data.get("attempt", 0)),
            type=str(data.get("type", "")),
            message=str(data.get("message", "")),
            traceback=data.get("traceback"),
            worker=data.get("worker"),
            kind=str(data.get("kind") or ""),
            times=_count(data.get("times")),
        )


def _count(value: Any) -> int:
    """A stored count (at least 1; 1 when missing or unreadable)."""
    try:
        return max(int(value), 1)
    except (TypeError, ValueError, OverflowError):
        return 1


@dataclass(frozen=True)
class Progress:
    """What a running handler last reported with ``ctx.progress`` (stored with a heartbeat).

    .. versionadded:: 0.2
    """

    fraction: float  # 0.0 to 1.0
    message: str = ""


@dataclass(frozen=True)
class Job:
    """A snapshot of one job row, as returned by ``app.get_job`` and ``app.jobs``."""

    id: int
    name: str
    queue: str
    args: dict[str, Any]
    meta: dict[str, Any]
    state: JobState
    priority: int
    attempt: int
    max_attempts: int
    run_at: datetime
    idempotency_key: str | None
    errors: list[JobError]
    result: Any
    inserted_at: datetime
    attempted_at: datetime | None
    finished_at: datetime | None
    lease_owner: str | None = None
    lease_expires_at: datetime | None = None
    rescues: int = 0
    cancel_requested: bool = False
    timeout: float | None = None
    lease_seconds: float | None = None
    discarded_by: str | None = None
    discard_reason: str | None = None
    parent_id: int | None = None  # the job whose completion inserted this one
    progress: Progress | None = None  # ctx.progress of the attempt running now (or last)
    waiting_for: str | None = None  # state waiting: the signal it waits for
    wait_until: datetime | None = None  # ... and until when (None: no timeout)
    # run_at as the store keeps it (epoch seconds, to the last bit: SQLite's carry digits
    # below the microsecond that run_at, a datetime, rounds away): for ``cursor``.
    _due: float | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def last_error(self) -> JobError | None:
        return self.errors[-1] if self.errors else None

    @property
    def cursor(self) -> str:
        """Where a listing by priority and due time goes on after this job (``app.jobs(
        state="available", queue=..., after=job.cursor)``): its priority, due time (epoch
        seconds, exactly as stored) and id, as ``"PRIORITY:DUE:ID"``. The values, not a
        reference to the row: the row may be claimed, retried or edited before the next
        page is read."""
        due = self._due
        if due is None or to_datetime(due) != self.run_at:  # built by hand, or replaced
            due = self.run_at.timestamp()
        return f"{self.priority}:{due!r}:{self.id}"

    @property
    def sensitive(self) -> list[str]:
        names = self.meta.get("sensitive", []) if isinstance(self.meta, dict) else []
        return [n for n in names if isinstance(n, str)]

    @property
    def masked_args(self) -> dict[str, Any]:
        """The arguments with every ``sensitive=`` field shown as ``***``."""
        hidden = set(self.sensitive)
        if not isinstance(self.args, dict):
            return {"__corrupt__": "***"} if hidden else {"__corrupt__": self.args}
        if set(self.args) == {"__corrupt__"}:  # unparseable JSON, kept raw by _loads
            return {"__corrupt__": "***"} if hidden else dict(self.args)
        return {k: ("***" if k in hidden else v) for k, v in self.args.items()}

    @property
    def masked_key(self) -> str | None:
        """The idempotency key, a sensitive argument's value in it shown as ``***``
        (``key=f"welcome:{email}"`` with ``email`` sensitive)."""
        if self.idempotency_key is None or not self.sensitive:
            return self.idempotency_key
        if not isinstance(self.args, dict) or set(self.args) == {"__corrupt__"}:
            return "***"  # its sensitive values cannot be told apart: as masked_args
        from .masking import mask_text, sensitive_values

        return mask_text(self.idempotency_key, sensitive_values(self))


@dataclass(slots=True)
class JobRow:
    """The raw row a backend returns (times as epoch seconds, JSON still encoded)."""

    id: int
    name: str
    queue: str
    args: str
    meta: str
    state: str
    priority: int
    attempt: int
    max_attempts: int
    run_at: float
    idempotency_key: str | None
    errors: str
    result: str | None
    inserted_at: float
    attempted_at: float | None
    finished_at: float | None
    lease_owner: str | None
    lease_token: str | None
    lease_expires_at: float | None
    rescues: int
    cancel_requested: int
    timeout: float | None
    lease_seconds: float | None
    discarded_by: str | None
    discard_reason: str | None
    parent_id: int | None = None
    unique_until: float | None = None  # set when the key was enqueued with unique_for
    progress: float | None = None
    progress_message: str | None = None
    wait_signal: str | None = None
    wait_until: float | None = None
    fair_key: str | None = None  # the job's key in a fair queue (the fold needs to know)
    # its workflow (PostgreSQL rows; None on SQLite, whose finish does not need it)
    workflow_id: int | None = None

    def to_job(self) -> Job:
        job = Job(
            id=self.id,
            name=self.name,
            queue=self.queue,
            args=_loads(self.args, {}),
            meta=_loads(self.meta, {}),
            state=JobState(self.state),
            priority=self.priority,
            attempt=self.attempt,
            max_attempts=self.max_attempts,
            run_at=to_datetime(self.run_at),  # type: ignore[arg-type]
            idempotency_key=self.idempotency_key,
            errors=[JobError.from_dict(e) for e in _loads(self.errors, [])],
            result=_loads(self.result, None),
            inserted_at=to_datetime(self.inserted_at),  # type: ignore[arg-type]
            attempted_at=to_datetime(self.attempted_at),
            finished_at=to_datetime(self.finished_at),
            lease_owner=self.lease_owner,
            lease_expires_at=to_datetime(self.lease_expires_at),
            rescues=self.rescues,
            cancel_requested=bool(self.cancel_requested),
            timeout=self.timeout,
            lease_seconds=self.lease_seconds,
            discarded_by=self.discarded_by,
            discard_reason=self.discard_reason,
            parent_id=self.parent_id,
            progress=None
            if self.progress is None
            else Progress(self.progress, self.progress_message or ""),
            waiting_for=self.wait_signal,
            wait_until=to_datetime(self.wait_until),
        )
        object.__setattr__(job, "_due", self.run_at)  # frozen: set once, here
        return job


JOB_COLUMNS = tuple(JobRow.__slots__)  # type: ignore[attr-defined]


def _loads(text: str | None, default: Any) -> Any:
    """Decode stored JSON; a corrupted value is shown as its raw text, never raised."""
    if text is None:
        return default
    try:
        return loads_stored(text)  # an int of more than 4,300 digits, stored before 2026-12-06
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's stack
        return {"__corrupt__": text} if isinstance(default, dict) else text


@dataclass(slots=True)
class EnqueueRequest:
    """One job to insert, validated and encoded (what ``JobDefinition.bind`` returns)."""

    name: str
    queue: str
    args_json: str
    priority: int
    max_attempts: int
    delay: float
    run_at: float | None
    key: str | None
    timeout: float | None
    lease_seconds: float | None
    meta: dict[str, Any] = field(default_factory=dict)
    parent_id: int | None = None
    unique_for: float | None = None  # seconds the key stays unique; None: while the row exists
    concurrency_key: str | None = None  # at most concurrency_limit running per key, cluster-wide
    concurrency_limit: int | None = None
    rate_limit: int | None = None  # the job type's rate (starts per rate_period), on the row
    rate_period: float | None = None
    fair_key: str | None = None  # the tenant a fair queue shares its workers among

    @property
    def limited(self) -> bool:
        """Whether the row carries a limit its claim must respect (a key or a rate)."""
        return self.concurrency_key is not None or self.rate_limit is not None


@dataclass(frozen=True)
class Step:
    """One durable step's stored result (``ctx.step``)."""

    job_id: int
    name: str
    result: Any
    attempt: int
    created_at: datetime
