"""Fault points: crash at an exact place, to prove a recovery path.

The worker passes named points on its way (``after_step``, ``before_complete_commit``,
``after_complete_commit``). They do nothing unless armed:

- in another process, through the environment::

      ERRANDS_FAULT_POINTS="after_complete_commit:0.05,after_step:0.01" errands worker ...

  each ``name:probability`` (probability 1 when omitted) ends the process with
  ``os._exit(86)`` — a crash, no cleanup — when the point is reached;
- in this process, with :func:`arm` (an action to run, such as raising an exception) and
  :func:`disarm`.

Disarmed, a point costs one dictionary lookup.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable

ENV = "ERRANDS_FAULT_POINTS"
CRASH_EXIT_CODE = 86
POINTS = ("after_step", "before_complete_commit", "after_complete_commit")

Action = Callable[[str], None]


def _crash(name: str) -> None:
    os._exit(CRASH_EXIT_CODE)


def _parse(spec: str) -> dict[str, tuple[float, Action]]:
    armed: dict[str, tuple[float, Action]] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, probability = part.partition(":")
        if name not in POINTS:
            raise ValueError(f"{ENV}: unknown fault point {name!r}; known: {', '.join(POINTS)}")
        armed[name] = (float(probability) if probability else 1.0, _crash)
    return armed


_armed: dict[str, tuple[float, Action]] = _parse(os.environ.get(ENV, ""))


def arm(name: str, action: Action | None = None, probability: float = 1.0) -> None:
    """Run ``action(name)`` (default: crash the process) when the point is reached."""
    if name not in POINTS:
        raise ValueError(f"unknown fault point {name!r}; known: {', '.join(POINTS)}")
    _armed[name] = (probability, action or _crash)


def disarm(name: str | None = None) -> None:
    """Disarm one point, or all of them."""
    if name is None:
        _armed.clear()
    else:
        _armed.pop(name, None)


def fault_point(name: str) -> None:
    entry = _armed.get(name)
    if entry is not None and (entry[0] >= 1.0 or random.random() < entry[0]):
        entry[1](name)
