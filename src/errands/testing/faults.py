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

A point may carry details (``after_step`` passes ``job_id``, ``job``, ``attempt`` and
``step``); ``when`` filters receive them as a dict. Disarmed, a point costs one
dictionary lookup.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

ENV = "ERRANDS_FAULT_POINTS"
CRASH_EXIT_CODE = 86
POINTS = ("after_step", "before_complete_commit", "after_complete_commit")

Action = Callable[[str], None]
When = Callable[[Mapping[str, Any]], bool]


class SimulatedCrash(BaseException):
    """Raised by an in-process fault to stand for the worker process dying right there.

    A ``BaseException``, so a handler's ``except Exception`` cannot swallow it. The
    workers of :mod:`errands.testing` treat it as a real crash: nothing about the attempt
    is written, its ``ctx.transaction()`` rolls back, its children are dropped, and the
    job is rescued once its lease expires. A plain worker records it as a failed attempt.
    """


def _crash(name: str) -> None:
    # One line, written straight to the file descriptor: no buffering, no logging setup.
    os.write(2, f"errands fault point {name}: crashing (exit {CRASH_EXIT_CODE})\n".encode())
    os._exit(CRASH_EXIT_CODE)


def raise_crash(name: str) -> None:
    """An action for :func:`arm`: raise :class:`SimulatedCrash` at the point."""
    raise SimulatedCrash(f"simulated crash at fault point {name}")


@dataclass(frozen=True)
class _Armed:
    probability: float
    action: Action
    when: When | None = None


def _parse(spec: str) -> dict[str, _Armed]:
    armed: dict[str, _Armed] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, probability = part.partition(":")
        if name not in POINTS:
            raise ValueError(f"{ENV}: unknown fault point {name!r}; known: {', '.join(POINTS)}")
        armed[name] = _Armed(float(probability) if probability else 1.0, _crash)
    return armed


_armed: dict[str, _Armed] = _parse(os.environ.get(ENV, ""))


def arm(
    name: str,
    action: Action | None = None,
    probability: float = 1.0,
    *,
    when: When | None = None,
) -> None:
    """Run ``action(name)`` (default: crash the process) when the point is reached.

    ``when(details)``, if given, is asked first and the point fires only if it returns
    True (``after_step`` details: ``job_id``, ``job``, ``attempt``, ``step``).
    """
    if name not in POINTS:
        raise ValueError(f"unknown fault point {name!r}; known: {', '.join(POINTS)}")
    _armed[name] = _Armed(probability, action or _crash, when)


def disarm(name: str | None = None) -> None:
    """Disarm one point, or all of them."""
    if name is None:
        _armed.clear()
    else:
        _armed.pop(name, None)


def armed(name: str) -> bool:
    """True when the point is armed (in this process)."""
    return name in _armed


def fault_point(name: str, **details: Any) -> None:
    entry = _armed.get(name)
    if entry is None:
        return
    if entry.when is not None and not entry.when(details):
        return
    if entry.probability >= 1.0 or random.random() < entry.probability:
        entry.action(name)
