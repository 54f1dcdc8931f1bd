"""Fault points: crash at an exact place, to prove a recovery path.

The worker passes named points on its way (``after_step``, ``before_complete_commit``,
``after_complete_commit``). They do nothing unless armed:

- in another process, through the environment::

      ERRANDS_FAULT_POINTS="after_complete_commit:0.05,after_step:0.01" errands worker ...

  each ``name:probability`` (probability 1 when omitted) ends the process with
  ``os._exit(86)`` — a crash, no cleanup — when the point is reached, after writing one
  line naming the point to stderr (so a test can count which points fired);
- in this process, with :func:`arm` (an action to run, such as raising
  :class:`SimulatedCrash`, optionally only ``when`` the point's details match) and
  :func:`disarm`. ``errands.testing.Tester.crash_after_step`` builds on this.

A point may carry details (``after_step`` passes ``app``, ``job_id``, ``job``, ``attempt`` and
``step``); ``when`` filters receive them as a dict. Disarmed, a point costs one
dictionary lookup.

The hook itself lives in :mod:`errands.faults` (so the worker and the backends do not
import the test tools); this module re-exports it and adds the in-process crash.
"""

from __future__ import annotations

from ..faults import (
    CRASH_EXIT_CODE,
    ENV,
    POINTS,
    Action,
    When,
    arm,
    armed,
    disarm,
    fault_point,
)

__all__ = [
    "CRASH_EXIT_CODE",
    "ENV",
    "POINTS",
    "Action",
    "SimulatedCrash",
    "When",
    "arm",
    "armed",
    "disarm",
    "fault_point",
    "raise_crash",
]


class SimulatedCrash(BaseException):
    """Raised by an in-process fault to stand for the worker process dying right there.

    A ``BaseException``, so a handler's ``except Exception`` cannot swallow it. The
    workers of :mod:`errands.testing` treat it as a real crash: nothing about the attempt
    is written, its ``ctx.transaction()`` rolls back, its children are dropped, and the
    job is rescued once its lease expires. A plain worker records it as a failed attempt.
    """


def raise_crash(name: str) -> None:
    """An action for :func:`arm`: raise :class:`SimulatedCrash` at the point."""
    raise SimulatedCrash(f"simulated crash at fault point {name}")
