"""The fault-point hook: named places on the worker's and the backends' paths where a
test can make the process crash, to prove a recovery path.

The points (``after_step``, ``before_complete_commit``, ``after_complete_commit``,
``after_finish_commit``, and the
workflow fan-in's ``before_fan_in``, ``before_callback_insert``, ``after_fan_in_commit``) call
:func:`fault_point`, which does nothing unless the point is armed: disarmed, it costs one
dictionary lookup. They are armed

- in another process, through the environment (read once, at import)::

      ERRANDS_FAULT_POINTS="after_complete_commit:0.05,after_step:0.01" errands worker ...

  each ``name:probability`` (probability 1 when omitted) ends the process with
  ``os._exit(86)`` when reached (see :func:`crash`); ``name:probability:most`` crashes
  at most ``most`` times across every process given the same folder in
  ``ERRANDS_FAULT_DIR`` (each crash takes a ticket file there first: a storm of crashes
  stays a bounded number of restarts);
- in this process, with :func:`arm` and :func:`disarm`.

This module is the hook only, so the worker and the backends need not import the test
tools; :mod:`errands.testing.faults` is the user-facing toolkit (it re-exports these
names and adds :class:`~errands.testing.faults.SimulatedCrash`).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

ENV = "ERRANDS_FAULT_POINTS"
DIR_ENV = "ERRANDS_FAULT_DIR"
CRASH_EXIT_CODE = 86
POINTS = (
    "after_step",
    "before_complete_commit",  # ctx.transaction(): the outcome written, not yet committed
    "after_complete_commit",  # ... committed
    "after_finish_commit",  # the completer's batch of outcomes committed (their hooks next)
    # the workflow fan-in (errands.backends.workflow_store): a member's end written, its
    # fan-in about to run; a workflow settling, its callbacks about to be inserted (both
    # inside the transaction); and a finish that fanned in, just after its commit
    "before_fan_in",
    "before_callback_insert",
    "after_fan_in_commit",
)

Action = Callable[[str], None]
When = Callable[[Mapping[str, Any]], bool]


def crash(name: str) -> None:
    """The default action: write one line naming the point to stderr (so a test can count
    which points fired), then end the process with ``os._exit(86)`` — a crash, no cleanup."""
    # One line, written straight to the file descriptor: no buffering, no logging setup.
    os.write(2, f"errands fault point {name}: crashing (exit {CRASH_EXIT_CODE})\n".encode())
    os._exit(CRASH_EXIT_CODE)


@dataclass(frozen=True)
class _Armed:
    probability: float
    action: Action
    when: When | None = None


def budgeted(folder: str, most: int) -> Action:
    """:func:`crash`, but at most ``most`` times across every process that shares
    ``folder``: a crash first creates one of the ticket files ``<point>-0 ..
    <point>-<most-1>`` there (atomically: ``O_EXCL``); with none left it does nothing."""

    def action(name: str) -> None:
        for ticket in range(most):
            try:
                os.close(os.open(os.path.join(folder, f"{name}-{ticket}"), _TICKET, 0o644))
            except FileExistsError:
                continue
            crash(name)
            return

    return action


_TICKET = os.O_CREAT | os.O_EXCL | os.O_WRONLY


def _parse(spec: str, folder: str | None = None) -> dict[str, _Armed]:
    armed: dict[str, _Armed] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, rest = part.partition(":")
        probability, _, most = rest.partition(":")
        if name not in POINTS:
            raise ValueError(f"{ENV}: unknown fault point {name!r}; known: {', '.join(POINTS)}")
        action: Action = crash
        if most:
            if not folder:
                raise ValueError(
                    f"{ENV}: {part!r} limits its crashes: set {DIR_ENV} to a folder every "
                    "process of the run shares (its crash tickets are kept there)"
                )
            action = budgeted(folder, int(most))
        armed[name] = _Armed(float(probability) if probability else 1.0, action)
    return armed


_armed: dict[str, _Armed] = _parse(os.environ.get(ENV, ""), os.environ.get(DIR_ENV))


def arm(
    name: str,
    action: Action | None = None,
    probability: float = 1.0,
    *,
    when: When | None = None,
) -> None:
    """Run ``action(name)`` (default: :func:`crash`) when the point is reached.

    ``when(details)``, if given, is asked first and the point fires only if it returns
    True (``after_step`` details: ``app``, ``job_id``, ``job``, ``attempt``, ``step``).
    A point holds one arming: arming it again replaces the first.
    """
    if name not in POINTS:
        raise ValueError(f"unknown fault point {name!r}; known: {', '.join(POINTS)}")
    _armed[name] = _Armed(probability, action or crash, when)


def disarm(name: str | None = None, *, when: When | None = None) -> None:
    """Disarm one point, or all of them. With ``when``: only if the point is armed with
    that filter (whoever armed it since keeps it)."""
    if name is None:
        _armed.clear()
    elif when is None or (name in _armed and _armed[name].when is when):
        _armed.pop(name, None)


def armed(name: str) -> bool:
    """True when the point is armed (in this process)."""
    return name in _armed


def fault_point(name: str, **details: Any) -> None:
    """The hook: run the point's action if it is armed (and its ``when`` agrees)."""
    entry = _armed.get(name)
    if entry is None:
        return
    if entry.when is not None and not entry.when(details):
        return
    if entry.probability >= 1.0 or random.random() < entry.probability:
        entry.action(name)
