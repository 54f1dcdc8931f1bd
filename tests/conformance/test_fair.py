"""Fair queues: claims across fair keys, weights, aging, gating, and the usage folded by
the fenced write that ends each attempt, on every backend."""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter

import pytest

from errands.backends import Backend
from errands.backends.base import (
    ClaimParams,
    FinishParams,
    LeaseRef,
    QueueClaim,
    QueueSettings,
    RescueParams,
)
from errands.backends.fair import CallableWeights
from errands.jobs import EnqueueRequest, JobRow

from .conftest import Harness
from .support import WORKER, error, get

_queues = itertools.count()


def fair_queue(backend: Backend, *, aging: float | None = None) -> str:
    name = f"fair{next(_queues)}"
    backend.queue_declare(QueueSettings(name, fair=True, aging=aging), "test")
    return name


def add(
    backend: Backend,
    queue: str,
    key: str | None,
    n: int = 1,
    *,
    priority: int = 0,
    concurrency_key: str | None = None,
) -> list[int]:
    requests = [
        EnqueueRequest(
            name="fair.job", queue=queue, args_json="{}", priority=priority, max_attempts=3,
            delay=0.0, run_at=None, key=None, timeout=None, lease_seconds=None,
            concurrency_key=concurrency_key, concurrency_limit=1 if concurrency_key else None,
            fair_key=key,
        )
        for _ in range(n)
    ]  # fmt: skip
    return [r.id for r in backend.job_insert_many(requests)]


def take(backend: Backend, queue: str, n: int) -> list[JobRow]:
    return list(backend.job_claim_limited(QueueClaim(queue, n), WORKER, 30.0))


_KEYS: dict[int, str | None] = {}  # each job's fair key, as enqueued


def keys(rows: list[JobRow]) -> Counter[str | None]:
    return Counter(_KEYS[r.id] for r in rows)


def add_keyed(backend: Backend, queue: str, key: str | None, n: int = 1, **kw: object) -> list[int]:
    ids = add(backend, queue, key, n, **kw)  # type: ignore[arg-type]
    _KEYS.update(dict.fromkeys(ids, key))
    return ids


def complete(backend: Backend, rows: list[JobRow]) -> None:
    outcomes = [FinishParams(r.id, r.lease_token or "", "completed", result_json="1") for r in rows]
    assert backend.job_finish_many(outcomes) == [True] * len(rows)


def test_a_fair_queue_is_claimed_through_the_limited_path_and_stores_its_settings(
    backend: Backend,
) -> None:
    queue = fair_queue(backend, aging=30.0)
    (stored,) = [s for s in backend.queue_settings() if s.name == queue]
    assert (stored.fair, stored.aging) == (True, 30.0)
    assert backend.queues_with_limits([queue, "plain"]) == {queue}


def test_a_backlog_enqueued_first_does_not_hold_back_the_keys_behind_it(
    backend: Backend,
) -> None:
    """Tenant A dumps 50 jobs, then B and C send one each: a claim of 3 takes one of each."""
    queue = fair_queue(backend)
    add_keyed(backend, queue, "tenant:a", 50)
    add_keyed(backend, queue, "tenant:b")
    add_keyed(backend, queue, "tenant:c")
    rows = take(backend, queue, 3)
    assert keys(rows) == Counter({"tenant:a": 1, "tenant:b": 1, "tenant:c": 1})
    assert keys(take(backend, queue, 3)) == Counter({"tenant:a": 3})


def test_with_more_slots_than_keys_weights_share_the_claim(backend: Backend) -> None:
    """Weight 4 against 1 (no worker time used yet): 8 of 10 slots against 2."""
    queue = fair_queue(backend)
    backend.fair_weight_set("tenant:big", 4.0, "ops")
    add_keyed(backend, queue, "tenant:big", 20)
    add_keyed(backend, queue, "tenant:small", 20)
    assert keys(take(backend, queue, 10)) == Counter({"tenant:big": 8, "tenant:small": 2})
    assert [(w.key, w.weight, w.updated_by) for w in backend.fair_weights()] == [
        ("tenant:big", 4.0, "ops")
    ]
    assert backend.audit_list(limit=1)[0].action == "fair_weight"
    backend.fair_weight_set("tenant:big", None, "ops")
    assert backend.fair_weights() == []


def test_weights_given_by_code_share_the_claim_and_a_stored_weight_overrides_them(
    backend: Backend,
) -> None:
    """``app.fair_weight(fn)``: the keys without a stored weight weigh what the callable
    gives (asked off the claim, cached); a weight stored by an operator wins."""
    queue = fair_queue(backend)
    asked: list[str] = []

    def weight(key: str) -> float:
        asked.append(key)
        return 4.0 if key == "tenant:big" else 1.0

    weights = CallableWeights(weight, budget=30.0)  # a quick callable: answered at once
    try:
        add_keyed(backend, queue, "tenant:big", 20)
        add_keyed(backend, queue, "tenant:small", 20)
        rows = backend.job_claim_limited(QueueClaim(queue, 10), WORKER, 30.0, weights=weights)
        assert keys(list(rows)) == Counter({"tenant:big": 8, "tenant:small": 2})
        assert sorted(asked) == ["tenant:big", "tenant:small"]
        backend.fair_weight_set("tenant:small", 4.0, "ops")  # the override: now even
        rows = backend.job_claim_limited(QueueClaim(queue, 10), WORKER, 30.0, weights=weights)
        counted = keys(list(rows))
        assert counted["tenant:small"] >= 4, counted
        assert len(asked) == 2  # cached: not asked again within its ttl
    finally:
        weights.close()
        backend.fair_weight_set("tenant:small", None, "ops")


def test_claims_over_new_keys_do_not_wait_for_a_weight_callable_that_hangs(
    backend: Backend,
) -> None:
    """Given a fair weight callable that hangs for good on its first 2 keys (both its
    threads stuck) and 200 keys, then 40 claims of 5, each over a window of new keys,
    wait the callable's budget once at most: the keys in flight when it hung. Every new
    key was queued to nobody and every claim waited the whole budget, under the queue's
    claim lock (SQLite: the file's write lock): 40 x 0.5 s here, a median claim of
    21.7 ms instead of 0.9 at the default budget."""
    queue = fair_queue(backend)
    release = threading.Event()
    calls: list[str] = []

    def weight(key: str) -> float:
        calls.append(key)
        if len(calls) <= 2:
            release.wait(120)  # a plan lookup with no timeout, during an outage
        return 2.0

    weights = CallableWeights(weight, budget=0.5)
    try:
        for t in range(200):
            add_keyed(backend, queue, f"t:{t}", 3)
        started = time.monotonic()
        for _ in range(40):
            rows = backend.job_claim_limited(QueueClaim(queue, 5), WORKER, 30.0, weights=weights)
            assert len(rows) == 5
        assert time.monotonic() - started < 10 * 0.5  # (before: 40 x 0.5 s and more)
    finally:
        release.set()
        weights.close()


def test_a_fair_claim_holds_rows_to_the_claiming_workers_lower_concurrency_limit(
    backend: Backend,
) -> None:
    """Rows enqueued with concurrency_limit 3 on key k, claimed by a worker whose code
    says 1 (``key_limits``): one of k's jobs, as in-order claims do (a lowered limit
    applies from the deploy on); without it, 3."""
    queue = fair_queue(backend)
    requests = [
        EnqueueRequest(
            name="fair.job", queue=queue, args_json="{}", priority=0, max_attempts=3,
            delay=0.0, run_at=None, key=None, timeout=None, lease_seconds=None,
            concurrency_key="k", concurrency_limit=3, fair_key=f"t:{i % 2}",
        )
        for i in range(8)
    ]  # fmt: skip
    backend.job_insert_many(requests)
    lowered = backend.job_claim_limited(
        QueueClaim(queue, 8), WORKER, 30.0, key_limits={"fair.job": 1}
    )
    assert len(lowered) == 1
    assert len(backend.job_claim_limited(QueueClaim(queue, 8), WORKER, 30.0)) == 2  # to 3


def test_a_key_that_used_more_worker_time_gets_fewer_of_the_extra_slots(
    backend: Backend,
) -> None:
    queue = fair_queue(backend)
    add_keyed(backend, queue, "slow", 20)
    add_keyed(backend, queue, "fast", 20)
    first = take(backend, queue, 2)  # one of each
    slow = [r for r in first if _KEYS[r.id] == "slow"]
    complete(backend, [r for r in first if _KEYS[r.id] == "fast"])
    time.sleep(1.5)
    complete(backend, slow)  # slow: 1.5 s of worker time; fast: a few ms
    rows = take(backend, queue, 6)
    counted = keys(rows)
    assert counted["fast"] >= 4 and counted["slow"] >= 1, counted
    figures = {f.key: f for f in backend.fair_figures(queue)}
    assert figures["slow"].seconds_total >= 1.4
    assert figures["fast"].seconds_total < figures["slow"].seconds_total


def test_a_keys_running_attempts_count_at_its_mean_job_time_so_slow_jobs_do_not_pile_up(
    backend: Backend,
) -> None:
    """A key whose jobs take 3 s (its folded history) and another of 10 ms jobs: a
    running attempt counts at least its key's mean job time, not only the moment it has
    run so far. So once two slow jobs run the slow key is over its share and the claim
    gives every slot to the other key; counting only the elapsed seconds, the slow key
    would look within its share and start one more at every claim."""
    queue = fair_queue(backend)
    add_keyed(backend, queue, "slow", 10)
    add_keyed(backend, queue, "fast", 30)
    first = take(backend, queue, 2)
    assert keys(first) == Counter({"slow": 1, "fast": 1})
    done = [
        FinishParams(r.id, r.lease_token or "", "completed", fair=True,
                     ran=3.0 if _KEYS[r.id] == "slow" else 0.01)
        for r in first
    ]  # fmt: skip
    assert backend.job_finish_many(done) == [True, True]
    assert keys(take(backend, queue, 4))["slow"] == 1  # its turn, then the rest by time
    assert keys(take(backend, queue, 4))["slow"] == 1  # one running: within one job of it
    assert keys(take(backend, queue, 4)) == Counter({"fast": 4})  # two: over its share


def test_a_key_at_its_concurrency_cap_never_blocks_the_next_key(backend: Backend) -> None:
    queue = fair_queue(backend)
    add_keyed(backend, queue, "capped", 30, concurrency_key="acct:1")
    add_keyed(backend, queue, "free", 3)
    assert keys(take(backend, queue, 1)) in (Counter({"capped": 1}), Counter({"free": 1}))
    rows = take(backend, queue, 10)
    counted = keys(rows)
    assert counted["capped"] <= 1 and counted["free"] >= 2


def test_priorities_order_levels_and_aging_lifts_a_long_waiting_job(
    backend: Backend, harness: Harness
) -> None:
    queue = fair_queue(backend, aging=10.0)
    (old,) = add_keyed(backend, queue, "a", priority=0)
    harness.backdate_run_at(backend, old, 25.0)  # due 25 s ago: two levels up, at 2
    add_keyed(backend, queue, "b", priority=1)
    (high,) = add_keyed(backend, queue, "c", priority=3)
    assert [r.id for r in take(backend, queue, 1)] == [high]
    assert [r.id for r in take(backend, queue, 1)] == [old]


def test_every_path_that_ends_an_attempt_folds_its_worker_time_once(
    backend: Backend, harness: Harness
) -> None:
    """Completion, failure, cancel, release, rescue and suspension each fold the attempt
    into its key's usage; a stale (fenced-out) write folds nothing; no slot stays taken."""
    queue = fair_queue(backend)
    ids = add_keyed(backend, queue, "k", 6)
    rows = {r.id: r for r in take(backend, queue, 6)}
    assert set(rows) == set(ids)
    a, b, c, d, e, f = (rows[i] for i in ids)
    backend.job_cancel(c.id, "ops")  # running: cancel requested, ends at its next write
    assert (
        backend.job_finish_many(
            [
                FinishParams(a.id, a.lease_token or "", "completed", result_json="1"),
                FinishParams(b.id, b.lease_token or "", "retryable", error=error(), delay=60.0),
                FinishParams(c.id, c.lease_token or "", "retryable", error=error(), delay=1.0),
                FinishParams(f.id, f.lease_token or "", "waiting", wait_signal="go"),
            ]
        )
        == [True] * 4
    )
    assert backend.job_release_many([LeaseRef(d.id, d.lease_token or "", 30.0)]) == [True]
    harness.expire_lease(backend, e.id)
    rescue = RescueParams(e.id, e.lease_token or "", "retryable", error(), 0.0)
    assert backend.job_rescue_many([rescue]) == [True]
    # stale writes: fenced out, folding nothing
    assert backend.job_finish_many([FinishParams(a.id, a.lease_token or "", "completed")]) == [
        False
    ]
    assert backend.job_rescue_many([rescue]) == [False]
    (figures,) = backend.fair_figures(queue)
    assert (figures.key, figures.attempts, figures.running) == ("k", 6, 0)
    assert get(backend, c.id).state == "cancelled"
    assert figures.dwell_total >= 0 and figures.seconds_total >= 0


def test_a_batch_of_outcomes_folds_each_attempt_once_per_key(backend: Backend) -> None:
    """A batch ending attempts of several keys (one outcome sent twice) folds each attempt
    once into its own key, with its handler's seconds: SQLite folds the batch in one
    statement, PostgreSQL in the write itself."""
    queue = fair_queue(backend)
    a_ids, b_ids = add_keyed(backend, queue, "a", 3), add_keyed(backend, queue, "b", 2)
    rows = {r.id: r for r in take(backend, queue, 5)}
    outcomes = [
        FinishParams(i, rows[i].lease_token or "", "completed", fair=True, ran=0.5)
        for i in [*a_ids, *b_ids]
    ]
    backend.job_finish_many([*outcomes, outcomes[-1]])
    figures = {f.key: f for f in backend.fair_figures(queue)}
    assert (figures["a"].attempts, figures["b"].attempts) == (3, 2)
    assert figures["a"].seconds_total == pytest.approx(1.5)
    assert figures["b"].seconds_total == pytest.approx(1.0)
    assert {get(backend, i).state for i in [*a_ids, *b_ids]} == {"completed"}


def test_a_handler_time_that_is_not_a_finite_number_folds_as_the_time_since_the_claim(
    backend: Backend,
) -> None:
    """An outcome whose handler seconds are NaN or infinite (never the worker's: its
    clock is monotonic, but FinishParams is the store's contract) folds the attempt's
    time since its claim, as an outcome without them, alone or in a batch. Before,
    PostgreSQL stored NaN as the key's usage (greatest(NaN, 0) is NaN): every later share
    of the queue was NaN."""
    queue = fair_queue(backend)
    ids = add_keyed(backend, queue, "k", 4)
    rows = {r.id: r for r in take(backend, queue, 4)}
    odd = [float("nan"), float("inf"), float("-inf"), float("nan")]
    outcomes = [
        FinishParams(i, rows[i].lease_token or "", "completed", fair=True, ran=ran)
        for i, ran in zip(ids, odd, strict=True)
    ]
    assert backend.job_finish_many(outcomes[:1]) == [True]
    assert backend.job_finish_many(outcomes[1:]) == [True] * 3
    (figures,) = backend.fair_figures(queue)
    assert figures.attempts == 4
    assert 0.0 <= figures.seconds_total < 60.0  # each: from its claim to its write
    assert 0.0 <= figures.recent_seconds < 60.0


def test_a_prefetched_release_folds_nothing_into_its_keys_usage(backend: Backend) -> None:
    """A fair job claimed and never begun (prefetched, given back by a stopping worker)
    cost its key no worker time: its release folds nothing, as an undone claim does (it
    folded the time from the claim to the stop, and an attempt)."""
    queue = fair_queue(backend)
    add_keyed(backend, queue, "k", 2)
    rows = take(backend, queue, 2)
    leases = [LeaseRef(r.id, r.lease_token or "", 30.0, fair=True) for r in rows]
    assert backend.job_release_many(leases, "stopping", prefetched=True) == [True, True]
    assert [f.attempts for f in backend.fair_figures(queue) if f.key == "k"] in ([], [0])
    assert {get(backend, r.id).state for r in rows} == {"available"}


def test_jobs_without_a_fair_key_in_a_fair_queue_are_still_claimed(backend: Backend) -> None:
    queue = fair_queue(backend)
    add_keyed(backend, queue, "a", 5)
    (unkeyed,) = add_keyed(backend, queue, None)
    rows = take(backend, queue, 2)
    assert unkeyed in {r.id for r in rows}


def test_the_fold_charges_the_handlers_seconds_and_the_dwell_before_the_write_moved_the_job(
    backend: Backend, harness: Harness
) -> None:
    """A write that carries its handler's seconds (``ran``) charges those, not the time
    from the claim to the write; the dwell is measured from the due time the job had
    before the write (a retry, a release and a rescue each move it)."""
    queue = fair_queue(backend)
    ids = add_keyed(backend, queue, "k", 4)
    for job_id in ids:
        harness.backdate_run_at(backend, job_id, 100.0)  # due 100 s before its claim
    rows = {r.id: r for r in take(backend, queue, 4)}
    a, b, c, d = (rows[i] for i in ids)
    assert {r.fair_key for r in rows.values()} == {"k"}  # the worker knows: fair=True
    time.sleep(0.3)  # the writes come later than the handlers' ends
    done = backend.job_finish_many(
        [
            FinishParams(a.id, a.lease_token or "", "completed", fair=True, ran=0.05),
            FinishParams(b.id, b.lease_token or "", "retryable", error=error(), delay=60.0,
                         fair=True, ran=0.1),
        ]
    )  # fmt: skip
    assert done == [True, True]
    (figures,) = backend.fair_figures(queue)
    assert figures.attempts == 2
    assert figures.seconds_total == pytest.approx(0.15)
    assert figures.dwell_total >= 2 * 99.0
    assert backend.job_release_many([LeaseRef(c.id, c.lease_token or "", 30.0, fair=True)]) == [
        True
    ]
    harness.expire_lease(backend, d.id)
    rescue = RescueParams(d.id, d.lease_token or "", "retryable", error(), 0.0, fair=True)
    assert backend.job_rescue_many([rescue]) == [True]
    (figures,) = backend.fair_figures(queue)
    assert figures.attempts == 4 and figures.running == 0
    assert figures.dwell_total >= 4 * 99.0
    assert figures.seconds_total >= 0.15 + 2 * 0.3  # no handler time known: claim to write


def test_a_write_of_jobs_without_a_fair_key_reads_and_folds_nothing(
    backend: Backend, harness: Harness
) -> None:
    """The worker tells the write which jobs have no fair key (their claimed rows say
    so): for those the write skips the fold altogether, on every path that ends an
    attempt; a job whose key it does not know (``fair=None``) is looked up and folded."""
    plain = next(_queues)
    backend.job_insert_many(
        [
            EnqueueRequest(
                name="plain.job", queue=f"plain{plain}", args_json="{}", priority=0,
                max_attempts=3, delay=0.0, run_at=None, key=None, timeout=None,
                lease_seconds=None,
            )
        ]
    )  # fmt: skip
    (row,) = backend.job_claim(ClaimParams([QueueClaim(f"plain{plain}", 1)], 1, WORKER, 30.0))
    assert row.fair_key is None
    assert backend.job_finish_many(
        [FinishParams(row.id, row.lease_token or "", "completed", fair=False, ran=0.1)]
    ) == [True]
    # A fair job written as if it had no key: nothing is folded, whatever the path.
    queue = fair_queue(backend)
    ids = add_keyed(backend, queue, "k", 4)
    rows = {r.id: r for r in take(backend, queue, 4)}
    a, b, c, d = (rows[i] for i in ids)
    assert backend.job_finish_many(
        [FinishParams(a.id, a.lease_token or "", "completed", fair=False)]
    ) == [True]
    assert backend.job_release_many([LeaseRef(b.id, b.lease_token or "", 30.0, fair=False)]) == [
        True
    ]
    harness.expire_lease(backend, c.id)
    rescue = RescueParams(c.id, c.lease_token or "", "retryable", error(), 0.0, fair=False)
    assert backend.job_rescue_many([rescue]) == [True]
    assert [f.attempts for f in backend.fair_figures(queue) if f.key == "k"] in ([], [0])
    assert backend.job_finish_many(
        [FinishParams(d.id, d.lease_token or "", "completed", fair=None)]
    ) == [True]
    assert [f.attempts for f in backend.fair_figures(queue) if f.key == "k"] == [1]


def test_a_key_over_its_share_gets_no_slot_while_the_others_have_jobs_to_fill_it(
    backend: Backend,
) -> None:
    """Four keys, claims of 4: once "slow" is over its share (two 5 s attempts against
    the others' 10 ms ones), the claim fills all 4 slots from the other three, two jobs
    for one of them. With one job read per key the fourth slot went to "slow": its turn
    was over, but every other key's only job read was taken."""
    queue = fair_queue(backend)
    for key in ("a", "b", "c", "slow"):
        add_keyed(backend, queue, key, 20)
    for _ in range(2):
        rows = take(backend, queue, 4)
        assert keys(rows) == Counter({"a": 1, "b": 1, "c": 1, "slow": 1})
        done = [
            FinishParams(r.id, r.lease_token or "", "completed", fair=True,
                         ran=5.0 if _KEYS[r.id] == "slow" else 0.01)
            for r in rows
        ]  # fmt: skip
        assert backend.job_finish_many(done) == [True] * 4
    counted = keys(take(backend, queue, 4))
    assert counted["slow"] == 0 and sum(counted.values()) == 4, counted


def express(backend: Backend, queue: str, n: int) -> list[JobRow]:
    return list(backend.job_claim_limited(QueueClaim(queue, n), WORKER, 30.0, express=True))


def test_an_express_claim_takes_only_the_next_job_of_keys_with_nothing_running(
    backend: Backend,
) -> None:
    """The express lane serves tenants with nothing running, one job each: never the
    backlog's key while it runs, never a second job of a key, never jobs without a key."""
    queue = fair_queue(backend)
    add_keyed(backend, queue, "noisy", 20)
    running = take(backend, queue, 4)
    assert keys(running) == Counter({"noisy": 4})
    assert express(backend, queue, 4) == []  # only the backlog's key, and it runs
    add_keyed(backend, queue, "quiet:1", 3)
    add_keyed(backend, queue, "quiet:2")
    add_keyed(backend, queue, None, 2)
    assert keys(express(backend, queue, 4)) == Counter({"quiet:1": 1, "quiet:2": 1})
    assert express(backend, queue, 4) == []  # each now has one running
    complete(backend, running)  # noisy has nothing running: its next job is express too
    assert keys(express(backend, queue, 4)) == Counter({"noisy": 1})


def test_an_express_claim_of_a_queue_that_is_not_fair_takes_nothing(backend: Backend) -> None:
    name = f"capped{next(_queues)}"
    backend.queue_declare(QueueSettings(name, max_running=10), "test")
    add(backend, name, None, 3)
    assert express(backend, name, 3) == []
    assert len(take(backend, name, 3)) == 3


def test_a_fair_claim_names_the_rows_that_are_the_first_of_a_key_with_nothing_running(
    backend: Backend,
) -> None:
    """A worker whose slots are full may start those at once on its express lane."""
    queue = fair_queue(backend)
    add_keyed(backend, queue, "noisy", 20)
    assert keys(take(backend, queue, 2)) == Counter({"noisy": 2})  # noisy runs
    add_keyed(backend, queue, "quiet", 2)
    claimed = backend.job_claim_limited(QueueClaim(queue, 4), WORKER, 30.0)
    by_key = {_KEYS[r.id]: r.id for r in reversed(list(claimed))}  # each key's first
    assert keys(list(claimed)) == Counter({"quiet": 2, "noisy": 2})
    assert claimed.express == frozenset({by_key["quiet"]})  # type: ignore[attr-defined]


def test_a_suspect_claim_takes_a_rescued_job_whose_key_the_rounds_fresh_claim_would_serve(
    backend: Backend, harness: Harness
) -> None:
    """The worker claims rescued jobs first, for its free suspect lanes (one, when its
    suspects are not isolated), then fresh jobs for the rest of the round's room. A fair
    queue's suspect claim ranks the keys over the round's room (``turns``) and takes the
    rescued jobs among them: "noisy" (behind its share: it ranks first) and "quiet" (a
    rescued job, ranked second). Ranked over one turn, the rescued job waited as long as
    "noisy" stayed behind its share (in the chaos soak: 49 noisy jobs claimed meanwhile),
    though the round's fresh claim would have served "quiet" second."""
    queue = fair_queue(backend)
    add_keyed(backend, queue, "busy", 10)
    add_keyed(backend, queue, "noisy", 30)
    add_keyed(backend, queue, "quiet", 2)
    ran = {"busy": 30.0, "noisy": 0.0, "quiet": 2.0}
    first = take(backend, queue, 3)
    assert keys(first) == Counter({"busy": 1, "noisy": 1, "quiet": 1})
    done = [
        FinishParams(r.id, r.lease_token or "", "completed", fair=True, ran=ran[_KEYS[r.id]])
        for r in first
    ]
    assert backend.job_finish_many(done) == [True] * 3
    # "noisy" (0 s) and "quiet" (2 s) are behind their share of the 32 s: they go first
    second = take(backend, queue, 2)
    assert keys(second) == Counter({"noisy": 1, "quiet": 1})
    noisy, quiet = sorted(second, key=lambda r: _KEYS[r.id] != "noisy")
    done = [FinishParams(noisy.id, noisy.lease_token or "", "completed", fair=True, ran=0.0)]
    assert backend.job_finish_many(done) == [True]
    harness.expire_lease(backend, quiet.id)
    rescue = RescueParams(quiet.id, quiet.lease_token or "", "retryable", error(), 0.0)
    assert backend.job_rescue_many([rescue]) == [True]

    one_turn = backend.job_claim_limited(QueueClaim(queue, 1), WORKER, 30.0, suspects=True)
    assert list(one_turn) == []  # "noisy" had the one turn: nothing rescued in it
    rescued = backend.job_claim_limited(QueueClaim(queue, 1), WORKER, 30.0, suspects=True, turns=3)
    assert [r.id for r in rescued] == [quiet.id] and rescued[0].rescues == 1
    assert keys(take(backend, queue, 2)) == Counter({"noisy": 1, "busy": 1})


def test_an_express_suspect_claim_takes_only_idle_keys_whose_next_job_was_rescued(
    backend: Backend, harness: Harness
) -> None:
    """The express lane's rescued jobs: "q" (its only job rescued, nothing running) is
    taken; "r" (rescued behind a fresh job of its own) is not: its fresh job goes first,
    by the fresh express claim, which takes no rescued job; "a" (a job running) neither;
    then no rescued job is left to take."""
    queue = fair_queue(backend)
    (q,) = add_keyed(backend, queue, "q")
    r_first, r_next = add_keyed(backend, queue, "r", 2)
    add_keyed(backend, queue, "a", 3)
    rows = {_KEYS[row.id]: row for row in take(backend, queue, 3)}
    assert set(rows) == {"q", "r", "a"} and rows["q"].id == q and rows["r"].id == r_first
    harness.backdate_run_at(backend, r_next, 1.0)  # due before r_first's rescue, surely
    for key in ("q", "r"):
        harness.expire_lease(backend, rows[key].id)
    rescues = [
        RescueParams(rows[k].id, rows[k].lease_token or "", "retryable", error(), 0.0)
        for k in ("q", "r")
    ]
    assert backend.job_rescue_many(rescues) == [True, True]

    def express_suspects() -> list[int]:
        claim = QueueClaim(queue, 5)
        return [
            r.id
            for r in backend.job_claim_limited(claim, WORKER, 30.0, suspects=True, express=True)
        ]

    assert express_suspects() == [q]
    assert [r.id for r in express(backend, queue, 5)] == [r_next]  # "r"'s fresh job
    assert express_suspects() == []  # "r" runs now; "a" ran all along


def test_an_express_claim_takes_a_keys_highest_priority_job(backend: Backend) -> None:
    """An idle key's next job is its highest level's first: the express claim took the
    lowest (a key's levels are read lowest first)."""
    queue = fair_queue(backend)
    add_keyed(backend, queue, "k", 2, priority=0)
    (high,) = add_keyed(backend, queue, "k", priority=5)
    assert [r.id for r in express(backend, queue, 3)] == [high]


def test_the_usage_of_keys_idle_past_the_retention_with_nothing_running_or_pending_is_forgotten(
    backend: Backend,
) -> None:
    """The maintenance leader's prune forgets a key's usage row once the key ended no
    attempt for the retention and has no job running or pending; in batches of ``limit``."""
    queue = fair_queue(backend)
    for key in ("idle1", "idle2", "idle3", "running", "pending"):
        add_keyed(backend, queue, key, 2 if key == "running" else 1)
        rows = take(backend, queue, 2)
        complete(backend, rows[:1])  # "running": its second job is still running
    add_keyed(backend, queue, "pending")  # "pending": a job due again
    assert backend.fair_usage_prune(3600.0, 100) == 0  # every key ended one a moment ago
    time.sleep(0.05)
    assert backend.fair_usage_prune(0.0, 2) == 2  # a batch at most
    assert backend.fair_usage_prune(0.0, 2) == 1
    assert backend.fair_usage_prune(0.0, 2) == 0
    figures = {f.key: f for f in backend.fair_figures(queue)}
    assert set(figures) == {"running", "pending"}  # the idle keys are gone
    assert (figures["running"].attempts, figures["running"].running) == (1, 1)
    assert (figures["pending"].attempts, figures["pending"].due) == (1, 1)


def test_a_rescue_refused_for_a_cancel_folds_nothing_and_its_replan_folds_once(
    backend: Backend, harness: Harness
) -> None:
    """The rescue planned before an operator's cancel is refused (see test_rescue): its
    fold, in the same fenced write, is refused with it, so the cancel's plan folds the
    attempt once (SQLite folded it before the refused write, then again)."""
    queue = fair_queue(backend)
    add_keyed(backend, queue, "k")
    (row,) = take(backend, queue, 1)
    harness.expire_lease(backend, row.id)
    backend.job_cancel(row.id, "ops")
    stale = RescueParams(row.id, row.lease_token or "", "retryable", error(), 0.0)
    assert backend.job_rescue_many([stale]) == [False]
    assert [f.attempts for f in backend.fair_figures(queue)] == [0]
    cancel = RescueParams(row.id, row.lease_token or "", "cancelled", error(), 0.0)
    assert backend.job_rescue_many([cancel]) == [True]
    (figures,) = backend.fair_figures(queue)
    assert (figures.attempts, figures.running) == (1, 0)
