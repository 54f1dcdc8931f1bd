"""When a worker's child processes cannot start: the jobs wait, the claims pause.

A job whose child process could not start (the app failed to import in it, the
forkserver and ``spawn`` both failed, a fork refused for want of memory or processes;
or the thread that hands the job to its child, refused by the same limits) did nothing:
it is released (available again, its attempt not charged, the release recorded on the
job with the reason), never failed. It was failed as a charged attempt, and on its last
attempt sent to the dead-letter queue, for a fault of the machine's.

So that a pool that cannot start children does not spin claiming and releasing, each
failure pauses the claims that would need a child: ``START_PAUSE`` seconds after the
first, doubling with each failure in a row up to ``START_PAUSE_MAX`` (failures within a
pause, the rest of a burst, count as one). A child that starts ends the pause. A start
that fails while other children of the runner live is no such failure (a pool short of a
child still runs its jobs): the job waits for one of them, nothing pauses, and the next
start is tried later (:meth:`StartFailures.missed`).

The process pool's sync jobs need a child; its ``async def`` ones run on the worker's
event loop and need none: meanwhile the worker claims only the job types that need no
child (the claim's filter of job types), and nothing when it has none. The suspects'
children only run rescued jobs: the worker claims no rescued job meanwhile (other
workers take them) and runs everything else.

A process pool whose children still cannot start after ``GIVE_UP_AFTER`` failures in a
row spanning ``GIVE_UP_SPAN`` seconds, none started since and none alive, cannot run its
jobs: when nothing the worker serves runs without a child, the worker logs an error
saying why and stops (gracefully: what runs finishes), exiting 1, so that its supervisor
(systemd, Kubernetes, ``--processes``) sees a failed worker and restarts it, rather than a
worker that looks alive and runs nothing. A worker that also serves jobs needing no child
runs on for them, logging an error at each failure that its sync jobs cannot run.
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


def _doubling(count: int) -> float:
    """The wait after the ``count``-th failure in a row: START_PAUSE, doubling each time,
    at most START_PAUSE_MAX."""
    return min(START_PAUSE * 2 ** (count - 1), START_PAUSE_MAX)


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
        self._missed = 0  # starts missed while other children ran, since one worked
        self._retry_at = 0.0
        self._lock = threading.Lock()

    def missed(self, exc: BaseException, others: int) -> None:
        """A start failed while ``others`` children of the runner live: a job waits for one
        of them, released by nobody, and nothing pauses (a pool short of one child is not
        a pool that cannot run its jobs: with -c N and the Nth child refused, each job
        that came while the others were busy was released, each release paused every
        claim, and a minute of it stopped the worker, exit 1, with N-1 healthy children).
        The next start is tried ``START_PAUSE`` seconds later, doubling with each miss in
        a row up to ``START_PAUSE_MAX``."""
        now = time.monotonic()
        with self._lock:
            self._note(exc)
            if now < self._retry_at:  # the rest of a burst: one for them all
                return
            self._missed += 1
            retry = _doubling(self._missed)
            self._retry_at = now + retry
        log.warning(
            "a worker child process cannot start (%s); %d other(s) run: %s wait for them "
            "(another start is tried in %g s)",
            self.last,
            others,
            self.waiting,
            retry,
        )

    def _note(self, exc: BaseException) -> None:
        """Count a failed start and keep why (under the lock)."""
        self.total += 1
        self.last = f"{type(exc).__name__}: {exc}"

    def retry_left(self) -> float:
        """Seconds until another start may be tried after one :meth:`missed` (0: now)."""
        return max(self._retry_at - time.monotonic(), 0.0)

    def failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            self._note(exc)
            if now < self._until:  # the rest of a burst: one pause for them all
                return
            if not self.in_a_row:
                self._first_at = now
            self.in_a_row += 1
            pause = _doubling(self.in_a_row)
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
        if self.in_a_row or self._missed:  # (a racy read: the lock is for the writes)
            with self._lock:
                self.in_a_row, self._until, self._hopeless = 0, 0.0, False
                self._missed, self._retry_at = 0, 0.0

    def pause_left(self) -> float:
        """Seconds until the claims that need a child may go on (0: now)."""
        return max(self._until - time.monotonic(), 0.0)

    def hopeless(self) -> bool:
        """Whether children have kept failing to start long enough to give up on them
        (the runner gives up only with no child alive: :meth:`ProcessRunner.hopeless`)."""
        return self._hopeless

    def run_on_message(self) -> str:
        """What a worker says at each failure once it would give up, when it runs on for
        its jobs that need no child."""
        return (
            f"worker child processes failed to start {self.in_a_row} times in a row over "
            f"{GIVE_UP_SPAN:g} s or more, none started since (last: {self.last}): this "
            f"worker's {self.waiting} cannot run, and wait, uncharged, for a worker whose "
            "children start; it runs on for its jobs that need no child (async handlers)"
        )

    def gave_up_message(self) -> str:
        """Why the worker gave up on these children (the start of a sentence)."""
        return (
            f"worker child processes failed to start {self.in_a_row} times in a row over "
            f"{GIVE_UP_SPAN:g} s or more, none started since (last: {self.last}): this "
            f"worker's {self.waiting} cannot run in them"
        )

    def give_up_message(self) -> str:
        return (
            f"worker child processes failed to start {self.in_a_row} times in a row over "
            f"{GIVE_UP_SPAN:g} s or more, none started since (last: {self.last}): this worker "
            "cannot run its jobs, so it stops (exit 1); its jobs wait, uncharged, for a "
            "worker whose children start"
        )
