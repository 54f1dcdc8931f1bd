"""What the test tools report: every run of a handler, a drain, a duplicate-delivery check."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

RunOutcome = Literal[
    "completed", "retryable", "dead", "cancelled", "waiting", "crashed", "rejected", "released"
]


@dataclass(frozen=True)
class Run:
    """One execution of one job's handler by a test worker.

    ``outcome`` is what the store recorded: ``completed``, ``retryable``, ``dead`` or
    ``cancelled``; ``crashed`` when the attempt died as a simulated crash (nothing
    recorded; the job is rescued after its lease); ``rejected`` when the fence refused
    the outcome (a stale or duplicate delivery); ``released`` when the job was given
    back, the attempt not charged (its ``ctx.transaction()`` met a store that cannot
    write: it runs again after a pause). ``error`` is the exception the handler
    raised, if any. ``duplicate`` marks the extra delivery of the duplicate-delivery mode.
    """

    job_id: int
    name: str
    queue: str
    attempt: int
    outcome: RunOutcome
    error: BaseException | None = None
    duplicate: bool = False

    def __repr__(self) -> str:
        extra = f" error={type(self.error).__name__}" if self.error is not None else ""
        dup = " duplicate" if self.duplicate else ""
        return f"<Run job {self.job_id} {self.name} #{self.attempt} {self.outcome}{extra}{dup}>"


@dataclass
class DrainResult:
    """What one ``drain()`` did: every run in order, and how far it moved the clock."""

    runs: list[Run] = field(default_factory=list)
    rescued: int = 0  # crashed attempts whose expired lease the drain rescued
    advanced: float = 0.0  # seconds the clock moved to make retries due

    def count(self, outcome: RunOutcome) -> int:
        return sum(1 for r in self.runs if r.outcome == outcome and not r.duplicate)

    @property
    def completed(self) -> int:
        return self.count("completed")

    @property
    def retried(self) -> int:
        """Attempts that failed and were scheduled to run again."""
        return self.count("retryable")

    @property
    def dead(self) -> int:
        return self.count("dead")

    @property
    def crashed(self) -> int:
        return self.count("crashed")

    @property
    def outcomes(self) -> Counter[str]:
        return Counter(r.outcome for r in self.runs if not r.duplicate)

    @property
    def errors(self) -> list[BaseException]:
        return [r.error for r in self.runs if r.error is not None]

    def __len__(self) -> int:
        return sum(1 for r in self.runs if not r.duplicate)

    def __repr__(self) -> str:
        counts = ", ".join(f"{k}={v}" for k, v in sorted(self.outcomes.items())) or "nothing"
        return f"<DrainResult {counts}; rescued={self.rescued} advanced={self.advanced:g}s>"


@dataclass(frozen=True)
class Difference:
    """A job whose recorded effects changed when it was delivered again."""

    job_id: int
    name: str
    variant: Literal["duplicate", "crash"]
    before: Any  # the effects snapshot after the first delivery
    after: Any  # the effects snapshot after the extra delivery

    def __str__(self) -> str:
        when = (
            "a second delivery after it completed"
            if self.variant == "duplicate"
            else "a second delivery after the first crashed past its side effects"
        )
        return (
            f"job {self.job_id} ({self.name}): {when} changed the recorded effects\n"
            f"    before: {self.before!r}\n    after:  {self.after!r}"
        )


@dataclass
class DuplicateReport:
    """The outcome of a duplicate-delivery drain (``Tester.drain_duplicated``)."""

    variant: Literal["duplicate", "crash"]
    drain: DrainResult
    checked: list[int] = field(default_factory=list)  # job ids delivered twice
    differences: list[Difference] = field(default_factory=list)

    @property
    def non_idempotent(self) -> list[str]:
        """The job names (handlers) whose recorded effects differed, sorted."""
        return sorted({d.name for d in self.differences})

    @property
    def ok(self) -> bool:
        return not self.differences

    def assert_idempotent(self) -> None:
        """Raise AssertionError naming every handler whose effects differed."""
        if self.differences:
            details = "\n".join(str(d) for d in self.differences[:10])
            more = len(self.differences) - 10
            if more > 0:
                details += f"\n... and {more} more"
            raise AssertionError(
                f"not idempotent under {self.variant} delivery: "
                f"{', '.join(self.non_idempotent)}\n{details}"
            )

    def __repr__(self) -> str:
        verdict = "ok" if self.ok else f"non-idempotent: {', '.join(self.non_idempotent)}"
        return f"<DuplicateReport {self.variant} checked={len(self.checked)} {verdict}>"
