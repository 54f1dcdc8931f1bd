"""Fair claims over many keys read a window of them, on every backend.

A fair claim reads the next ``window_size(room)`` keys after its queue's cursor (kept by
the claiming process), not every key: its cost does not grow with the number of keys.
The rotation still reaches every key in turn, passes keys with nothing due, and keyed
jobs of a higher priority outside the window still go first.
"""

from __future__ import annotations

import itertools
import json
import math
import sqlite3
from collections import Counter

from errands.backends import Backend, open_backend
from errands.backends.base import FinishParams, QueueClaim, QueueSettings
from errands.backends.limits import WINDOW_READS, claim_limited, window_size
from errands.jobs import EnqueueRequest, JobRow

from .conftest import Harness
from .support import WORKER

_queues = itertools.count()


def fair_queue(backend: Backend, *, aging: float | None = None) -> str:
    name = f"window{next(_queues)}"
    backend.queue_declare(QueueSettings(name, fair=True, aging=aging), "test")
    return name


def add(
    backend: Backend,
    queue: str,
    keys: list[str],
    per_key: int = 1,
    *,
    priority: int = 0,
    delay: float = 0.0,
) -> dict[int, str]:
    """``per_key`` jobs of each key, enqueued key by key; job id -> its key."""
    requests = [
        EnqueueRequest(
            name="window.job", queue=queue, args_json="{}", priority=priority, max_attempts=3,
            delay=delay, run_at=None, key=None, timeout=None, lease_seconds=None, fair_key=key,
        )
        for key in keys
        for _ in range(per_key)
    ]  # fmt: skip
    return {
        result.id: str(r.fair_key)
        for result, r in zip(backend.job_insert_many(requests), requests, strict=True)
    }


def take_and_finish(backend: Backend, queue: str, n: int) -> list[JobRow]:
    rows = list(backend.job_claim_limited(QueueClaim(queue, n), WORKER, 30.0))
    done = [
        FinishParams(r.id, r.lease_token or "", "completed", result_json="1", fair=True, ran=0.001)
        for r in rows
    ]
    assert backend.job_finish_many(done) == [True] * len(rows)
    return rows


def test_the_rotation_over_many_keys_serves_each_key_once_before_any_twice(
    backend: Backend,
) -> None:
    """120 keys of 2 jobs, claims of 5 (a window of 32 keys): the first 120 jobs claimed
    are one of each key, so each key is claimed within ceil(120 / 5) = 24 claims."""
    queue = fair_queue(backend)
    keys = [f"tenant:{k:03d}" for k in range(120)]
    key_of = add(backend, queue, keys, 2)
    order: list[str] = []
    for _ in range(math.ceil(len(keys) / 5)):
        order += [key_of[r.id] for r in take_and_finish(backend, queue, 5)]
    assert len(order) == 120 and set(order) == set(keys)
    order += [key_of[r.id] for r in take_and_finish(backend, queue, 5)]
    assert Counter(order[-5:]) == Counter({k: 1 for k in order[-5:]})  # the second round


def test_two_workers_rotating_on_their_own_still_serve_each_key_once_before_any_twice(
    backend: Backend,
) -> None:
    """Each worker process keeps its own cursor: two of them, starting at the same key
    and claiming in turn, pass each other's freshly served keys (they started a job
    last), so the first 120 jobs are still one of each of 120 keys."""
    queue = fair_queue(backend)
    keys = [f"tenant:{k:03d}" for k in range(120)]
    key_of = add(backend, queue, keys, 2)
    other = open_backend(backend.url)  # type: ignore[attr-defined]
    try:
        order: list[str] = []
        for turn in range(math.ceil(len(keys) / 5)):
            worker = backend if turn % 2 == 0 else other
            order += [key_of[r.id] for r in take_and_finish(worker, queue, 5)]
        assert len(order) == 120 and set(order) == set(keys)
    finally:
        other.close()


def test_a_higher_priority_job_of_a_key_outside_the_window_is_claimed_first(
    backend: Backend,
) -> None:
    queue = fair_queue(backend)
    key_of = add(backend, queue, [f"tenant:{k:03d}" for k in range(100)], 2)
    key_of |= add(backend, queue, ["tenant:zzz"], 3, priority=5)  # last in key order
    assert [key_of[r.id] for r in take_and_finish(backend, queue, 2)] == ["tenant:zzz"] * 2
    first, second = (key_of[r.id] for r in take_and_finish(backend, queue, 2))
    assert first == "tenant:zzz" and second != "tenant:zzz"
    assert all(key_of[r.id] != "tenant:zzz" for r in take_and_finish(backend, queue, 4))


def test_a_job_aging_lifted_above_every_level_is_claimed_first_among_many_keys(
    backend: Backend, harness: Harness
) -> None:
    """A queue with aging ranks every key's head (not a window's): a job of the last
    key in key order, due long enough to rank above every other level, goes first."""
    queue = fair_queue(backend, aging=10.0)
    key_of = add(backend, queue, [f"tenant:{k:03d}" for k in range(100)], 2, priority=1)
    lifted = add(backend, queue, ["tenant:zzz"], 1, priority=0)
    (old,) = lifted
    key_of |= lifted
    harness.backdate_run_at(backend, old, 25.0)  # due 25 s ago: two levels up, at 2
    assert [r.id for r in take_and_finish(backend, queue, 1)] == [old]
    assert all(key_of[r.id] != "tenant:zzz" for r in take_and_finish(backend, queue, 4))


def test_keys_with_nothing_due_are_passed_and_the_due_keys_behind_them_claimed(
    backend: Backend,
) -> None:
    """60 keys whose jobs are due in an hour, ahead in key order of 5 keys with due jobs:
    one claim of 5 takes the 5 (it reads past the 60, within WINDOW_READS windows)."""
    assert WINDOW_READS * window_size(5) >= 65
    queue = fair_queue(backend)
    add(backend, queue, [f"a:{k:02d}" for k in range(60)], delay=3600.0)
    key_of = add(backend, queue, [f"z:{k}" for k in range(5)])
    assert sorted(key_of[r.id] for r in take_and_finish(backend, queue, 5)) == sorted(
        key_of.values()
    )


def test_a_claim_reads_on_until_it_finds_a_due_key_so_the_queue_never_looks_idle(
    backend: Backend,
) -> None:
    """150 keys with nothing due (more than WINDOW_READS windows of a claim of 1) ahead of
    one key with a due job: the claim takes that job, not an empty round."""
    assert WINDOW_READS * window_size(1) < 150
    queue = fair_queue(backend)
    add(backend, queue, [f"a:{k:03d}" for k in range(150)], delay=3600.0)
    key_of = add(backend, queue, ["z"])
    assert [key_of[r.id] for r in take_and_finish(backend, queue, 1)] == ["z"]


def test_a_fair_claim_reads_one_window_of_keys_not_every_key(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The claim's own reads, counted on SQLite: with 2,000 backlogged keys a claim of 10
    reads the heads of at most one window of keys (window_size(10) = 32), weighs only
    those keys, and the next claim starts where it stopped."""
    from errands.backends.sqlite.backend import SQLiteBackend, _LimitedStore

    backend = SQLiteBackend(f"sqlite:///{tmp_path / 'window.db'}")
    conn = sqlite3.connect(tmp_path / "window.db", isolation_level=None)
    try:
        queue = fair_queue(backend)
        add(backend, queue, [f"tenant:{k:04d}" for k in range(2000)], 2)
        reads: Counter[str] = Counter()

        class Counting(_LimitedStore):
            def rows(self, query: str, params: dict[str, object]) -> list[tuple[object, ...]]:
                got = super().rows(query, params)
                if query == "fair_heads":  # each row carries its key's standing
                    reads["head rows"] += len(got)
                    reads["weighed keys"] += len({row[6] for row in got})
                if query == "fair_states":
                    reads["weighed keys"] += len(json.loads(str(params["keys"])))
                return got

        cursors: dict[str, str] = {}
        claimed: list[tuple[object, ...]] = []
        for _ in range(2):
            conn.execute("BEGIN IMMEDIATE")
            params = {"worker_id": WORKER, "token": "t", "lease_default": 30.0}
            claimed += claim_limited(Counting(conn), queue, 10, params, cursors=cursors)
            conn.execute("COMMIT")
        assert len(claimed) == 20
        assert reads["head rows"] <= 2 * window_size(10)
        assert reads["weighed keys"] <= 2 * window_size(10)
        assert cursors[queue] == "tenant:0019"  # 20 keys served, in key order
    finally:
        conn.close()
        backend.close()


def test_a_claim_whose_reads_run_when_asked_reads_only_the_lookahead_rows_it_keeps(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    """On SQLite (nothing is sent ahead) the lookahead is read after the window, so it
    asks only for the rows a claim keeps: those without a key and the keyed ones above
    the window's lowest level. Before, each claim built every row of the lookahead
    (window_size rows, almost all left out) under the file's write lock. The claim takes
    what it took before: the higher-priority job of a key outside the window first, then
    the unkeyed job among the window's keys."""
    from errands.backends.sqlite.backend import SQLiteBackend, _LimitedStore

    backend = SQLiteBackend(f"sqlite:///{tmp_path / 'ahead.db'}")
    conn = sqlite3.connect(tmp_path / "ahead.db", isolation_level=None)
    try:
        queue = fair_queue(backend)
        key_of = {i: "(none)" for i in add(backend, queue, [None], 1)}  # type: ignore[list-item]
        key_of |= add(backend, queue, [f"tenant:{k:03d}" for k in range(200)], 2)
        key_of |= add(backend, queue, ["tenant:zzz"], 1, priority=5)  # last in key order
        lookahead: list[int] = []

        class Counting(_LimitedStore):
            def rows(self, query: str, params: dict[str, object]) -> list[tuple[object, ...]]:
                got = super().rows(query, params)
                if query == "fair_lookahead":
                    lookahead.append(len(got))
                return got

        cursors: dict[str, str] = {}
        taken: list[str] = []
        for _ in range(3):
            conn.execute("BEGIN IMMEDIATE")
            params = {"worker_id": WORKER, "token": "t", "lease_default": 30.0}
            rows = claim_limited(Counting(conn), queue, 4, params, cursors=cursors)
            conn.execute("COMMIT")
            taken += [key_of[int(r[0])] for r in rows]  # type: ignore[call-overload]
        assert taken[0] == "tenant:zzz" and "(none)" in taken[:8]
        assert len(taken) == 12 and len(set(taken)) == 12  # one job per key
        assert lookahead and max(lookahead) <= 2  # the unkeyed row, the priority-5 one
    finally:
        conn.close()
        backend.close()
