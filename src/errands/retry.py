"""Backoff policies: how long a transiently failed job waits before its next attempt.

A policy is user code (``backoff=`` takes any callable), so the worker never calls it
bare: :func:`retry_delay` turns whatever it raises or returns (an exception, a negative,
infinite or non-numeric delay) into the default policy's delay and a logged warning. A
raising backoff must never keep a job from its outcome, or a rescue from its tick.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .hooks import BACKOFF_TIMEOUT, shared_runner

log = logging.getLogger("errands.worker")

BASE_DELAY_DEFAULT = 2.0
FACTOR_DEFAULT = 2.0
MAX_DELAY_DEFAULT = 3600.0
JITTER_DEFAULT = 0.25
# The longest wait any policy may ask for (a year): a delay beyond it is clamped, so a
# policy's arithmetic never overflows the store's interval or timestamp types.
DELAY_LIMIT = 365 * 86400.0


class BackoffPolicy(Protocol):
    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        ...


@dataclass(frozen=True)
class ExponentialBackoff:
    """``base * factor**(attempt-1)`` seconds, ``± jitter``, at most ``max_delay``.

    The defaults give 2 s, 4 s, 8 s for the first three retries, each within ±25 %.
    ``max_delay`` bounds the wait *after* jitter: no delay ever exceeds it (at the cap,
    the jitter only shortens the wait). The exponent stops growing once the cap is
    reached, so any attempt number is safe (no overflow at attempt 1025).
    """

    base: float = BASE_DELAY_DEFAULT
    factor: float = FACTOR_DEFAULT
    max_delay: float = MAX_DELAY_DEFAULT
    jitter: float = JITTER_DEFAULT

    def __post_init__(self) -> None:
        values = (self.base, self.factor, self.max_delay, self.jitter)
        if (
            not all(isinstance(v, int | float) and math.isfinite(v) for v in values)
            or self.base < 0
            or self.factor < 1
            or self.max_delay < 0
            or not 0 <= self.jitter < 1
        ):
            raise ValueError(
                "ExponentialBackoff needs finite numbers with base >= 0, factor >= 1, "
                f"max_delay >= 0 and 0 <= jitter < 1; got {self}"
            )

    def nominal(self, attempt: int) -> float:
        """The delay before jitter: ``base * factor**(attempt-1)``, capped."""
        exponent = max(attempt - 1, 0)
        if self.base == 0:
            return 0.0
        if self.factor > 1:
            # factor**k > max_delay/base once k passes this; stop there (no overflow)
            ceiling = math.log(max(self.max_delay, self.base) / self.base, self.factor) + 1
            exponent = min(exponent, math.ceil(ceiling))
        return min(self.base * self.factor**exponent, self.max_delay)

    def delay(self, attempt: int) -> float:
        raw = self.nominal(attempt)
        if self.jitter:
            raw *= 1 + random.uniform(-self.jitter, self.jitter)
        return min(max(raw, 0.0), self.max_delay)


@dataclass(frozen=True)
class CallableBackoff:
    fn: Callable[[int], float]

    def delay(self, attempt: int) -> float:
        value = float(self.fn(attempt))
        if value < 0:
            raise ValueError(f"backoff callable returned {value} for attempt {attempt}; need >= 0")
        return value


DEFAULT_BACKOFF = ExponentialBackoff()


def retry_delay(
    policy: BackoffPolicy | None,
    attempt: int,
    *,
    job: str = "",
    broken: set[str] | None = None,
) -> float:
    """The delay ``policy`` asks for after failed attempt ``attempt``, made safe: a policy
    that raises, takes longer than ``BACKOFF_TIMEOUT`` (it runs on a lane of its own, see
    :mod:`errands.hooks`), or returns something that is not a finite number >= 0 is
    replaced by the default policy for this delay (logged as a warning naming the job
    type); the result is at most :data:`DELAY_LIMIT`. Never raises.

    ``broken``: job types whose policy failed earlier in the same batch (a rescue's): it
    is not asked again there, and a job type whose policy fails joins it. A hanging
    policy cost every row of a 500-row rescue its BACKOFF_TIMEOUT, one after another."""
    if broken is not None and job in broken:
        policy = None
    if policy is not None and policy is not DEFAULT_BACKOFF:
        try:
            if type(policy) is ExponentialBackoff:  # errands' own arithmetic: safe inline
                value = policy.delay(attempt)
            else:  # user code: on a lane of its own, with a deadline (it may hang)
                lane = shared_runner().lane("backoff")
                value = float(
                    lane.call(
                        policy.delay, attempt, timeout=BACKOFF_TIMEOUT, what=f"backoff of {job!r}"
                    )
                )
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"it returned {value!r}; a delay must be a finite number >= 0")
            return min(value, DELAY_LIMIT)
        except (Exception, TimeoutError) as exc:
            if broken is not None:
                broken.add(job)
            log.warning(
                "the backoff of job type %r failed for attempt %s (%s: %s); using the default "
                "backoff for this retry",
                job or "?",
                attempt,
                type(exc).__name__,
                exc,
            )
    try:
        return min(DEFAULT_BACKOFF.delay(attempt), DELAY_LIMIT)
    except Exception:  # pragma: no cover - the default policy cannot fail; belt and braces
        return MAX_DELAY_DEFAULT


def as_backoff(value: BackoffPolicy | Callable[[int], float] | float | None) -> BackoffPolicy:
    """Accept a policy object, a callable ``attempt -> seconds``, a constant, or None."""
    if value is None:
        return DEFAULT_BACKOFF
    if hasattr(value, "delay"):
        return value  # type: ignore[return-value]
    if callable(value):
        return CallableBackoff(value)
    if isinstance(value, int | float):
        if value < 0 or not math.isfinite(value):
            raise ValueError(f"backoff={value!r}: a constant backoff must be >= 0 seconds")
        return ExponentialBackoff(base=float(value), factor=1.0, jitter=0.0)
    raise TypeError(
        f"backoff={value!r}: pass an ExponentialBackoff, a callable attempt -> seconds, "
        "or a number of seconds"
    )
