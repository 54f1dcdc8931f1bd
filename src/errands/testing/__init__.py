"""Tools for testing code that uses errands (product code; docs/testing.md).

- :class:`Tester`: the three modes of DESIGN §10 — ``manual`` (the default: jobs go to
  the real store; ``assert_enqueued``, ``refute_enqueued``, ``all_enqueued``, and
  ``drain()`` running due jobs through the real worker code with an injectable
  :class:`Clock` instead of sleeps), ``inline`` (a job runs at enqueue, still serialised,
  validated and decoded from the store) and a real in-process worker
  (``with tester.worker(): ...``); fault injection (``fail_attempt``,
  ``crash_after_step``, ``crash_before_completion``) and the duplicate-delivery check
  (``drain_duplicated``).
- :mod:`errands.testing.faults`: fault points that crash a worker process at exact
  places (before or after the completion commit, after a step).
- ``errands.testing.pytest_plugin``: pytest fixtures prefixed ``errands_`` (installed
  with errands through the ``pytest11`` entry point).

Names are imported lazily, so loading this package (as the pytest plugin does) imports
neither the worker nor a backend. The worker and the backends never import it: their
fault-point hook is :mod:`errands.faults`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .clock import Clock
    from .faults import SimulatedCrash
    from .results import Difference, DrainResult, DuplicateReport, Run
    from .tester import InjectedFailure, Tester

_EXPORTS = {
    "Clock": "clock",
    "Difference": "results",
    "DrainResult": "results",
    "DuplicateReport": "results",
    "InjectedFailure": "tester",
    "Run": "results",
    "SimulatedCrash": "faults",
    "Tester": "tester",
}

__all__ = [
    "Clock",
    "Difference",
    "DrainResult",
    "DuplicateReport",
    "InjectedFailure",
    "Run",
    "SimulatedCrash",
    "Tester",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'errands.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
