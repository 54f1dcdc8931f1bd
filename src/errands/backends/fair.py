"""Fair claiming across keys (tenants) in a fair queue: which due jobs a claim takes.

A fair queue (``app.queue(name, fair=True)``) is claimed through the limited claim
(:func:`errands.backends.limits.claim_limited`), which reads, under its serialising lock,
for the keys of its **window** (the next ``room + 16`` keys, at least 32, of a rotation
over the keys with due jobs, kept by the claiming process: see ``limits._pick_fair``;
every key in a queue with ``aging`` and in a suspect claim):

* each key's next due jobs, per priority level (a skip through ``errands_jobs_fair``:
  one probe per key and level, however long a key's backlog), and the keyed jobs of a
  higher priority than the window's, from the queue's first due rows in claim order;
* each key's recent worker time: the decayed handler seconds of its ended attempts
  (``errands_fair_usage``, written only by the fenced write that ends an attempt) plus its
  running attempts (each at least the key's mean job time), and when it last started one;
* each key's weight (``app.fair_weight``; 1 when none is stored).

:func:`fair_pick` then orders the claim, one job at a time:

1. **Priority first.** Only keys whose next job has the highest (effective) priority
   compete; with ``aging``, a job's effective priority is its priority plus one level per
   ``aging`` seconds it has been due.
2. **Round-robin among keys within their share.** A key whose recent worker time is
   within its weighted share of the total of the keys read (plus one of its jobs, at
   least ``QUANTUM`` seconds: its slack) takes one job per round, least recently started
   key first; a key more than its slack under its share goes before them (least
   weighted worker time first). So with ``k`` such keys and ``s`` free slots per round,
   each is claimed within ``ceil(k / s)`` rounds.
3. **The rest by weighted worker time.** Slots left over (more slots than keys, or keys
   over their share) go one at a time to the key with the least
   ``(recent worker time + its mean job time x jobs picked this round) / weight``.

Jobs held back by a concurrency key or a rate are skipped ("gated") and the key's next
job, or the next key, is taken instead, so a gated key never blocks the keys behind it.
"""

from __future__ import annotations

import heapq
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..forking import reset_at_fork

log = logging.getLogger("errands.fair")

HALF_LIFE = 60.0  # seconds: a key's ended worker time counts half after a minute
QUANTUM = 1.0  # seconds of worker time a key may run over its share and still take turns
DEFAULT_COST = 1.0  # seconds: a key's mean job time before any of its attempts ended
WEIGHT_MAX = 1_000_000.0
UNKEYED = ""  # the key of a fair queue's jobs enqueued without one


@dataclass(slots=True)  # not frozen: a claim builds dozens (3x faster; treat as immutable)
class FairCandidate:
    """A due job of a fair queue, with what its claim needs to know."""

    id: int
    name: str
    concurrency_key: str | None
    concurrency_limit: int | None
    rate_limit: int | None
    rate_period: float | None
    fair_key: str
    priority: int
    run_at: float
    rescued: bool = False  # a suspect: claimed by the worker's suspect claim


@dataclass(slots=True)
class KeyState:
    """One key's standing: recent worker time (decayed, running attempts included)."""

    usage: float = 0.0
    mean_cost: float = DEFAULT_COST
    last_started: float | None = None
    weight: float = 1.0
    running: int = 0  # attempts of the key running now, cluster-wide


def effective_priority(priority: int, run_at: float, now: float, aging: float | None) -> int:
    """``priority`` plus one level per ``aging`` seconds the job has been due."""
    if not aging:
        return priority
    return priority + int(max(now - run_at, 0.0) // aging)


@dataclass(slots=True)
class _Key:
    name: str
    state: KeyState
    jobs: list[FairCandidate]
    within_share: bool = True
    behind: bool = False  # more than its slack under its share: goes before the turns
    picked: int = 0
    position: int = 0

    def head(self) -> FairCandidate | None:
        return self.jobs[self.position] if self.position < len(self.jobs) else None


@dataclass
class FairPick:
    """What :func:`fair_pick` chose, in claim order, and how many due jobs it skipped
    because a concurrency key or a rate held them back (the claim was "gated")."""

    chosen: list[FairCandidate] = field(default_factory=list)
    gated: int = 0
    taken: dict[str, int] = field(default_factory=dict)  # jobs chosen or gated, per key


def fair_pick(
    candidates: Sequence[FairCandidate],
    states: dict[str, KeyState],
    room: int,
    admit: Callable[[FairCandidate], bool],
    *,
    now: float,
    aging: float | None = None,
) -> FairPick:
    """Up to ``room`` of ``candidates`` in fair claim order (see the module).

    ``admit(candidate)`` says whether its concurrency key and rate let it start now, and
    counts it when it does (so a key's later candidates see its room shrink)."""
    result = FairPick()
    by_key: dict[str, list[FairCandidate]] = {}
    for c in candidates:
        if (jobs := by_key.get(c.fair_key)) is None:
            by_key[c.fair_key] = [c]
        else:
            jobs.append(c)
    keys = []
    for name, jobs in by_key.items():
        if len(jobs) > 1:  # (most keys of a window bring one job: nothing to order)
            jobs.sort(key=lambda c: (-effective_priority(c.priority, c.run_at, now, aging),
                                     c.run_at, c.id))  # fmt: skip
        keys.append(_Key(name, states.get(name) or KeyState(), jobs))
    _mark_shares(keys)
    # One heap entry per key with a job left: (-its next job's level, its rank, index).
    # Only the taken key's entry changes after a pick, so a claim over k keys costs
    # O(k + room log k), not O(k x room).
    # (every key has a job: it was made from its candidates)
    heap = [_entry(i, key, now, aging) for i, key in enumerate(keys)]
    heapq.heapify(heap)
    chosen, taken = result.chosen, result.taken
    while heap and len(chosen) < room:
        index = int(heapq.heappop(heap)[-1])
        key = keys[index]
        job = key.jobs[key.position]
        key.position += 1
        taken[key.name] = key.position
        if admit(job):
            key.picked += 1
            chosen.append(job)
        else:
            result.gated += 1
        if key.position < len(key.jobs):
            heapq.heappush(heap, _entry(index, key, now, aging))
    return result


def _entry(index: int, key: _Key, now: float, aging: float | None) -> tuple[float, ...]:
    """The heap entry of ``key``, which has a job left: its next job's level, then its
    rank: a key more than its slack under its share first (least weighted worker time
    first), then the turns of keys within their share (least recently started first),
    then the rest by weighted worker time counting the jobs picked this round."""
    head = key.jobs[key.position]
    level = effective_priority(head.priority, head.run_at, now, aging) if aging else head.priority
    s = key.state
    if key.picked == 0 and key.behind:
        return (-float(level), -1.0, s.usage / s.weight, head.run_at, float(head.id), index)
    if key.picked == 0 and key.within_share:
        started = -math.inf if s.last_started is None else s.last_started
        return (-float(level), 0.0, started, head.run_at, float(head.id), index)
    virtual = (s.usage + s.mean_cost * key.picked) / s.weight
    return (-float(level), 1.0, virtual, head.run_at, float(head.id), index)


def over_share(states: dict[str, KeyState], keys: Sequence[str]) -> set[str]:
    """The ``keys`` more than their slack over their weighted share (as
    :func:`fair_pick` judges them): they take no round-robin turn."""
    default = KeyState()
    marked = [(k, states.get(k) or default) for k in keys]
    total = sum([state.usage for _, state in marked])
    weights = sum([state.weight for _, state in marked])
    if total <= 0 or weights <= 0:
        return set()
    return {k for k, state in marked if state.usage > sum(_share_and_slack(state, total, weights))}


def _mark_shares(keys: list[_Key]) -> None:
    """A key more than its slack (one of its jobs, at least QUANTUM) over its weighted
    share of the backlogged keys' recent worker time waits out the round-robin turns; a
    key more than its slack under it goes before them. Else the keys at their slack's
    edge (one more job each) would keep a key of weight 2 that far under its share per
    key of weight 1: 2 keys of weight 1 and one of 2 over a 30 s run measured 1.84."""
    total = sum([k.state.usage for k in keys])
    weights = sum([k.state.weight for k in keys])
    if total <= 0 or weights <= 0:
        return
    for key in keys:
        share, slack = _share_and_slack(key.state, total, weights)
        key.within_share = key.state.usage <= share + slack
        key.behind = key.state.usage < share - slack


def _share_and_slack(state: KeyState, total: float, weights: float) -> tuple[float, float]:
    """A key's weighted share of ``total`` worker time, and its slack around it: one of
    its jobs, at least QUANTUM (over_share and fair_pick judge keys by both)."""
    return total * state.weight / weights, (
        state.mean_cost if state.mean_cost > QUANTUM else QUANTUM
    )


def decayed(usage: float, age: float) -> float:
    """``usage`` seconds of worker time, ``age`` seconds later (half-life HALF_LIFE)."""
    return usage * 0.5 ** (max(age, 0.0) / HALF_LIFE)


def handler_seconds(ran: float | None) -> float | None:
    """A handler's seconds as a fold takes them: None (count from the claim to the write)
    when not a finite number. PostgreSQL stored a NaN as the key's usage (greatest(NaN,
    0) is NaN), and every later share of its queue was NaN; NaN is no JSON (SQLite's
    batched fold failed)."""
    return ran if ran is not None and math.isfinite(ran) else None


def fold_params(
    job_id: int, token: str | None, *, rescue: str | None = None, ran: float | None = None
) -> dict[str, object]:
    """The parameters of ``fair_fold`` for the attempt a fenced write is about to end
    (``rescue``: the state a rescue plans, whose fence also requires the lease to have
    expired and no cancel requested unless it plans 'cancelled'; ``ran``: the seconds its
    handler ran, None to count from the claim to the write)."""
    return {
        "id": job_id, "token": token, "expired": int(rescue is not None), "rescue": rescue,
        "half_life": HALF_LIFE, "ran": handler_seconds(ran),
    }  # fmt: skip


def check_weight(key: str, weight: object) -> float:
    from ..errors import ConfigurationError

    if (
        isinstance(weight, bool)
        or not isinstance(weight, int | float)
        or not 0 < weight <= WEIGHT_MAX
        or math.isnan(weight)
    ):
        raise ConfigurationError(
            f"fair_weight({key!r}, {weight!r}): the weight must be a number above 0 and at "
            f"most {WEIGHT_MAX:g}; a key of weight 2 gets twice the worker time of a key of "
            "weight 1 (the default)"
        )
    return float(weight)


WEIGHT_TTL = 60.0  # seconds a weight given by the callable is used before it is asked again
WEIGHT_BUDGET = 0.02  # seconds a claim waits, at most, for the callable's new answers
# Seconds an ask runs before its thread counts as stuck and another takes its place (up
# to WEIGHT_THREADS_MAX threads in all): keys queued behind a hung callable are asked.
WEIGHT_STUCK_AFTER = 1.0
WEIGHT_THREADS_MAX = 8

Weigher = Callable[[Sequence[str]], dict[str, float]]  # keys -> their weights (some of them)


class CallableWeights:
    """Weights given by code: ``app.fair_weight(fn)``, ``fn(key) -> weight``.

    A claim holds its queue's serialising lock, so the callable never runs inside it:
    the answers are cached per key for ``ttl`` seconds, and a key without a fresh answer
    is asked on a few daemon threads, the claim waiting ``budget`` seconds at most. A key
    whose answer is late is claimed at its previous weight (1 the first time) and gets
    the new one at a later claim; a callable that raises or returns anything but a
    number above 0 (and at most WEIGHT_MAX) gives weight 1, logged. A weight stored with
    ``app.fair_weight(key, w)`` (or the CLI) is an operator's override: it wins.

    A callable that hangs costs the claims the keys it was asking when it hung, once:

    * an ask that has run past ``budget`` is not waited for again, nor is a key queued
      while no thread is free to ask it (every one stuck in an ask);
    * once an ask overran its budget, claims wait for no new answer at all (a circuit
      breaker, logged) until the callable answers one again: a plan service down with no
      timeout cost one budget, not one per claim with a new key;
    * a thread stuck in an ask for ``WEIGHT_STUCK_AFTER`` seconds is replaced, up to
      ``threads_max`` threads in all (a stuck one that comes back ends if it is spare).

    Before, once both threads hung, each new key was queued to nobody and stayed
    "asking", and every claim whose window held one waited the whole budget under the
    queue's claim lock (SQLite: the file's write lock): a median claim of 0.9 ms took
    21.7 ms, for good.
    """

    def __init__(
        self,
        fn: Callable[[str], float],
        *,
        ttl: float = WEIGHT_TTL,
        budget: float = WEIGHT_BUDGET,
        threads: int = 2,
        threads_max: int = WEIGHT_THREADS_MAX,
        stuck_after: float = WEIGHT_STUCK_AFTER,
    ) -> None:
        self.fn = fn
        self.ttl = ttl
        self.budget = budget
        self.threads = threads
        self.threads_max = max(threads_max, threads)
        self.stuck_after = stuck_after
        self._known: dict[str, tuple[float, float]] = {}  # key -> (weight, answered at)
        self._asking: set[str] = set()
        self._todo: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._started = 0  # asking threads running (a stuck one included)
        self._serial = 0  # threads ever started (their names)
        self._working: dict[int, tuple[str, float]] = {}  # thread -> (key asked, since)
        self._answered_at = -math.inf  # monotonic time of the callable's last answer
        self._warned = -math.inf  # monotonic time of the last "late" warning
        self._hung_warned = -math.inf  # and of the last "hangs" warning
        reset_at_fork(self)  # its threads start afresh in a forked child (_forked)

    def _forked(self) -> None:
        """In a child forked from this process, on its only thread (errands.forking; no
        I/O, no logging): the asking threads are not in the child, and the lock may have
        been copied held by one of them. Copied as they were, the count of threads
        running said they were there: the child started none, its keys were queued to
        nobody and each claim with a new key waited its whole budget (or hung on the
        lock for good). It starts afresh, as one never asked: a new lock and queue, no
        thread (the next claim with a key to ask starts them), no ask under way (a key
        the parent was asking is asked again by the child's next claim that wants it).
        The answers the parent had are kept, for their ttl."""
        self._cond = threading.Condition()
        self._todo = queue.SimpleQueue()
        self._asking = set()
        self._started = 0
        self._working = {}

    def __call__(self, keys: Sequence[str], budget: float | None = None) -> dict[str, float]:
        """The weights of ``keys`` known now (after waiting ``budget`` seconds at most,
        default the claim's, for the keys asked anew); a key left out weighs 1 or its
        stored weight."""
        now = time.monotonic()
        budget = self.budget if budget is None else budget
        deadline = now + budget
        with self._cond:
            for key in keys:
                if (
                    key not in self._asking
                    and now - self._known.get(key, (0, -math.inf))[1] >= self.ttl
                ):
                    self._asking.add(key)
                    self._todo.put(key)
            self._start_threads(now)
            hung = self._hung(now, budget)
            # Only keys never answered are waited for (under the claim's lock): one asked
            # again after its ttl is claimed at its last answer meanwhile. And only those
            # a thread answers in time: none while the callable hangs, not one whose ask
            # overran, not one queued while every thread is stuck (see the class).
            pending = set() if hung is not None else self._waitable(keys, now, budget)
            while pending and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
                pending = {k for k in pending if k in self._asking}
            answers = {k: self._known[k][0] for k in keys if k in self._known}
            warn = bool(pending) and now - self._warned >= self.ttl
            if warn:
                self._warned = now
            say_hung = hung is not None and now - self._hung_warned >= self.ttl
            if say_hung:
                self._hung_warned = now
        if warn:
            log.warning(
                "fair weight callable %s: %d key(s) not answered within %g s; they are "
                "claimed at their previous weight (1 at first) until it answers",
                _name(self.fn), len(pending), budget,
            )  # fmt: skip
        if say_hung and hung is not None:
            log.warning(
                "fair weight callable %s has not answered key %r for %.1f s (it hangs?): "
                "claims stop waiting for its answers until it answers again; keys without "
                "an answer are claimed at their previous weight (1 at first). Give it a "
                "timeout of its own",
                _name(self.fn), hung[0], now - hung[1],
            )  # fmt: skip
        return answers

    def _overran(self, now: float, budget: float) -> list[tuple[str, float]]:
        """The asks running past ``budget``: (key, since)."""
        return [(k, t) for k, t in self._working.values() if now - t > budget]

    def _hung(self, now: float, budget: float) -> tuple[str, float] | None:
        """An ask that overran ``budget`` with no answer from the callable since it did
        (the circuit breaker is open), else None."""
        for key, since in self._overran(now, budget):
            if self._answered_at < since + budget:
                return key, since
        return None

    def _waitable(self, keys: Sequence[str], now: float, budget: float) -> set[str]:
        """The keys of ``keys`` a claim may wait for: asked anew (never answered), and
        either asked now by a thread within its budget, or queued while a thread is free
        or asking within its budget (one that will come to it)."""
        asked = {key: since for key, since in self._working.values()}
        live = self._started - len(self._overran(now, budget))
        out = set()
        for key in keys:
            if key not in self._asking or key in self._known:
                continue
            since = asked.get(key)
            if (since is None and live > 0) or (since is not None and now - since <= budget):
                out.add(key)
        return out

    def _start_threads(self, now: float) -> None:
        """Threads to ask the keys queued (call under the lock): ``threads``, and one more
        for each stuck for ``stuck_after`` seconds, up to ``threads_max`` in all."""
        stuck = sum(1 for _, t in self._working.values() if now - t > self.stuck_after)
        while (
            self._asking
            and self._started - stuck < self.threads
            and self._started < self.threads_max
        ):
            self._started += 1
            self._serial += 1
            name = f"errands-fair-weight-{self._serial}"
            threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self) -> None:
        me = threading.get_ident()
        while (key := self._todo.get()) is not None:
            with self._cond:
                self._working[me] = (key, time.monotonic())
            try:
                weight = self._ask(key)
            except BaseException as exc:  # (SystemExit...): the thread must go on asking
                log.warning(
                    "fair weight callable %s stopped for key %r (%r)", _name(self.fn), key, exc
                )
                weight = 1.0
            with self._cond:
                now = time.monotonic()
                del self._working[me]
                if self._hung_warned > self._answered_at:
                    log.info("fair weight callable %s answers again", _name(self.fn))
                self._known[key] = (weight, now)
                self._answered_at = now
                self._asking.discard(key)
                self._cond.notify_all()
                stuck = sum(1 for _, t in self._working.values() if now - t > self.stuck_after)
                if self._started - stuck > self.threads:  # a spare, back from a hang: ends
                    self._started -= 1
                    return

    def _ask(self, key: str) -> float:
        """``fn(key)``, checked; weight 1 (logged) when it raises or gives a bad value."""
        try:
            return check_weight(key, self.fn(key))
        except Exception as exc:
            log.warning(
                "fair weight callable %s failed for key %r (%s: %s); the key gets weight 1 "
                "for %g s",
                _name(self.fn), key, type(exc).__name__, exc, self.ttl,
            )  # fmt: skip
            return 1.0

    def close(self) -> None:
        """Stop the threads once they are done with what they are asking (keys asked
        before this); a later call starts new ones (an App used after close() asked its
        callable for nothing more: every new key waited its whole budget, for good)."""
        with self._cond:
            for _ in range(self._started):
                self._todo.put(None)
            self._started = 0


def _name(fn: object) -> str:
    return str(getattr(fn, "__qualname__", None) or repr(fn))
