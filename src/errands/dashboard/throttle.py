"""Failed logins at the dashboard's login page, remembered briefly and in bounded memory.

Two rules (behind a reverse proxy every user shares the proxy's address):

* per (client address, typed name): ``max_failures`` failures within ``window`` seconds
  lock that pair until the oldest of them leaves the window (a user who mistyped; the
  typed name is a label that grants nothing, so a guesser changes it: the next rule);
* globally: past ``free_failures`` failures within the window, whatever their address or
  name, every login attempt waits ``step`` seconds per extra failure, at most
  ``max_delay``, and the secrets are checked one at a time that far apart: each attempt
  reserves the next check's moment (:meth:`admit`). A wait alone let a guesser who sent
  100 attempts at once, a new name each, have 100 checks per wait; now the checks are at
  most one per delay however many wait, and an attempt whose turn is more than
  ``max_delay`` away is answered 429 at once, unchecked.

Entries older than the window are dropped as new failures arrive, and at most
``max_keys`` pairs are kept (the least recently failed go first).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

LoginKey = tuple[str, str]  # (client address, typed name, case-folded)


@dataclass
class LoginThrottle:
    max_failures: int = 10
    window: float = 300.0
    free_failures: int = 50
    step: float = 0.1
    max_delay: float = 3.0
    max_keys: int = 10_000
    clock: Callable[[], float] = time.monotonic
    _by_key: OrderedDict[LoginKey, deque[float]] = field(default_factory=OrderedDict)
    _recent: deque[float] = field(default_factory=deque)
    _next_check: float = 0.0  # the earliest moment the next secret may be checked
    _turns: dict[str, float] = field(default_factory=dict)  # address -> its pending turn

    def __len__(self) -> int:
        """How many (address, name) pairs are remembered."""
        return len(self._by_key)

    def retry_after(self, key: LoginKey) -> float:
        """Seconds until ``key`` may try again; 0 when it may now."""
        now = self._prune()
        failures = self._by_key.get(key)
        if failures is None or len(failures) < self.max_failures:
            return 0.0
        return max(failures[0] + self.window - now, 0.0)

    def delay(self) -> float:
        """The global slow-down every login attempt waits for now, in seconds."""
        self._prune()
        extra = len(self._recent) - self.free_failures
        return min(extra * self.step, self.max_delay) if extra > 0 else 0.0

    def admit(self, address: str) -> float | None:
        """Seconds this attempt from ``address`` waits before its secret is checked (its
        reserved turn), or None: refuse it now, because its turn would be more than
        ``max_delay`` away or ``address`` holds a turn not yet come. Under the free
        failures, no wait; past them, at least :meth:`delay`, and the turns are that far
        apart whichever attempts, at once or not, reserve them. One pending turn per
        address: a flood from one address cannot take every turn (an operator elsewhere
        still gets one within the longest delay)."""
        spacing = self.delay()
        if not spacing:
            return 0.0
        now = self.clock()
        self._turns = {a: t for a, t in self._turns.items() if t > now}  # (a few at most)
        if address in self._turns:
            return None
        wait = max(spacing, self._next_check - now)  # every attempt waits, a right one too
        if wait > self.max_delay:
            return None
        self._next_check = now + wait + spacing
        self._turns[address] = now + wait
        return wait

    def failed(self, key: LoginKey) -> None:
        now = self._prune()
        failures = self._by_key.pop(key, None) or deque(maxlen=self.max_failures)
        failures.append(now)
        self._by_key[key] = failures  # the most recently failed last
        while len(self._by_key) > self.max_keys:
            self._by_key.popitem(last=False)
        self._recent.append(now)
        while len(self._recent) > self._recent_needed:
            self._recent.popleft()

    def succeeded(self, key: LoginKey) -> None:
        self._by_key.pop(key, None)

    @property
    def _recent_needed(self) -> int:
        """Failures worth counting: past these the delay is at its maximum anyway."""
        return self.free_failures + math.ceil(self.max_delay / self.step) if self.step > 0 else 0

    def _prune(self) -> float:
        """Forget failures older than the window; returns the time now."""
        now = self.clock()
        cutoff = now - self.window
        while self._recent and self._recent[0] <= cutoff:
            self._recent.popleft()
        while self._by_key:
            key, failures = next(iter(self._by_key.items()))
            if failures[-1] > cutoff:
                break
            del self._by_key[key]
        return now
