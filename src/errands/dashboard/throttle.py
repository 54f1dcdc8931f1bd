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
  most one per delay however many wait. A pair holds one turn at a time, an address at
  most ``turns_per_address``, and a turn more than ``max_delay`` away is given only while
  fewer than ``max_waiting`` wait; any other attempt is answered 429 at once, unchecked.
  The turns were one per address: behind a proxy a guesser re-sending wrong logins under
  one name held the proxy's turn, and every operator's right login got 429; now the
  operator's pair gets the turn after the guesser's (at saturation, where the delay is
  ``max_delay``, a turn that far away fits nobody behind another one).

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
    turns_per_address: int = 4  # turns pending at once from one address (names differ)
    max_waiting: int = 8  # turns pending at once past ``max_delay`` away
    _turns: dict[LoginKey, float] = field(default_factory=dict)  # pair -> its pending turn

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

    def admit(self, key: LoginKey) -> float | None:
        """Seconds this attempt by ``key`` (client address, typed name) waits before its
        secret is checked (its reserved turn), or None: refuse it now. Under the free
        failures, no wait; past them, at least :meth:`delay`, and the turns are that far
        apart whichever attempts, at once or not, reserve them.

        Refused: a pair that holds a turn not yet come (a guesser under one name waits for
        its own turn, and cannot queue more), an address that holds ``turns_per_address``
        (a flood from one address, a new name each, leaves turns to the others), and a
        turn more than ``max_delay`` away when ``max_waiting`` turns are pending already.
        A turn past ``max_delay`` is given while fewer wait: at the longest delay every
        turn is ``max_delay`` after the one before, so only the first in line would fit,
        and a guesser re-sending wrong logins would hold it for good: behind a proxy
        (one address for all) every operator's right login got 429. Each pending turn
        is at most ``max_delay`` after the one before, so no attempt waits longer than
        ``max_waiting * max_delay``."""
        spacing = self.delay()
        if not spacing:
            return 0.0
        now = self.clock()
        self._turns = {k: t for k, t in self._turns.items() if t > now}  # (a few at most)
        if key in self._turns:
            return None
        if sum(k[0] == key[0] for k in self._turns) >= self.turns_per_address:
            return None
        wait = max(spacing, self._next_check - now)  # every attempt waits, a right one too
        if wait > self.max_delay and len(self._turns) >= self.max_waiting:
            return None
        self._next_check = now + wait + spacing
        self._turns[key] = now + wait
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
