"""When a worker's child processes cannot start: the jobs wait, the claims pause.

A job whose child process could not start (the app failed to import in it, the
forkserver and ``spawn`` both failed, a fork refused for want of memory or processes)
did nothing: it is released (available again, its attempt not charged, the release
recorded on the job with the reason), never failed. It was failed as a charged attempt,
and on its last attempt sent to the dead-letter queue, for a fault of the machine's.

So that a pool that cannot start children does not spin claiming and releasing, each
failure pauses the claims that would need a child: ``START_PAUSE`` seconds after the
first, doubling with each failure in a row up to ``START_PAUSE_MAX`` (failures within a
pause, the rest of a burst, count as one). A child that starts ends the pause. The
process pool's jobs all need a child: the worker claims nothing meanwhile. The suspects'
children only run rescued jobs: the worker claims no rescued job meanwhile (other
workers take them) and runs everything else.

A process pool whose children still cannot start after ``GIVE_UP_AFTER`` failures in a
row spanning ``GIVE_UP_SPAN`` seconds, none started since, cannot run its jobs at all:
the worker logs an error saying why and stops (gracefully: what runs finishes), exiting
1, so that its supervisor (systemd, Kubernetes, ``--processes``) sees a failed worker
and restarts it, rather than a worker that looks alive and runs nothing.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("errands.worker")

START_PAUSE = 1.0  # seconds the claims pause after a first failure in a row
START_PAUSE_MAX = 30.0
GIVE_UP_AFTER = 5  # failures in a row (pauses, see above) ...
GIVE_UP_SPAN = 60.0  # ... spanning at least this many seconds: the process pool gives up


class StartFailures:
    """The child starts of one runner that failed since the last that worked, and the
    pause they ask of the claims that would need a child. ``waiting``: what the worker
    claims none of meanwhile, for its log line."""

    def __init__(self, waiting: str) -> None:
        self.waiting = waiting
        self.total = 0  # failed starts, ever
        self.in_a_row = 0  # pauses since the last start that worked
        self.last = ""  # why the last one failed
        self._first_at = 0.0
        self._until = 0.0
        self._hopeless = False
        self._lock = threading.Lock()

    def failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            self.total += 1
            self.last = f"{type(exc).__name__}: {exc}"
            if now < self._until:  # the rest of a burst: one pause for them all
                return
            if not self.in_a_row:
                self._first_at = now
            self.in_a_row += 1
            pause = min(START_PAUSE * 2 ** (self.in_a_row - 1), START_PAUSE_MAX)
            self._until = now + pause
            in_a_row = self.in_a_row
            # judged as a start fails, never later: failures long past, with no start
            # tried since, say nothing of the children that would start now
            self._hopeless = in_a_row >= GIVE_UP_AFTER and now - self._first_at >= GIVE_UP_SPAN
        log.warning(
            "worker child processes cannot start (%s; %d time(s) in a row): %s are claimed "
            "again in %g s",
            self.last,
            in_a_row,
            self.waiting,
            pause,
        )

    def started(self) -> None:
        if self.in_a_row:  # (a racy read: the lock is for the writes, taken when needed)
            with self._lock:
                self.in_a_row, self._until, self._hopeless = 0, 0.0, False

    def pause_left(self) -> float:
        """Seconds until the claims that need a child may go on (0: now)."""
        return max(self._until - time.monotonic(), 0.0)

    def hopeless(self) -> bool:
        """Whether children have kept failing to start long enough to give up on them."""
        return self._hopeless

    def give_up_message(self) -> str:
        return (
            f"worker child processes failed to start {self.in_a_row} times in a row over "
            f"{GIVE_UP_SPAN:g} s or more, none started since (last: {self.last}): this worker "
            "cannot run its jobs, so it stops (exit 1); its jobs wait, uncharged, for a "
            "worker whose children start"
        )
