"""The worker's clock for leases: seconds that go on counting while the host is suspended.

A lease runs on the database's clock, which goes on while this host sleeps. The worker's
own view of a lease (until when it surely holds, when to self-fence, whether a step may
still start, when a handler's time is up) must count that time too. ``time.monotonic()``
does not on Linux (CLOCK_MONOTONIC stops during a suspend): a laptop or VM resumed after
a suspend longer than its leases believed them valid while the store had let them run
out, and perhaps handed the jobs to another worker; its handlers went on, starting
steps, beside the new attempts, until the next heartbeat said otherwise.

:func:`now` reads CLOCK_BOOTTIME where there is one (Linux: CLOCK_MONOTONIC plus the time
suspended), else ``time.monotonic()``. Only differences between two of its readings mean
anything. Every time kept on an attempt (its start, lease, deadline, self-fencing steps,
end) and by the lease keeper and the leader's renewal is read from it, so that they
compare with one another; plain waits and pauses elsewhere keep ``time.monotonic()``.
"""

from __future__ import annotations

import time

_BOOTTIME: int | None = getattr(time, "CLOCK_BOOTTIME", None)


def now() -> float:
    """Seconds on a clock that never goes back and counts the host's suspends."""
    if _BOOTTIME is None:
        return time.monotonic()
    return time.clock_gettime(_BOOTTIME)


__all__ = ["now"]
