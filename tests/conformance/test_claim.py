"""Claiming: order, caps, due times, lease fields, and no double claims."""

from __future__ import annotations

import threading

from errands.backends import Backend
from errands.backends.base import ClaimParams, QueueClaim, RescueParams

from .conftest import Harness
from .support import claim, claim_one, get, insert, request


def test_claim_takes_highest_priority_then_oldest_run_at_then_lowest_id(
    backend: Backend,
) -> None:
    """Claim order is priority DESC, then run_at, then id."""
    at = backend.db_now() - 100.0
    low_but_oldest = insert(backend, priority=0, run_at=at - 50)
    urgent_late = insert(backend, priority=10, run_at=at)
    urgent_early = insert(backend, priority=10, run_at=at - 10)
    tie_a = insert(backend, priority=5, run_at=at)
    tie_b = insert(backend, priority=5, run_at=at)
    order = [claim_one(backend).id for _ in range(5)]
    assert order == [urgent_early, urgent_late, tie_a, tie_b, low_but_oldest]


def test_a_batch_claim_takes_the_first_jobs_in_claim_order(backend: Backend) -> None:
    """A claim of N jobs takes the N that come first in claim order, not arbitrary ones."""
    at = backend.db_now() - 100.0
    later = [insert(backend, run_at=at) for _ in range(3)]
    first = [insert(backend, priority=1, run_at=at) for _ in range(2)]
    assert sorted(r.id for r in claim(backend, limit=2)) == first
    assert sorted(r.id for r in claim(backend, limit=10)) == later


def test_claim_marks_job_running_with_attempt_token_owner_and_lease(backend: Backend) -> None:
    """A claim sets running, attempt + 1, a lease token, the owner and the lease expiry."""
    job_id = insert(backend)
    before = backend.db_now()
    row = claim_one(backend, worker_id="host-a:123", lease=45.0)
    after = backend.db_now()
    assert row.id == job_id
    assert (row.state, row.attempt, row.lease_owner) == ("running", 1, "host-a:123")
    assert row.lease_token
    assert row.lease_expires_at is not None
    assert before + 44 <= row.lease_expires_at <= after + 46
    assert row.attempted_at is not None and before - 1 <= row.attempted_at <= after + 1
    stored = get(backend, job_id)
    assert (stored.state, stored.attempt, stored.lease_token) == ("running", 1, row.lease_token)


def test_claim_uses_the_jobs_own_lease_over_the_default(backend: Backend) -> None:
    """A job inserted with lease_seconds gets that lease, not the claimer's default."""
    insert(backend, lease_seconds=300.0)
    now = backend.db_now()
    row = claim_one(backend, lease=30.0)
    assert row.lease_expires_at is not None and row.lease_expires_at >= now + 295


def test_each_claim_gets_a_fresh_lease_token(backend: Backend, harness: Harness) -> None:
    """Re-claiming a job after its lease was rescued hands out a different token."""
    job_id = insert(backend)
    first = claim_one(backend)
    harness.expire_lease(backend, job_id)
    (expired,) = backend.job_list_expired(10)
    assert backend.job_rescue_many(
        [
            RescueParams(
                id=job_id,
                lease_token=expired.lease_token,
                state="retryable",
                error={"message": "worker lost"},
                delay=0.0,
            )
        ]
    ) == [True]
    second = claim_one(backend, suspects=True)  # a rescued job is a suspect now
    assert second.id == job_id and second.attempt == 2
    assert second.lease_token != first.lease_token


def test_claim_never_returns_a_job_before_its_run_at(backend: Backend) -> None:
    """Scheduled (delayed) jobs stay unclaimed until they are due."""
    insert(backend, delay=3600.0)
    insert(backend, run_at=backend.db_now() + 60.0)
    assert claim(backend, limit=10) == []


def test_claim_takes_a_scheduled_job_once_it_is_due(backend: Backend, harness: Harness) -> None:
    """A delayed job becomes claimable when its run_at passes, promoted or not."""
    job_id = insert(backend, delay=3600.0)
    harness.backdate_run_at(backend, job_id, 1.0)
    assert [r.id for r in claim(backend)] == [job_id]


def test_claim_only_visits_the_named_queues(backend: Backend) -> None:
    """Jobs on queues the claimer did not ask for are left alone."""
    insert(backend, queue="emails")
    other = insert(backend, queue="payments")
    assert claim(backend, "reports") == []
    assert [r.id for r in claim(backend, "payments")] == [other]


def test_claim_respects_each_queue_cap_and_the_total_limit(backend: Backend) -> None:
    """Each queue gives at most its own limit, and all together at most the total limit."""
    emails = [insert(backend, queue="emails") for _ in range(5)]
    payments = [insert(backend, queue="payments") for _ in range(5)]
    rows = backend.job_claim(
        ClaimParams(
            queues=[QueueClaim("emails", 2), QueueClaim("payments", 10)],
            limit=5,
            worker_id="w",
            lease_seconds_default=30,
        )
    )
    got = [r.id for r in rows]
    assert len(got) == 5
    assert [i for i in got if i in emails] == emails[:2]
    assert [i for i in got if i in payments] == payments[:3]


def test_claim_with_zero_limit_claims_nothing(backend: Backend) -> None:
    """A claim with no free slots changes no job."""
    job_id = insert(backend)
    assert claim(backend, limit=0) == []
    assert get(backend, job_id).state == "available"


def test_claim_skips_running_and_finished_jobs(backend: Backend) -> None:
    """A job already claimed is not claimed again while its lease holds."""
    job_id = insert(backend)
    claim_one(backend)
    assert claim(backend) == []
    assert get(backend, job_id).attempt == 1


def test_concurrent_claimers_never_get_the_same_job(backend: Backend) -> None:
    """Eight threads claiming in a loop share out 200 jobs with no job given twice."""
    ids = {r.id for r in backend.job_insert_many([request() for _ in range(200)])}
    claimed: list[int] = []
    failures: list[BaseException] = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def worker(n: int) -> None:
        try:
            barrier.wait()
            while True:
                rows = claim(backend, limit=3, worker_id=f"w{n}")
                if not rows:
                    return
                with lock:
                    claimed.extend(r.id for r in rows)
        except BaseException as exc:
            with lock:
                failures.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert failures == []
    assert len(claimed) == len(set(claimed)) == 200
    assert set(claimed) == ids


def test_rescued_jobs_are_claimed_only_as_suspects_and_no_more_than_asked(
    backend: Backend, harness: Harness
) -> None:
    """Rescued jobs stay out of ordinary claims; a suspect claim takes at most its limit
    (the worker asks for as many as it can run each on its own)."""
    ids = [insert(backend) for _ in range(3)]
    claimed = claim(backend, limit=3)
    assert sorted(r.id for r in claimed) == sorted(ids)
    for row in claimed:
        harness.expire_lease(backend, row.id)
    expired = backend.job_list_expired(10)
    assert all(
        backend.job_rescue_many(
            [
                RescueParams(
                    id=e.id,
                    lease_token=e.lease_token,
                    state="retryable",
                    error={"message": "worker lost"},
                    delay=0.0,
                )
                for e in expired
            ]
        )
    )
    fresh = insert(backend)
    assert [r.id for r in claim(backend, limit=10)] == [fresh]
    suspects = claim(backend, limit=1, suspects=True)
    assert len(suspects) == 1 and suspects[0].id in ids
    rest = claim(backend, limit=10, suspects=True)
    assert sorted(r.id for r in suspects + rest) == sorted(ids)


def test_rate_log_rows_are_pruned_after_their_own_period_not_after_a_day(
    backend: Backend,
) -> None:
    """Each start of a rate-limited queue is logged with its window: the leader's prune
    keeps it while the window can count it, and removes it once the window has passed
    (a '1000/s' bucket holds about a second of rows, not a day of them)."""
    import time

    from errands.backends.base import QueueSettings

    backend.queue_declare(QueueSettings("rated", rate_limit=5, rate_period=0.5), "test")
    for _ in range(3):
        insert(backend, queue="rated")
    assert len(backend.job_claim_limited(QueueClaim("rated", 3), WORKER_ID, 30.0)) == 3
    assert backend.rate_log_prune(86_400) == 0  # still inside its window
    started = backend.db_now()
    while backend.db_now() < started + 0.6:
        time.sleep(0.05)
    assert backend.rate_log_prune(86_400) == 3


def test_a_prefetched_release_gives_back_the_rate_starts_its_claim_counted_for_it(
    backend: Backend,
) -> None:
    """A claim of a rate-limited queue (and job type) logs a start for each job it takes;
    a job it took that was given back before it began (prefetched, at a stop) never
    started: its starts go back with it, as an undone claim's do, and its next claim
    counts it once. The claim's other job, begun, keeps its own. Without that, each such
    give-back charged the job twice against its rates (here the window stayed full: the
    given-back job waited for the hour to pass). SQLite's rate log recorded no token
    until its version 17: there the starts stayed until their window passed."""
    from dataclasses import replace

    from errands.backends.base import LeaseRef, QueueSettings

    backend.queue_declare(QueueSettings("rated", rate_limit=2, rate_period=3600.0), "test")
    rated = replace(request(queue="rated", name="rated.job"), rate_limit=2, rate_period=3600.0)
    backend.job_insert_many([rated, rated])
    begun, prefetched = backend.job_claim_limited(QueueClaim("rated", 5), WORKER_ID, 30.0)
    assert begun.lease_token == prefetched.lease_token  # one claim, one token
    lease = LeaseRef(prefetched.id, prefetched.lease_token or "", 30.0)
    assert backend.job_release_many([lease], "stopping", prefetched=True) == [True]
    again = backend.job_claim_limited(QueueClaim("rated", 5), WORKER_ID, 30.0)
    assert [r.id for r in again] == [prefetched.id]  # a start of each rate was free again
    assert backend.job_claim_limited(QueueClaim("rated", 5), WORKER_ID, 30.0) == []


def test_a_prefetched_release_gives_back_one_start_a_job_and_a_begun_release_none(
    backend: Backend,
) -> None:
    """Of one claim of a job type's rate ('4/h', its queue unrated), two jobs given back
    prefetched free two starts, one each, and no more: the claim's job that began keeps
    its start, and so does a job released at a stop after it began (it ran). A release
    that finds its job no longer leased to it (here: given back already) frees nothing."""
    from dataclasses import replace

    from errands.backends.base import LeaseRef

    rated = replace(request(queue="typed", name="typed.job"), rate_limit=4, rate_period=3600.0)
    backend.job_insert_many([rated] * 6)
    first = backend.job_claim_limited(QueueClaim("typed", 3), WORKER_ID, 30.0)
    assert len(first) == 3 and len({r.lease_token for r in first}) == 1  # one claim
    leases = [LeaseRef(r.id, r.lease_token or "", 30.0) for r in first]
    assert backend.job_release_many(leases[1:], "stopping", prefetched=True) == [True, True]
    # given back again: not leased to it any more, so no start of another job goes
    assert backend.job_release_many(leases[1:], "stopping", prefetched=True) == [False, False]
    second = backend.job_claim_limited(QueueClaim("typed", 5), WORKER_ID, 30.0)
    assert len(second) == 3  # 4 - the begun job's start
    ran = LeaseRef(second[0].id, second[0].lease_token or "", 30.0)
    assert backend.job_release_many([ran], "stopping") == [True]  # it began: counted
    assert backend.job_claim_limited(QueueClaim("typed", 5), WORKER_ID, 30.0) == []


def test_the_plain_claim_never_takes_a_queue_whose_stored_settings_limit_it(
    backend: Backend,
) -> None:
    """A queue another deployment limited (max_running, a rate, fairness, aging) is left
    to the limited claim, which counts them: a worker that has not learnt it yet (its
    refresh comes a poll interval later; at start, or while the store erred, none has
    come) claimed it plainly, past its max_running or its rate."""
    from errands.backends.base import QueueSettings

    limited = {
        "capped": QueueSettings("capped", max_running=1),
        "rated": QueueSettings("rated", rate_limit=1, rate_period=60.0),
        "shared": QueueSettings("shared", fair=True),
        "aged": QueueSettings("aged", aging=60.0),
    }
    for name, settings in limited.items():
        backend.queue_declare(settings, "another deployment")
        insert(backend, queue=name)
        insert(backend, queue=name)
        assert claim(backend, queue=name) == [], name
    assert len(backend.job_claim_limited(QueueClaim("capped", 5), WORKER_ID, 30.0)) == 1
    insert(backend, queue="plain")
    assert len(claim(backend, queue="plain")) == 1


def test_declaring_a_queue_keyed_turns_its_flag_on_and_leaves_every_other_setting(
    backend: Backend,
) -> None:
    """queue_declare_keyed, for a queue a worker's code has limited job types in but does
    not declare: a queue without a row gets one (no limits, not paused); a queue with one
    keeps its limits, fairness, aging and pause, whoever stored them, and its flag only
    ever turns on (a second call writes nothing: the same updated_by)."""
    from errands.backends.base import QueueSettings

    backend.queue_declare_keyed("fresh", "worker:a")
    backend.queue_declare(
        QueueSettings("held", max_running=3, rate_limit=5, rate_period=2.0, fair=True, aging=9.0),
        "worker:other",
    )
    backend.queue_set_paused("held", True, "ops")
    backend.queue_declare_keyed("held", "worker:a")
    backend.queue_declare_keyed("fresh", "worker:b")
    stored = {s.name: s for s in backend.queue_settings()}
    fresh, held = stored["fresh"], stored["held"]
    assert (fresh.jobs_declare_limits, fresh.paused, fresh.max_running, fresh.fair) == (
        True,
        False,
        None,
        False,
    )
    assert fresh.updated_by == "worker:a"
    assert held.jobs_declare_limits and held.paused
    assert (held.max_running, held.rate_limit, held.rate_period, held.fair, held.aging) == (
        3,
        5,
        2.0,
        True,
        9.0,
    )


WORKER_ID = "w-conformance"


def test_a_limited_claim_holds_rows_to_the_claiming_workers_lower_concurrency_limit(
    backend: Backend,
) -> None:
    """Rows enqueued with concurrency_limit 3 on key k, claimed by a worker whose code
    says 1 (``key_limits``): one of k's jobs; a worker whose code says 5 takes only up to
    the rows' own 3 (a raised limit applies to rows enqueued with it)."""
    from dataclasses import replace

    keyed = replace(request(queue="keyed"), concurrency_key="k", concurrency_limit=3)
    backend.job_insert_many([keyed] * 6)
    lowered = backend.job_claim_limited(
        QueueClaim("keyed", 6), WORKER_ID, 30.0, key_limits={keyed.name: 1}
    )
    assert len(lowered) == 1
    raised = backend.job_claim_limited(
        QueueClaim("keyed", 6), WORKER_ID, 30.0, key_limits={keyed.name: 5}
    )
    assert len(raised) == 2  # 3 running, the rows' own limit
