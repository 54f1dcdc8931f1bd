"""Backoff policies: how long a transiently failed job waits before its next attempt."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

BASE_DELAY_DEFAULT = 2.0
FACTOR_DEFAULT = 2.0
MAX_DELAY_DEFAULT = 3600.0
JITTER_DEFAULT = 0.25


class BackoffPolicy(Protocol):
    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        ...


@dataclass(frozen=True)
class ExponentialBackoff:
    """``base * factor**(attempt-1)`` seconds, capped at ``max_delay``, then ``± jitter``.

    The defaults give 2 s, 4 s, 8 s for the first three retries, each within ±25 %.
    """

    base: float = BASE_DELAY_DEFAULT
    factor: float = FACTOR_DEFAULT
    max_delay: float = MAX_DELAY_DEFAULT
    jitter: float = JITTER_DEFAULT

    def __post_init__(self) -> None:
        if self.base < 0 or self.factor < 1 or self.max_delay < 0 or not 0 <= self.jitter < 1:
            raise ValueError(
                "ExponentialBackoff needs base >= 0, factor >= 1, max_delay >= 0 and "
                f"0 <= jitter < 1; got {self}"
            )

    def delay(self, attempt: int) -> float:
        raw = min(self.base * self.factor ** max(attempt - 1, 0), self.max_delay)
        if self.jitter:
            raw *= 1 + random.uniform(-self.jitter, self.jitter)
        return max(raw, 0.0)


@dataclass(frozen=True)
class CallableBackoff:
    fn: Callable[[int], float]

    def delay(self, attempt: int) -> float:
        value = float(self.fn(attempt))
        if value < 0:
            raise ValueError(f"backoff callable returned {value} for attempt {attempt}; need >= 0")
        return value


DEFAULT_BACKOFF = ExponentialBackoff()


def as_backoff(value: BackoffPolicy | Callable[[int], float] | float | None) -> BackoffPolicy:
    """Accept a policy object, a callable ``attempt -> seconds``, a constant, or None."""
    if value is None:
        return DEFAULT_BACKOFF
    if hasattr(value, "delay"):
        return value  # type: ignore[return-value]
    if callable(value):
        return CallableBackoff(value)
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"backoff={value!r}: a constant backoff must be >= 0 seconds")
        return ExponentialBackoff(base=float(value), factor=1.0, jitter=0.0)
    raise TypeError(
        f"backoff={value!r}: pass an ExponentialBackoff, a callable attempt -> seconds, "
        "or a number of seconds"
    )
