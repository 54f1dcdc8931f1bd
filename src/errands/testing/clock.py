"""The test clock: make retries, schedules, lease expiries and ``unique_for`` windows come
due without sleeping.

errands judges time by the *database's* clock (DESIGN §3): ``run_at``, lease expiry and
``unique_for`` are compared with ``now()`` in SQL, so no Python-side fake clock can move
them. The test clock moves the stored times instead: ``advance(seconds)`` subtracts
``seconds`` from every time the store holds about jobs — ``run_at``, ``unique_until``,
``lease_expires_at``, ``inserted_at``, ``attempted_at`` and ``finished_at`` — which, for
everything errands compares, is the same as ``seconds`` passing. Two exceptions, both
deliberate:

- leases held by an attempt that is still running in this test process are not moved
  (its worker would have renewed them meanwhile);
- what errands does not keep in those columns does not move: cron slots, worker-registry
  heartbeats, leader leases, the ``at`` of recorded errors, step and audit times.

The clock only goes forward, and :attr:`Clock.advanced` says how far it went in total.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import TYPE_CHECKING

from ..errors import ConfigurationError
from ._store import store_tools

if TYPE_CHECKING:
    from ..app import App


class Clock:
    """An injectable clock for one :class:`~errands.testing.Tester` (and its App).

    Pass your own to ``Tester(app, clock=Clock())`` to keep a handle on it before the
    tester exists; otherwise the tester makes one (``tester.clock``).
    """

    def __init__(self) -> None:
        self.advanced = 0.0
        self._app: App | None = None
        self._live: Callable[[], Collection[str]] = frozenset
        self._lock = threading.Lock()

    def bind(self, app: App, live_tokens: Callable[[], Collection[str]]) -> None:
        """Attach to ``app``'s store (the tester does this); ``live_tokens`` names the
        leases held by attempts still running in this process."""
        if self._app is not None and self._app is not app:
            raise ConfigurationError("this Clock already drives another App's store")
        self._app = app
        self._live = live_tokens

    def advance(self, by: float | timedelta) -> float:
        """Let ``by`` (seconds or a timedelta) pass for every job in the store; returns the
        total advanced so far."""
        seconds = by.total_seconds() if isinstance(by, timedelta) else float(by)
        if seconds < 0:
            raise ConfigurationError(f"the test clock only goes forward (got {by!r})")
        if self._app is None:
            raise ConfigurationError("this Clock is not bound to an App; give it to a Tester")
        with self._lock:
            if seconds > 0:
                store_tools(self._app.backend).shift(seconds, self._live())
                self.advanced += seconds
            return self.advanced

    def __repr__(self) -> str:
        return f"<errands.testing.Clock advanced={self.advanced:g}s>"
