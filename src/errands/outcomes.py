"""Typed outcomes a handler raises to steer its own fate.

``raise errands.Permanent("card declined")`` sends the job to the dead-letter queue at
once; ``raise errands.Retry(after=30)`` asks for another attempt after that delay (it
still counts as an attempt). Anything else a handler raises is a transient failure and
is retried with the job's backoff policy.
"""

from __future__ import annotations

import math
from datetime import timedelta


class Permanent(Exception):
    """Fail the job for good: no retry, straight to the dead-letter queue."""


class Retry(Exception):
    """Retry the job after ``after`` (seconds or a timedelta); counts as an attempt."""

    def __init__(self, reason: str = "retry requested", *, after: float | timedelta = 0) -> None:
        super().__init__(reason)
        seconds = after.total_seconds() if isinstance(after, timedelta) else float(after)
        if not 0 <= seconds < math.inf:  # NaN fails this too
            raise ValueError(f"Retry(after=...) must be a finite number >= 0 seconds, got {after}")
        self.after = seconds  # the worker waits at most a year (errands.retry.DELAY_LIMIT)
