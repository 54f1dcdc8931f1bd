"""Which due jobs a limited claim may take: shared by every backend.

A queue is claimed through :func:`claim_limited` when it has a cluster-wide concurrency
limit or rate, or due rows that carry a limit of their own: a concurrency key (at most
``concurrency_limit`` running per key, across every queue and job type that shares it)
or a job type's rate (stored on each row it enqueues). The limits are read from the
rows themselves, so a job enqueued into another queue (``queue=``), or declared
differently by another worker's code, is held to the limits it was enqueued with.

The backend serialises the counts it reads: one claimer per queue at a time (SQLite's
write lock; a PostgreSQL advisory lock per queue), and, for the keys and rate buckets a
claim is about to take, a lock per key and per bucket (PostgreSQL advisory locks taken
in sorted order, so claims of two queues sharing a key never both see it free, and never
deadlock). Jobs skipped for a busy key or an exhausted rate stay pending and burn no
attempt.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..errors import ConfigurationError
from .fair import (
    HALF_LIFE,
    UNKEYED,
    FairCandidate,
    FairPick,
    KeyState,
    Weigher,
    effective_priority,
    fair_pick,
    over_share,
)

LOOKAHEAD_FACTOR = 10
LOOKAHEAD_MIN = 100
WINDOW_MIN = 32  # keys with due jobs a windowed fair claim reads, at least
WINDOW_SPARE = 16  # keys a windowed fair claim reads beyond its room
WINDOW_READS = 4  # windows' worth of keys a claim reads at most (keys with none due pass)
UNBOUNDED = 2**31 - 1  # keys: all of them
LEVEL_MIN = -(2**31)  # below every priority

FairCursors = MutableMapping[str, str]  # queue -> the last key its rotation passed
RATE_PERIOD_MAX = 86_400.0
# A period shorter is no rate: "1/0.0000001s" was taken, a window the database clock's
# microseconds barely resolve, and a claim's own round trip outlasts it.
RATE_PERIOD_MIN = 0.001
_RATE = re.compile(r"^\s*(\d+)\s*/\s*(\d+\.?\d*|\.\d+)?\s*(s|sec|m|min|h|hour|d|day)\s*$")
RATE_COUNT_MAX = 2**31 - 1  # PostgreSQL's integer column, on every store
# A queue's limit (app.queue(limit=)) and a key's (concurrency_limit=): stored in
# PostgreSQL's integer columns, so held to them on every store.
LIMIT_MAX = 2**31 - 1
_UNITS = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hour": 3600, "d": 86400, "day": 86400}


def parse_rate(value: str) -> tuple[int, float]:
    """``"100/m"`` -> (100, 60.0); ``"20/s"``, ``"5/h"``, ``"1000/d"``, ``"10/30s"``."""
    match = _RATE.match(value) if isinstance(value, str) else None
    if not match:
        raise ConfigurationError(
            f"rate={value!r}: write COUNT/PERIOD, as in '20/s', '100/m', '5/h', '1000/d' "
            "or '10/30s'"
        )
    count, multiple, unit = int(match[1]), match[2], match[3]
    period = (float(multiple) if multiple else 1.0) * _UNITS[unit]
    if not 1 <= count <= RATE_COUNT_MAX or not RATE_PERIOD_MIN <= period <= RATE_PERIOD_MAX:
        raise ConfigurationError(
            f"rate={value!r}: the count must be from 1 to {RATE_COUNT_MAX:,} and the period "
            "from 1 ms (0.001s) to one day; for more starts, raise the count over a longer "
            "period, as in '1000/s'"
        )
    return count, period


def format_rate(limit: int | None, period: float | None) -> str | None:
    """``"100/m"``; None when there is no rate (JSON null; tables show a dash)."""
    if not limit or not period:
        return None
    for unit, seconds in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if period == seconds:
            return f"{limit}/{unit}"
    return f"{limit}/{period:g}s"


@dataclass(slots=True)  # not frozen: a claim builds dozens (3x faster; treat as immutable)
class Candidate:
    id: int
    name: str
    concurrency_key: str | None
    concurrency_limit: int | None
    rate_limit: int | None = None
    rate_period: float | None = None


# Reads of one in-order limited claim at most: the first, and again past the keys (and
# rate-limited types) it found held back while its room was not filled.
IN_ORDER_READS = 4


def lookahead(room: int) -> int:
    return max(room * LOOKAHEAD_FACTOR, LOOKAHEAD_MIN)


def key_limit(candidate: Candidate | FairCandidate, caps: Mapping[str, int] | None) -> int:
    """The most jobs of the candidate's key that may run when it starts: the limit stored
    on its row, or the claiming worker's own for its job type (``caps``) when lower. A
    limit lowered in code so applies to the rows enqueued before the deploy; a raised one
    only to rows enqueued with it (a row never goes past what it was enqueued with)."""
    limit = candidate.concurrency_limit or 1
    if caps:
        own = caps.get(candidate.name)
        if own is not None and own < limit:
            return own
    return limit


def choose(
    candidates: list[Candidate],
    room: int,
    running_per_key: dict[str, int],
    room_per_name: dict[str, int],
    held: set[str] | None = None,
    caps: Mapping[str, int] | None = None,
) -> list[Candidate]:
    """The candidates to claim, in order, within the queue's room, each key's limit (see
    :func:`key_limit`) and each rate-limited job type's remaining starts. ``held``: gets
    the keys (and ``"name:"`` + the job types) a candidate was held back for."""
    chosen: list[Candidate] = []
    keys = dict(running_per_key)
    names = dict(room_per_name)
    for candidate in candidates:
        if len(chosen) >= room:
            break
        key = candidate.concurrency_key
        if key is not None and keys.get(key, 0) >= key_limit(candidate, caps):
            if held is not None:
                held.add(key)
            continue
        if candidate.name in names and names[candidate.name] <= 0:
            if held is not None:
                held.add("name:" + candidate.name)
            continue
        chosen.append(candidate)
        if key is not None:
            keys[key] = keys.get(key, 0) + 1
        if candidate.name in names:
            names[candidate.name] -= 1
    return chosen


class LimitedClaimStore(Protocol):
    """What :func:`claim_limited` needs from a backend, inside one serialised transaction."""

    def start(self, queue: str) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
        """The claim's first step: serialise the claims of ``queue`` for the transaction
        (where the backend needs a lock for it), then read the queue's settings
        (``queue_settings_get``'s rows: none when it has none) and the rate-limited job
        types with due rows (``rate_limited_names``' rows: name, limit, period)."""
        ...

    def rows(self, query: str, params: dict[str, object]) -> list[tuple[object, ...]]: ...

    def expect(self, query: str, params: dict[str, object]) -> bool:
        """Called before ``start``: ``rows(query, params)`` is likely to be asked for next
        (a fair queue's first reads). A backend may send it with ``start``'s statement and
        answer ``rows`` from it when asked with equal ``params`` (PostgreSQL: one round
        trip); a read never asked for is dropped. Only reads without side effects.
        Returns whether it will be sent ahead (False: it runs when asked, so the caller
        may ask for less once it knows more)."""
        ...

    def claim(self, params: dict[str, object], *, last: bool) -> list[tuple[object, ...]]:
        """``job_claim_ids``: the claim's write. ``last``: no statement follows it in the
        transaction, so a backend may send the commit with it."""
        ...

    def id_list(self, values: list[object]) -> object: ...

    def lock(self, names: list[str]) -> None:
        """Lock ``names`` (sorted) for the transaction, where claims of different queues
        can run at once (PostgreSQL); a no-op where every claim is serialised (SQLite)."""
        ...


class Claimed(list):  # type: ignore[type-arg]
    """Rows a limited claim took; ``retry_in``: seconds until a rate window has room again
    (None when no rate limit held the claim back), so the worker wakes then, not later."""

    retry_in: float | None = None
    gated: int = 0  # due jobs a concurrency key or a rate held back (not idle: gated)
    # Rows of a fair queue that are the first claimed of a key with nothing running: a
    # worker whose slots are full may start them on its express lane (errands.worker).
    express: frozenset[int] = frozenset()
    # The queue has a cluster-wide limit (max_running) in the store, whoever declared it:
    # each of its stored outcomes frees a slot that a waiting job may take (errands.worker
    # wakes its claim loop for them, as for a concurrency key's).
    capped: bool = False

    def carrying(self, rows: Iterable[object]) -> Claimed:
        """``rows`` (these rows, as the backend returns them) with this claim's findings."""
        out = Claimed(rows)
        out.retry_in, out.gated, out.express = self.retry_in, self.gated, self.express
        out.capped = self.capped
        return out


def claim_limited(
    store: LimitedClaimStore,
    queue: str,
    cap: int,
    claim_params: dict[str, object],
    *,
    suspects: bool = False,
    names: Sequence[str] | None = None,
    weights: Weigher | None = None,
    cursors: FairCursors | None = None,
    express: bool = False,
    turns: int | None = None,
    key_limits: Mapping[str, int] | None = None,
) -> Claimed:
    """Claim up to ``cap`` jobs of a limited queue; returns the claimed rows (JobRow order);
    only job types in ``names`` when given (those the claiming worker can run).
    ``key_limits``: the claiming worker's own concurrency_limit per job type, which holds
    a row below the limit stored on it when lower (see :func:`key_limit`).
    ``weights``: a fair queue's weights given by code (``app.fair_weight(fn)``), for the
    keys without a stored one. ``cursors``: where each fair queue's rotation over its keys
    stands, kept by the caller between claims (see :func:`_pick_fair`); without it a fair
    claim reads every key. ``express``: a fair queue's express claim, for a worker's
    express lane: only the next job of keys with nothing running, one per key (nothing
    from a queue that is not fair); with ``suspects``, only such keys' next job when it is
    a rescued one (a worker's express lane takes those too). ``turns``: a suspect claim's
    round room: a fair queue ranks that many turns (as the fresh claim after it could)
    and takes the rescued jobs among them, at most ``cap``; ranked over ``cap`` alone, a
    rescued job of a key ranked second waited while a key before it had jobs, though the
    round's fresh claim would have served its key (see :func:`_pick_fair`).

    Call inside the transaction of the claim (``store.start`` serialises it).
    """
    result = Claimed()
    sent_ahead = False
    if cursors is not None and queue in cursors and not suspects:
        # A fair queue this process claimed before (its rotation has a place): the first
        # reads of its claim go with the claim's first statement where the backend can
        # (one round trip on PostgreSQL), as they are asked for when no cluster-wide limit
        # shrinks the room and no job type is out of its rate; else they are read again.
        guess = {**_Pick(store, queue, cap, {}, {}, [], names, result).params(), "suspects": False}
        sent_ahead = all([store.expect(q, p) for q, p in _first_reads(guess, cursors[queue], cap)])
    settings, named_rates = store.start(queue)
    fair, aging = False, None
    if settings:
        _, paused, max_running, rate_limit, rate_period = settings[0][:5]
        fair, aging = bool(settings[0][8]), settings[0][9]
    else:
        paused, max_running, rate_limit, rate_period = False, None, None, None
    result.capped = max_running is not None
    if cursors is not None and (not fair or aging is not None):
        cursors.pop(queue, None)  # no rotation: the claim's reads are not sent ahead
    if paused or (express and not fair):
        return result
    # A suspect claim ranks the round's turns (fair queues), takes at most cap rescued.
    room = max(cap, turns or 0) if suspects and (fair or aging) else cap
    if max_running is not None:
        running = int(store.rows("queue_running_count", {"queue": queue})[0][0])  # type: ignore[call-overload]
        room = min(room, int(max_running) - running)  # type: ignore[call-overload]
    if rate_limit is not None and rate_period:
        used, frees_in = _rate_used(store, f"queue:{queue}", float(rate_period))  # type: ignore[arg-type]
        left = int(rate_limit) - used  # type: ignore[call-overload]
        if left <= min(room, cap):  # held back (a suspect claim ranks more than it takes)
            result.retry_in = _sooner(result.retry_in, frees_in)
        room = min(room, left)
    most = min(cap, room)  # jobs taken at most (room: the turns ranked)
    if room <= 0:
        return result
    # The job types' rates, from their due rows: a first reading, to leave the exhausted
    # ones out of the lookahead; the chosen are counted again under their locks below.
    rates: dict[str, tuple[int, float]] = {}
    for name, limit, period in named_rates:
        rates[str(name)] = (int(limit), float(period))  # type: ignore[call-overload,arg-type]
    room_per_name = _rooms(store, rates, result)
    blocked: list[object] = [name for name, left in room_per_name.items() if left <= 0]
    pick = _Pick(
        store, queue, room, rates, room_per_name, blocked, names, result, weights, express, fair,
        key_limits, sent_ahead=sent_ahead,
    )  # fmt: skip
    if fair or aging:
        chosen = _pick_fair(
            pick,
            None if aging is None else float(aging),  # type: ignore[arg-type]
            suspects,
            cursors,
        )[:most]
    else:
        chosen = _pick_in_order(pick, suspects)
    if not chosen:
        return result
    # Lock what the chosen rows take (their keys, their types' rate buckets), then count
    # again: another queue's claim may have taken a shared key or bucket meanwhile.
    keys = sorted({c.concurrency_key for c in chosen if c.concurrency_key is not None})
    limited_names = sorted({c.name for c in chosen if c.name in rates})
    store.lock([f"key:{k}" for k in keys] + [f"rate:job:{n}" for n in limited_names])
    fresh_rates = {n: rates[n] for n in limited_names}
    chosen = choose(
        chosen, most, _running(store, chosen), _rooms(store, fresh_rates, result), caps=key_limits
    )
    if not chosen:
        return result
    logged = (rate_limit is not None and bool(rate_period)) or any(c.name in rates for c in chosen)
    claimed = store.claim(
        # the queue and the keys read and counted: a row edited since is left out
        {**claim_params, "ids": store.id_list([c.id for c in chosen]), "queue": queue,
         "keys": keys},
        last=not logged,
    )  # fmt: skip
    # In the order chosen (a fair queue's: each key's turn), not the rows' order: a worker
    # starts a prefetched batch first in, first out.
    order = {c.id: i for i, c in enumerate(chosen)}
    claimed.sort(key=lambda row: order[int(row[0])])  # type: ignore[call-overload]
    # Each start logged with the claim's token: a claim whose reply is lost is undone with
    # its starts (PostgreSQL's job_claim_undo).
    token = claim_params["token"]
    if rate_limit is not None and rate_period:
        _log_starts(store, f"queue:{queue}", len(claimed), float(rate_period), token)  # type: ignore[arg-type]
    started: dict[str, int] = {}
    for row in claimed:
        if str(row[1]) in rates:
            started[str(row[1])] = started.get(str(row[1]), 0) + 1
    for name, n in started.items():
        _log_starts(store, f"job:{name}", n, rates[name][1], token)
    result.extend(claimed)
    if pick.idle_keys:  # as chosen: the keys' running counts were read under the lock
        ids = {int(row[0]) for row in claimed}  # type: ignore[call-overload]
        result.express = frozenset(i for i in pick.idle_keys if i in ids)
    return result


@dataclass
class _Pick:
    """What choosing a limited claim's jobs reads and updates."""

    store: LimitedClaimStore
    queue: str
    room: int
    rates: dict[str, tuple[int, float]]  # the rate-limited job types' (count, period)
    room_per_name: dict[str, int]  # starts left in each rate-limited type's window
    blocked: list[object]  # types without room: left out in SQL
    names: Sequence[str] | None  # the types the claiming worker can run
    result: Claimed
    weights: Weigher | None = None  # fair weights given by code, for keys without a stored one
    express: bool = False  # only the next job of each key with nothing running
    fair: bool = False  # the queue is fair (not only aging): the express lane serves it
    caps: Mapping[str, int] | None = None  # the claiming worker's own key limit per type
    idle_keys: list[int] = field(default_factory=list)  # chosen: first of an idle key
    sent_ahead: bool = False  # a fair claim's first reads went with its first statement

    def params(self) -> dict[str, object]:
        return {
            "queue": self.queue,
            "blocked": self.store.id_list(self.blocked),
            "names": None if self.names is None else self.store.id_list(list(self.names)),
        }

    def learn_rates(self, candidates: Sequence[Candidate | FairCandidate]) -> None:
        """Add the rates of job types whose first due row appeared since the first
        reading."""
        for c in candidates:
            if c.rate_limit is not None and c.rate_period and c.name not in self.rates:
                self.rates[c.name] = (c.rate_limit, c.rate_period)
                fresh = _rooms(self.store, {c.name: self.rates[c.name]}, self.result)
                self.room_per_name.update(fresh)


def _pick_in_order(pick: _Pick, suspects: bool) -> list[Candidate]:
    """The due jobs to claim in claim order (priority, due time, id), within limits.

    A lookahead full of one key's jobs (or one rate-limited type's) once that key is at
    its limit in this claim is read again without that key's rows and without the rows
    already chosen: its first read took one job of 100 and left the room empty, and the
    jobs of other keys (and without one) behind them waited, a poll interval at a time
    (for good, while that key's backlog lasted)."""
    store = pick.store
    limit = lookahead(pick.room)
    chosen: list[Candidate] = []
    running: dict[str, int] = {}
    names = dict(pick.room_per_name)
    full: list[str] = []  # keys (and "name:" + types) held back so far: not read again
    for _ in range(IN_ORDER_READS):
        params = pick.params()
        params["blocked"] = store.id_list(
            [*pick.blocked, *(k[5:] for k in full if k.startswith("name:"))]
        )
        candidates = [
            Candidate(int(r[0]), str(r[1]), r[2], r[3], r[4], r[5])  # type: ignore[call-overload,arg-type]
            for r in store.rows(
                "claim_candidates_suspect" if suspects else "claim_candidates",
                {
                    **params,
                    "limit": limit,
                    "full": store.id_list([k for k in full if not k.startswith("name:")]),
                    "taken": store.id_list([c.id for c in chosen]),
                },
            )
        ]
        if not candidates:
            break
        pick.learn_rates(candidates)
        names.update({n: left for n, left in pick.room_per_name.items() if n not in names})
        unread = [c for c in candidates if c.concurrency_key not in running]
        running.update({k: 0 for k in {c.concurrency_key for c in unread} if k is not None})
        running.update(_running(store, unread))
        held: set[str] = set()
        more = choose(candidates, pick.room - len(chosen), running, names, held, pick.caps)
        for c in more:
            if c.concurrency_key is not None:
                running[c.concurrency_key] += 1
            if c.name in names:
                names[c.name] -= 1
        chosen += more
        pick.result.gated += len(candidates) - len(more) if held else 0
        if len(chosen) >= pick.room or len(candidates) < limit or not held:
            break
        full += sorted(held - set(full))
    return chosen


def _pick_fair(
    pick: _Pick, aging: float | None, suspects: bool, cursors: FairCursors | None
) -> list[Candidate]:
    """The due jobs of a fair queue to claim, in fair order (errands.backends.fair).

    A claim reads a **window** of the keys with due jobs, not all of them: the next
    ``window_size(room)`` keys (room + 16, at least 32) in key order after the queue's
    cursor (``cursors``: kept by the claiming process, not in the database), wrapping
    around at the last key; it ranks them as :func:`fair_pick` does every key, and moves
    the cursor past the last key it served (past the whole window when the window could
    not fill the room). So a claim costs O(window x log keys) whatever the number of
    keys, the rotation brings every key into a window, and a queue with fewer keys than
    a window is claimed exactly as if every key were read. The keyed rows of a priority
    above the window's lowest come from the queue's first ``window_size(room)`` due rows
    in claim order (``fair_lookahead``, which also brings the rows without a key), so
    priorities still order levels. A queue with ``aging``, a suspect claim, or a claim
    without ``cursors`` reads every key (its ranking needs every key's head).

    Rescued jobs (suspects) take their turn like the others: the worker's suspect claim
    orders fresh and rescued jobs together over the round's room (``turns``: what the
    fresh claim after it could take) and keeps the rescued ones it picked, so a key whose
    jobs keep getting rescued never takes the turns of the keys behind it, and a rescued
    job is taken in a round that would serve its key; the fresh claim leaves rescued jobs
    out."""
    store, queue, room = pick.store, pick.queue, pick.room
    none = store.id_list([])
    if suspects and not store.rows(
        "claim_candidates_suspect", {**pick.params(), "limit": 1, "full": none, "taken": none}
    ):
        return []  # no rescued job due: the common case, read through its own index
    params = {**pick.params(), "suspects": suspects}
    windowed = cursors is not None and aging is None and not suspects
    cursor = cursors.get(queue) if cursors is not None and windowed else None
    if windowed:
        (_, first), (_, ahead_params) = _first_reads(params, cursor, room)
        candidates, read, standing = _fair_window(store, first, window_size(room))
        low = min((c.priority for c in candidates), default=LEVEL_MIN)
        # every row of the lookahead read (see _first_reads): the keyed ones above kept.
        # Not sent ahead (SQLite): only those asked for (~80 rows a claim, all but a few
        # left out, were built for nothing under the file's write lock)
        if not pick.sent_ahead:
            ahead_params = {**ahead_params, "above": low}
        window = set(read)
        ahead = [  # (judged on the rows: most are left out, and built for nothing)
            _candidate(r)
            for r in store.rows("fair_lookahead", ahead_params)
            if (key := UNKEYED if r[6] is None else str(r[6])) not in window
            and (key == UNKEYED or int(r[7]) > low)  # type: ignore[call-overload]
        ]
    else:
        heads = {**params, "after": None, "before": None, "limit": UNBOUNDED, "per_key": 1}
        rows = store.rows("fair_heads", heads)
        candidates = [_candidate(r) for r in rows if r[0] is not None]
        standing = list({str(r[6]): (r[6], *r[10:19]) for r in rows}.values())
        read = []
        # every key's heads are read: only the rows without a key come from the lookahead
        ahead_all = {**params, "lookahead": lookahead(room), "above": None}
        ahead = _fair_rows(store, "fair_lookahead", ahead_all)
    candidates += ahead
    if not candidates:
        if windowed and read and cursors is not None and not pick.express:
            cursors[queue] = read[-1]
        return []
    keys = sorted({c.fair_key for c in candidates})
    # The standings came with the heads; the lookahead's keys (and the rows without a
    # key) are read apart, when there are any.
    wanted = set(keys)
    standing = [r for r in standing if str(r[0]) in wanted]
    missing = sorted(wanted - {str(r[0]) for r in standing})
    if missing:
        more_keys = store.id_list(list[object](missing))
        standing += store.rows("fair_states", {"queue": queue, "keys": more_keys})
    states, now = _states(standing, pick.weights)
    # Keys the express lane serves: nothing running, within their share (a key over it
    # waits for its turn in a slot, as ever: the lane is no way around its weight).
    over = over_share(states, keys)  # judged among every key read, once per claim
    idle: set[str] = set()
    if pick.fair:  # not in a queue with aging only
        idle = {k for k in keys if k != UNKEYED and ((s := states.get(k)) is None or not s.running)}
        idle -= over
    if pick.express:  # each such key's next job only: its highest level's first
        firsts: dict[str, FairCandidate] = {}
        # (the reads give a key's levels lowest first: the express claim took a key's
        # lowest-priority job while a higher one waited for a slot)
        for c in sorted(candidates, key=lambda c: _claim_order(c, now, aging)):
            if c.fair_key in idle:
                firsts.setdefault(c.fair_key, c)
        # A suspect express claim: the keys whose next job is a rescued one (a fresh one
        # before it goes first, by the fresh express claim, which reads no rescued row).
        firsts = {k: c for k, c in firsts.items() if c.rescued == suspects}
        candidates = list(firsts.values())
        keys = sorted(firsts)
    # Room for more than one job per key that may take turns: read more of each such
    # key, as many as the room left beyond one each. Else, with one job read per key, a
    # key over its share got the slots its own turn did not fill (every other key's
    # only job taken): a key of 10x slower jobs had 1.5x its share on PostgreSQL.
    eligible = [k for k in keys if k != UNKEYED and k not in over]
    if eligible and room > len(eligible) + (UNKEYED in wanted) and not pick.express:
        per_key = room - len(eligible) + 1
        more = {**params, "per_key": per_key, "keys": store.id_list(list[object](eligible))}
        chosen_keys = set(eligible)
        candidates = [c for c in candidates if c.fair_key not in chosen_keys]
        candidates += _fair_rows(store, "fair_more", more)
    pick.learn_rates(candidates)
    picked = _fair_choose(pick, candidates, states, now, aging)
    if (
        len(picked.chosen) < room
        and not pick.express
        and any(
            sum(1 for c in candidates if c.fair_key == k) == picked.taken.get(k, 0) for k in over
        )
    ):
        # Work-conserving: the room is not full and a key over its share, read one job
        # deep, had its every job read taken: read more of every key.
        more = {**params, "per_key": room, "keys": store.id_list(list[object](keys))}
        unkeyed = [c for c in candidates if c.fair_key == UNKEYED]
        candidates = _fair_rows(store, "fair_more", more) + unkeyed
        pick.learn_rates(candidates)
        picked = _fair_choose(pick, candidates, states, now, aging)
    pick.result.gated += picked.gated
    seen: set[str] = set()
    for c in picked.chosen:  # the first chosen of each key the express lane serves
        if c.fair_key in idle and c.fair_key not in seen:
            pick.idle_keys.append(c.id)
        seen.add(c.fair_key)
    if windowed and read and cursors is not None and not pick.express:
        # Past the last key of the window served (in rotation order); past the whole
        # window when it could not fill the room. A key skipped though within its share
        # (others had waited longer) started a job longer ago than the keys served: it
        # goes first in the next window that reads it. (The express lane's claims leave
        # the rotation where the slots' claims put it.)
        place = {key: i for i, key in enumerate(read)}
        served = [place[c.fair_key] for c in picked.chosen if c.fair_key in place]
        if len(picked.chosen) < room:
            cursors[queue] = read[-1]
        elif served:
            cursors[queue] = read[max(served)]
    return [
        Candidate(c.id, c.name, c.concurrency_key, c.concurrency_limit, c.rate_limit, c.rate_period)
        for c in picked.chosen
        if c.rescued == suspects
    ]


def _claim_order(c: FairCandidate, now: float, aging: float | None) -> tuple[float, ...]:
    """A key's jobs in the order it runs them: highest (effective) priority first, then
    due time and id (as fair_pick takes them)."""
    return (-effective_priority(c.priority, c.run_at, now, aging), c.run_at, c.id)


def _fair_choose(
    pick: _Pick,
    candidates: list[FairCandidate],
    states: dict[str, KeyState],
    now: float,
    aging: float | None,
) -> FairPick:
    """:func:`fair_pick` over ``candidates``, within the concurrency keys' and rates'
    room."""
    running = _running(pick.store, candidates)
    names_left = dict(pick.room_per_name)

    def admit(c: FairCandidate) -> bool:
        key = c.concurrency_key
        if key is not None and running.get(key, 0) >= key_limit(c, pick.caps):
            return False
        if c.name in names_left and names_left[c.name] <= 0:
            return False
        if key is not None:
            running[key] = running.get(key, 0) + 1
        if c.name in names_left:
            names_left[c.name] -= 1
        return True

    return fair_pick(candidates, states, pick.room, admit, now=now, aging=aging)


def window_size(room: int) -> int:
    """Keys with due jobs a windowed fair claim reads: its room and WINDOW_SPARE more (to
    serve keys past the ones it skips), at least WINDOW_MIN (the share of worker time
    is judged among them). Also the lookahead of a windowed claim (see _pick_fair)."""
    return max(room + WINDOW_SPARE, WINDOW_MIN)


def _first_reads(
    params: dict[str, object], cursor: str | None, room: int
) -> tuple[tuple[str, dict[str, object]], tuple[str, dict[str, object]]]:
    """A windowed fair claim's first two reads, as (query, params): the first window of
    keys after ``cursor`` (fair_heads) and the lookahead (fair_lookahead), whose every row
    is read (``above`` the lowest level) and those above the window's lowest level kept by
    the caller: so both are known before either answers (see LimitedClaimStore.expect)."""
    size = window_size(room)
    return (
        ("fair_heads", {**params, "after": cursor, "before": None, "limit": size, "per_key": 1}),
        ("fair_lookahead", {**params, "lookahead": size, "above": LEVEL_MIN}),
    )


def _fair_window(
    store: LimitedClaimStore, first: dict[str, object], size: int
) -> tuple[list[FairCandidate], list[str], list[Sequence[object]]]:
    """The heads of the next ``size`` keys with due jobs after the cursor (``first``: the
    first window's fair_heads params; wrapping around once), every key read, in rotation
    order, and their standings (fair_states' rows). Keys whose rows are not due
    (scheduled later) are read and passed, up to WINDOW_READS windows' worth once a key
    with due jobs is found (until one is, or every key was read: a claim never reports
    an idle queue while a key has a due job)."""
    candidates: list[FairCandidate] = []
    read: list[str] = []
    standing: list[Sequence[object]] = []
    with_heads: set[str] = set()
    cursor = first["after"]
    after, before, wrapped = cursor, None, cursor is None
    while True:
        rows = store.rows("fair_heads", {**first, "after": after, "before": before})
        stretch: list[str] = []
        for row in rows:
            key = str(row[6])
            if not stretch or stretch[-1] != key:
                stretch.append(key)
                standing.append((key, *row[10:19]))
            if row[0] is not None:
                candidates.append(_candidate(row))
                with_heads.add(key)
        read += stretch
        if len(with_heads) >= size or (with_heads and len(read) >= WINDOW_READS * size):
            break
        if len(stretch) < size:  # the last key: wrap around to the first, once
            if wrapped:
                break
            wrapped, after, before = True, None, cursor
        else:
            after = stretch[-1]
    return candidates, read, standing


def _fair_rows(
    store: LimitedClaimStore, query: str, params: dict[str, object]
) -> list[FairCandidate]:
    return [_candidate(r) for r in store.rows(query, params)]


def _candidate(r: Sequence[object]) -> FairCandidate:
    return FairCandidate(
        int(r[0]), str(r[1]), r[2], r[3], r[4], r[5],  # type: ignore[arg-type,call-overload]
        UNKEYED if r[6] is None else str(r[6]), int(r[7]), float(r[8]),  # type: ignore[call-overload,arg-type]
        bool(r[9]),
    )  # fmt: skip


def fair_states(
    store: LimitedClaimStore, queue: str, keys: Sequence[str], weights: Weigher | None = None
) -> tuple[dict[str, KeyState], float]:
    """Each key's standing in ``queue`` (see :class:`KeyState`), and the database's now.
    A key's weight is its stored one, else the one ``weights`` gives, else 1."""
    rows = store.rows("fair_states", {"queue": queue, "keys": store.id_list(list(keys))})
    return _states(rows, weights)


def _states(
    rows: Iterable[Sequence[object]], weights: Weigher | None
) -> tuple[dict[str, KeyState], float]:
    """The standings of fair_states' rows (key, usage, recent, at, last start, running
    seconds, running's latest start, weight, now, running attempts), and now."""
    states: dict[str, KeyState] = {}
    unweighted: list[str] = []
    now = 0.0
    for key, usage, recent, at, last, running, running_last, weight, t, n in rows:
        now = float(t)  # type: ignore[arg-type]
        if weight is None:
            state = KeyState()  # (weight 1)
            unweighted.append(str(key))
        else:
            state = KeyState(weight=float(weight))  # type: ignore[arg-type]
        if usage is not None:
            used = float(usage)  # type: ignore[arg-type]
            age = now - float(at)  # type: ignore[arg-type]
            # decayed(used, age), inline: this runs for every key a claim reads
            state.usage = used * 0.5 ** ((age if age > 0.0 else 0.0) / HALF_LIFE)
            if recent:
                state.mean_cost = max(used / float(recent), 0.001)  # type: ignore[arg-type]
            state.last_started = float(last)  # type: ignore[arg-type]
        if running is not None:
            # A running attempt counts at least its key's mean job time: what it will use,
            # not only what it has used so far. Else a key of slow jobs, within its share
            # at each claim, starts one more at each and overshoots by all of them.
            state.usage += max(float(running), int(n) * state.mean_cost)  # type: ignore[arg-type,call-overload]
        if running_last is not None:
            state.last_started = max(state.last_started or 0.0, float(running_last))  # type: ignore[arg-type]
        state.running = int(n or 0)  # type: ignore[call-overload]
        states[str(key)] = state
    if weights is not None and unweighted:
        for key, given in weights(unweighted).items():
            states[key].weight = given
    return states, now


def _rooms(
    store: LimitedClaimStore, rates: dict[str, tuple[int, float]], result: Claimed
) -> dict[str, int]:
    """Starts left in each job type's rate window (noting when a full one frees up)."""
    rooms: dict[str, int] = {}
    for name, (limit, period) in rates.items():
        used, frees_in = _rate_used(store, f"job:{name}", period)
        rooms[name] = limit - used
        if rooms[name] <= 0:
            result.retry_in = _sooner(result.retry_in, frees_in)
    return rooms


def _running(
    store: LimitedClaimStore, candidates: Sequence[Candidate | FairCandidate]
) -> dict[str, int]:
    """Running jobs per concurrency key of ``candidates``, in any queue."""
    keys = sorted({c.concurrency_key for c in candidates if c.concurrency_key is not None})
    running: dict[str, int] = {}
    if keys:
        for key, count in store.rows("running_per_key", {"keys": store.id_list(list(keys))}):
            running[str(key)] = int(count)  # type: ignore[call-overload]
    return running


def _sooner(current: float | None, candidate: float | None) -> float | None:
    if candidate is None:
        return current
    candidate = max(candidate, 0.001)
    return candidate if current is None else min(current, candidate)


def _rate_used(store: LimitedClaimStore, bucket: str, period: float) -> tuple[int, float | None]:
    used, frees_in = store.rows("rate_count", {"bucket": bucket, "period": period})[0]
    return int(used), None if frees_in is None else float(frees_in)  # type: ignore[call-overload,arg-type]


def _log_starts(
    store: LimitedClaimStore, bucket: str, n: int, period: float, token: object
) -> None:
    if n > 0:
        params = {"bucket": bucket, "n": n, "period": period, "token": token}
        store.rows("rate_log_insert", params)
