"""A claim round: the jobs a worker takes for its free slots, in one pass over its queues.

Failure contract: a round returns every row it claimed, even when a later step of the
round fails. It claims suspects (rescued jobs) first, then the plain queues in one
statement and each limited queue on its own serialised path (which of the two goes first
turns with the worker's queue rotation, so neither starves the other); if a later step raises
(a killed session, a busy SQLite file), the rows of the earlier ones are already ``running``
under this worker's leases, and dropping them would leave them unstarted until their
lease expired, then charge them an attempt as "worker lost" without their ever running.
So :meth:`Claimer.claim` returns those rows *and* the error; the worker starts the rows.
Each step is tried on its own, too: a limited queue whose claim keeps failing never
keeps the other queues from being claimed (the worker backs off only when a round with
an error claimed nothing).

Which queues are *limited* (claimed through ``job_claim_limited``): those this app's
code declares limits for, plus those the store says have a cluster-wide limit or due rows
carrying a limit of their own (a concurrency key or a rate, whatever queue they were
enqueued into and whichever worker declared what). The plain claim never takes a row that
carries a limit, so a row is never claimed around its limit in the moment before this
worker learns its queue is limited (at most a poll interval).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..backends.base import ClaimParams, QueueClaim
from ..jobs import JobRow

if TYPE_CHECKING:
    from ..app import App

log = logging.getLogger("errands.worker")


def queue_order(row: JobRow) -> tuple[int, float, int]:
    return -row.priority, row.run_at, row.id


@dataclass
class ClaimRound:
    """What one round took, and the error that cut it short (if any)."""

    rows: list[JobRow] = field(default_factory=list)
    error: Exception | None = None
    retry_in: float | None = None  # a rate window frees up then: look again at that time
    gated: int = 0  # due jobs held back by a concurrency key or a rate: the queue is not idle
    # A limited queue gave every job asked of it (its free slots): more may be due, so the
    # worker claims again as slots free up instead of waiting for its next poll (a limited
    # claim never fills the prefetch room, so "the round was full" cannot say it).
    limited_full: bool = False
    # A prefetching fair queue's claim filled its (deeper) room: it has a backlog.
    fair_full: bool = False
    # A limited queue was left out for want of a free slot (the prefetch room is not
    # theirs): claim again when a slot frees up.
    limited_starved: bool = False
    # A limited queue gave fewer jobs than asked: its due jobs may wait for a key or a rate
    # held by running jobs (the claim's reads leave those out, so it cannot count them).
    limited_short: bool = False
    # Rows that are the first claimed of a fair key with nothing running (express lane).
    express: frozenset[int] = frozenset()


class Claimer:
    def __init__(
        self,
        app: App,
        worker_id: str,
        queues: Sequence[str],
        poll_interval: float,
        fair_room: int | None = None,
    ):
        self.app = app
        # The most jobs a prefetching fair queue's claim takes (None: its whole room). Its
        # window of keys grows with its room, all of it read under the queue's claim lock,
        # which every other worker's claim of that queue waits for: a --prefetch of 1,024
        # would read some 4,000 keys a claim. The worker passes its room at a fair queue's
        # default prefetch (17 x -c), whatever its --prefetch.
        self.fair_room = fair_room
        self._fair_room_now = 0  # this round's room for a prefetching fair queue (claim())
        self.worker_id = worker_id
        self.queues = list(queues)
        self.poll_interval = poll_interval
        self._names: list[str] = []
        self._key_limits: dict[str, int] = {}
        self._key_limits_of = -1  # the registry's size they were read at
        # Set by the worker while the children of its process pool cannot start: the job
        # types it claims meanwhile (those that need no child), instead of all it defines.
        self.only: list[str] | None = None
        # Queues this app's own code limits: limited from the start, no store round trip.
        self.declared = {
            d.queue for d in app.registry.values() if d.limited and d.queue in self.queues
        } | {name for name, s in app.queues.items() if name in self.queues and _limits(s)}
        # The queues claimed through job_claim_limited (which counts keys, rates and
        # cluster-wide limits); the plain claim serves the others.
        self.with_limits: set[str] = set(self.declared)
        # Those with a cluster-wide limit (max_running): declared in this app's code, or
        # stored by another deployment (each limited claim reads the queue's settings and
        # says). Every stored outcome of theirs frees a slot a waiting job may take, so the
        # worker wakes its claim loop for it (Worker.forget), as for a concurrency key's.
        self.capped: set[str] = {
            name
            for name, s in app.queues.items()
            if name in self.queues and getattr(s, "max_running", None) is not None
        }
        # Fair queues this app declares without a cluster-wide limit or rate: their claim
        # may fill the prefetch room too, as a plain queue's does: with quick jobs a batch
        # spreads the cost of the fair claim's reads (a window of keys per claim).
        # Not one with a rate-limited job type: a rate counts its starts at the claim, and
        # jobs waiting in the prefetch buffer start later, so two claims' batches could
        # start closer together than the rate allows.
        rated = {d.queue for d in app.registry.values() if d.rate is not None}
        self.prefetching = {
            name
            for name, s in app.queues.items()
            if name in self.queues
            and s.fair
            and s.max_running is None
            and s.rate_limit is None
            and name not in rated
        }
        self._refresh_due = 0.0
        self._refresh_failing = False
        self._suspect_due = 0.0
        # The express lane's own (its claim runs first while every slot is busy: sharing
        # the regular suspect claim's, one that found none put the regular one off).
        self._express_suspect_due = 0.0

    @property
    def key_limits(self) -> dict[str, int]:
        """This worker's own concurrency_limit per job type with a key (its code's): a
        claim holds each row to the lower of it and the row's stored limit, so a limit
        lowered by a deploy applies to the jobs enqueued before it. Read afresh when jobs
        are registered after the worker started."""
        registry = self.app.registry
        if len(registry) != self._key_limits_of:
            self._key_limits_of = len(registry)
            self._key_limits = {
                d.name: d.concurrency_limit
                for d in registry.values()
                if d.concurrency_key is not None and d.concurrency_limit is not None
            }
        return self._key_limits

    @property
    def names(self) -> list[str]:
        """The job types this worker's code defines: the only ones it claims (a rolling
        deploy's newer job types wait, uncharged, for a worker that knows them). Read
        afresh when jobs are registered after the worker started (an embedded worker).
        While :attr:`only` is set, those alone."""
        if self.only is not None:
            return self.only
        registry = self.app.registry
        if len(registry) != len(self._names):
            self._names = sorted(registry)
        return self._names

    def refresh(self, *, force: bool = False) -> None:
        """Learn which queues are limited now (at most once per poll interval)."""
        now = time.monotonic()
        if not force and now < self._refresh_due:
            return
        self._refresh_due = now + self.poll_interval
        try:
            self.with_limits = self.declared | self.app.backend.queues_with_limits(self.queues)
        except Exception as exc:
            # Asked again at the next round, not a poll interval later: until it is read,
            # a queue limited or made fair by another deployment is claimed plainly (past
            # its max_running or its rate), and at start nothing was read yet.
            self._refresh_due = 0.0
            level = logging.DEBUG if self._refresh_failing else logging.WARNING
            self._refresh_failing = True  # said once per outage, not every round
            log.log(level, "could not read which queues are limited (%s); asking again", exc)
        else:
            self._refresh_failing = False

    def claim(
        self,
        plan: list[QueueClaim],
        room: int,
        free: int,
        suspects: int,
        fair_room: int | None = None,
    ) -> ClaimRound:
        """Claim for ``plan``: up to ``suspects`` rescued jobs, then up to ``room`` jobs
        (``room`` counts the prefetch beyond the ``free`` slots; limited queues, counted
        cluster-wide, claim only for free slots, so no waiting job holds their quota;
        a prefetching fair queue for ``fair_room``, its own deeper prefetch, when given).
        Never raises: see the module's failure contract."""
        result = ClaimRound()
        self._fair_room_now = room if fair_room is None else fair_room
        try:
            self._claim(result, plan, room, free, suspects)
        except Exception as exc:  # pragma: no cover - each step catches its own
            result.error = result.error or exc
        return result

    @staticmethod
    def _step(result: ClaimRound, claim: Callable[[], Sequence[JobRow]]) -> Sequence[JobRow]:
        """One backend claim of the round; its failure is kept, the round goes on."""
        try:
            return claim()
        except Exception as exc:
            result.error = result.error or exc
            return []

    def _limited(
        self,
        result: ClaimRound,
        queue: str,
        limit: int,
        *,
        suspects: bool = False,
        express: bool = False,
        turns: int | None = None,
    ) -> Sequence[JobRow]:
        """One limited claim of ``queue`` (see Backend.job_claim_limited), as a step of
        ``result``'s round."""
        backend = self.app.backend
        rows = self._step(
            result,
            lambda: backend.job_claim_limited(
                QueueClaim(queue, limit),
                self.worker_id,
                self.app.lease,
                suspects=suspects,
                names=self.names,
                weights=self.app.fair_weights,
                express=express,
                turns=turns,
                key_limits=self.key_limits,
            ),
        )
        capped = getattr(rows, "capped", None)  # None: the claim failed, nothing was read
        if capped is True:
            self.capped.add(queue)
        elif capped is False:
            self.capped.discard(queue)
        return rows

    def _claim(
        self, result: ClaimRound, plan: list[QueueClaim], room: int, free: int, suspects: int
    ) -> None:
        self.refresh()
        rows = result.rows
        if suspects > 0 and time.monotonic() >= self._suspect_due:
            # Rescued jobs first: a steady backlog of fresh jobs fills every free slot,
            # and would otherwise keep them waiting until it drains. They go ahead of the
            # prefetched jobs (the next free handler takes them).
            most = min(suspects, max(room, self._fair_room_now))
            self._claim_suspects(result, plan, most, room, free)
            taken = Counter(row.queue for row in rows)
            plan = [QueueClaim(q.name, q.limit - taken[q.name]) for q in plan]
            plan = [q for q in plan if q.limit > 0]
        # Which path goes first follows the plan's rotation (the worker starts the plan
        # at the next queue each round): a limited queue at its head is claimed before the
        # plain ones. Always plain first, a steady backlog of plain jobs took every free
        # slot of every round, and limited queues (keys, rates, fair) waited until it
        # drained: minutes, in the chaos soak on PostgreSQL.
        limited_first = bool(plan) and plan[0].name in self.with_limits
        if not limited_first:
            self._claim_plain(result, plan, room)
        self._claim_limited(result, plan, room, free)
        if limited_first:
            self._claim_plain(result, plan, room)

    def _claim_plain(self, result: ClaimRound, plan: list[QueueClaim], room: int) -> None:
        """The plain queues of ``plan``, in one statement, up to ``room`` rows in all."""
        rows = result.rows
        fast = [q for q in plan if q.name not in self.with_limits]
        if fast and room > len(rows):
            backend = self.app.backend
            params = ClaimParams(
                fast, room - len(rows), self.worker_id, self.app.lease, names=self.names
            )
            claimed = self._step(result, lambda: backend.job_claim(params))
            # A claim's rows come back in no set order; a batch starts in queue order
            # (handler threads take them first in, first out).
            rows += sorted(_keys_ignored(claimed), key=queue_order)

    def _claim_limited(
        self, result: ClaimRound, plan: list[QueueClaim], room: int, free: int
    ) -> None:
        """Each limited queue of ``plan`` on its own serialised path, for the free slots
        (for the prefetch room too, in a fair queue without a cluster-wide limit)."""
        rows = result.rows
        for queue in plan:
            take = min(queue.limit, self._room_of(queue.name, room, free) - len(rows))
            if queue.name in self.with_limits and take <= 0:
                result.limited_starved = True
            if queue.name in self.with_limits and take > 0:
                limited = self._limited(result, queue.name, take)
                rows += limited
                result.gated += getattr(limited, "gated", 0)
                result.express |= getattr(limited, "express", frozenset())
                result.limited_full = result.limited_full or len(limited) >= take
                if queue.name in self.prefetching:
                    result.fair_full = result.fair_full or len(limited) >= take
                result.limited_short = result.limited_short or len(limited) < take
                retry_in = getattr(limited, "retry_in", None)
                if retry_in is not None:
                    result.retry_in = min(result.retry_in or retry_in, retry_in)

    def _room_of(self, queue: str, room: int, free: int) -> int:
        """The room a limited queue's claim has: the free slots, or for a prefetching fair
        queue the round's room (prefetch included) up to ``fair_room``."""
        if queue not in self.prefetching:
            return free
        room = max(room, self._fair_room_now)
        return room if self.fair_room is None else max(min(room, self.fair_room), free)

    def claim_express(self, plan: list[QueueClaim], most: int, suspects: int = 0) -> ClaimRound:
        """Up to ``most`` jobs of ``plan`` (fair queues, each within its limit) for the
        express lane: the next job of each key with nothing running, within its share;
        up to ``suspects`` of them rescued ones (first, as in a regular round: a rescued
        job of a quiet key waited for a slot while a fresh one took the lane), looked for
        at most once a poll interval while none is found (it reads every key). Never
        raises (see the module)."""
        result = ClaimRound()
        try:
            if suspects > 0 and time.monotonic() >= self._express_suspect_due:
                self._claim_express_suspects(result, plan, min(suspects, most))
            taken = Counter(row.queue for row in result.rows)
            for queue in plan:
                left = min(most - len(result.rows), queue.limit - taken[queue.name])
                if left > 0:
                    result.rows += self._limited(result, queue.name, left, express=True)
        except Exception as exc:  # pragma: no cover - each step catches its own
            result.error = result.error or exc
        return result

    def _claim_express_suspects(
        self, result: ClaimRound, plan: list[QueueClaim], most: int
    ) -> None:
        """The express lane's rescued jobs: keys with nothing running whose next job is a
        rescued one, up to ``most``."""
        found = False
        for queue in plan:
            left = min(most - len(result.rows), queue.limit)
            if left > 0:
                rows = self._limited(result, queue.name, left, suspects=True, express=True)
                result.rows += rows
                found = found or bool(rows)
        if not found:
            self._express_suspect_due = time.monotonic() + self.poll_interval

    def _claim_suspects(
        self, result: ClaimRound, plan: list[QueueClaim], most: int, room: int, free: int
    ) -> None:
        """Up to ``most`` rescued jobs (the worker sizes ``most`` to run each isolated).
        A fair queue ranks its keys over the turns its fresh claim could have (``room``,
        or ``free`` where it claims for free slots only, less what the round claimed
        before it) and takes the rescued jobs among them: ranked over ``most`` alone
        (one, for a worker whose suspects are not isolated), a rescued job waited while
        any key ranked before its own."""
        backend = self.app.backend
        fast = [
            QueueClaim(q.name, min(most, q.limit)) for q in plan if q.name not in self.with_limits
        ]
        if fast:
            params = ClaimParams(
                fast, most, self.worker_id, self.app.lease, suspects=True, names=self.names
            )
            result.rows += _keys_ignored(self._step(result, lambda: backend.job_claim(params)))
        for queue in plan:
            left = min(most - len(result.rows), queue.limit)
            if queue.name in self.with_limits and left > 0:
                # the room the round's fresh claim would have for it (what was claimed
                # before in this round taken out)
                share = self._room_of(queue.name, room, free)
                turns = min(queue.limit, share - len(result.rows))
                result.rows += self._limited(result, queue.name, left, suspects=True, turns=turns)
        if not result.rows:
            # None waiting: look again a poll interval from now. After one was found, the
            # next is looked for as soon as a suspect ends, so a burst of rescued jobs
            # drains at the pace they run, not one per poll interval.
            self._suspect_due = time.monotonic() + self.poll_interval


def _keys_ignored(rows: Sequence[JobRow]) -> Sequence[JobRow]:
    """A plain queue's rows (no fairness, no limit): a fair key stored with one (its job
    type's template, for when the queue is made fair) is ignored, so its outcome takes
    the lean completion and no worker time is folded for it."""
    for row in rows:
        row.fair_key = None
    return rows


def _limits(settings: object) -> bool:
    return (
        getattr(settings, "max_running", None) is not None
        or getattr(settings, "rate_limit", None) is not None
        or bool(getattr(settings, "fair", False))
    )
