"""Leader duties: expired leases and their rescue, election, promotion and pruning."""

from __future__ import annotations

from errands.backends import Backend
from errands.backends.base import ActionParams, LeaseRef, ListParams, RescueParams
from errands.jobs import JobRow

from .conftest import Harness
from .support import claim, claim_one, error, errors_of, finish, get, insert, make_dead


def _rescue(row: JobRow, state: str = "retryable", delay: float = 0.0) -> RescueParams:
    return RescueParams(
        id=row.id,
        lease_token=row.lease_token or "",
        state=state,  # type: ignore[arg-type]
        error=error(row.attempt, "worker lost"),
        delay=delay,
    )


# -- expired leases --------------------------------------------------------------------


def test_list_expired_reports_only_running_jobs_whose_lease_ran_out(
    backend: Backend, harness: Harness
) -> None:
    """A live lease is not listed; an expired one is, with what the rescuer needs."""
    lost_id = insert(backend, max_attempts=5)
    insert(backend)
    rows = {r.id: r for r in claim(backend, limit=2, worker_id="host:1")}
    lost = rows.pop(lost_id)
    (alive,) = rows.values()
    harness.expire_lease(backend, lost.id)
    (expired,) = backend.job_list_expired(10)
    assert expired.id == lost.id and expired.name == lost.name
    assert expired.lease_token == lost.lease_token
    assert (expired.attempt, expired.max_attempts, expired.rescues) == (1, 5, 0)
    assert expired.cancel_requested is False
    assert expired.lease_owner == "host:1"
    assert alive.id not in {e.id for e in backend.job_list_expired(10)}


def test_list_expired_honours_its_limit_oldest_expiry_first(
    backend: Backend, harness: Harness
) -> None:
    """The rescuer works in batches, starting with the lease that expired first."""
    for _ in range(3):
        insert(backend)
    rows = claim(backend, limit=3)
    for seconds_ago, row in zip((10, 30, 20), rows, strict=True):
        harness.expire_lease(backend, row.id, seconds_ago)
    assert [e.id for e in backend.job_list_expired(2)] == [rows[1].id, rows[2].id]


def test_list_expired_shows_a_cancel_request(backend: Backend, harness: Harness) -> None:
    """An expired lease on a job an operator cancelled is flagged as such."""
    insert(backend)
    row = claim_one(backend)
    backend.job_cancel(row.id, "ops")
    harness.expire_lease(backend, row.id)
    (expired,) = backend.job_list_expired(10)
    assert expired.cancel_requested is True


def test_rescue_to_retryable_records_the_lost_attempt(backend: Backend, harness: Harness) -> None:
    """A rescued job is retryable after the delay, with rescues + 1 and the error kept."""
    insert(backend)
    row = claim_one(backend)
    harness.expire_lease(backend, row.id)
    assert backend.job_rescue_many([_rescue(row, delay=30.0)]) == [True]
    rescued = get(backend, row.id)
    now = backend.db_now()
    assert (rescued.state, rescued.rescues, rescued.attempt) == ("retryable", 1, 1)
    assert now + 25 <= rescued.run_at <= now + 31
    assert rescued.finished_at is None
    assert (rescued.lease_owner, rescued.lease_token, rescued.lease_expires_at) == (
        None,
        None,
        None,
    )
    assert errors_of(rescued)[-1]["message"] == "worker lost"


def test_rescue_to_dead_finishes_the_job(backend: Backend, harness: Harness) -> None:
    """A poison job's rescue sends it to the DLQ with a finish time."""
    insert(backend, max_attempts=1)
    row = claim_one(backend)
    harness.expire_lease(backend, row.id)
    assert backend.job_rescue_many([_rescue(row, state="dead")]) == [True]
    dead = get(backend, row.id)
    assert dead.state == "dead" and dead.finished_at is not None and dead.rescues == 1


def test_rescue_of_a_cancel_requested_job_cancels_it(backend: Backend, harness: Harness) -> None:
    """A job cancelled while its lease was expiring never runs again (F19)."""
    insert(backend)
    row = claim_one(backend)
    backend.job_cancel(row.id, "ops")
    harness.expire_lease(backend, row.id)
    assert backend.job_rescue_many([_rescue(row, "cancelled")]) == [True]
    assert get(backend, row.id).state == "cancelled"
    assert claim(backend) == []


def test_a_rescue_planned_before_a_cancel_request_is_refused_and_planned_again(
    backend: Backend, harness: Harness
) -> None:
    """The leader lists an expired lease (no cancel requested) and plans it dead (its last
    attempt); an operator's cancel lands before the write. The plan is refused: written,
    it made the job cancelled while the leader announced a death and ran its on_dead
    hooks. The job stays unclaimable, and the next listing plans the cancel."""
    insert(backend, max_attempts=1)
    row = claim_one(backend)
    harness.expire_lease(backend, row.id)
    (listed,) = backend.job_list_expired(10)
    assert listed.cancel_requested is False
    backend.job_cancel(row.id, "ops")
    assert backend.job_rescue_many([_rescue(row, "dead")]) == [False]
    assert claim(backend) == []
    (again,) = backend.job_list_expired(10)
    assert again.cancel_requested is True
    assert backend.job_rescue_many([_rescue(row, "cancelled")]) == [True]
    assert get(backend, row.id).state == "cancelled"


def test_rescue_with_a_wrong_token_changes_nothing(backend: Backend, harness: Harness) -> None:
    """The rescue is fenced by the expired claim's token."""
    insert(backend)
    row = claim_one(backend)
    harness.expire_lease(backend, row.id)
    stale = RescueParams(
        id=row.id, lease_token="someone-else", state="retryable", error=error(), delay=0.0
    )
    assert backend.job_rescue_many([stale]) == [False]
    after = get(backend, row.id)
    assert (after.state, after.rescues, errors_of(after)) == ("running", 0, [])


def test_rescue_of_a_live_lease_changes_nothing(backend: Backend) -> None:
    """A rescue only applies while the lease is still expired in the database."""
    insert(backend)
    row = claim_one(backend)
    assert backend.job_rescue_many([_rescue(row)]) == [False]
    assert get(backend, row.id).state == "running"


def test_heartbeat_landing_before_the_rescue_wins(backend: Backend, harness: Harness) -> None:
    """A lease renewed between listing and rescue is not rescued: the worker keeps its job."""
    insert(backend)
    row = claim_one(backend)
    harness.expire_lease(backend, row.id)
    (expired,) = backend.job_list_expired(10)
    beat = backend.job_heartbeat_many(
        [LeaseRef(id=row.id, lease_token=row.lease_token or "", lease_seconds=30)]
    )
    assert beat.extended == frozenset({(row.id, row.lease_token)})
    assert backend.job_rescue_many([_rescue(row)]) == [False]
    after = get(backend, row.id)
    assert (after.state, after.lease_token, after.rescues) == ("running", expired.lease_token, 0)
    assert finish(backend, row, "completed") is True


def test_original_worker_cannot_finish_after_its_lease_was_rescued(
    backend: Backend, harness: Harness
) -> None:
    """Once rescued, the worker that lost the lease cannot write its outcome."""
    insert(backend)
    row = claim_one(backend)
    harness.expire_lease(backend, row.id)
    assert backend.job_rescue_many([_rescue(row)]) == [True]
    assert finish(backend, row, "completed") is False
    assert get(backend, row.id).state == "retryable"


# -- leader election -------------------------------------------------------------------


def test_only_one_owner_holds_leadership_at_a_time(backend: Backend) -> None:
    """While A's leadership is live, B cannot take it."""
    assert backend.leader_attempt_elect("maintenance", "A", ttl=30) is True
    assert backend.leader_attempt_elect("maintenance", "B", ttl=30) is False
    assert backend.leader_attempt_elect("maintenance", "A", ttl=30) is True  # renewal


def test_the_owner_can_renew_after_expiry_while_no_one_took_over(
    backend: Backend, harness: Harness
) -> None:
    """The owner may renew even after expiry as long as no one else took over."""
    assert backend.leader_attempt_elect("maintenance", "A", ttl=30)
    harness.expire_leader(backend, "maintenance")
    assert backend.leader_attempt_elect("maintenance", "A", ttl=30) is True
    assert backend.leader_attempt_elect("maintenance", "B", ttl=30) is False


def test_another_owner_takes_over_after_the_ttl_expires(backend: Backend, harness: Harness) -> None:
    """An expired leadership goes to the next candidate, and the old leader is out."""
    assert backend.leader_attempt_elect("maintenance", "A", ttl=30)
    harness.expire_leader(backend, "maintenance")
    assert backend.leader_attempt_elect("maintenance", "B", ttl=30) is True
    assert backend.leader_attempt_elect("maintenance", "A", ttl=30) is False


def test_resign_frees_leadership_at_once(backend: Backend) -> None:
    """After the leader resigns, another owner is elected without waiting for the ttl."""
    assert backend.leader_attempt_elect("maintenance", "A", ttl=3600)
    backend.leader_resign("maintenance", "A")
    assert backend.leader_attempt_elect("maintenance", "B", ttl=3600) is True


def test_resign_by_a_non_owner_does_nothing(backend: Backend) -> None:
    """Only the current owner can give leadership up."""
    assert backend.leader_attempt_elect("maintenance", "A", ttl=3600)
    backend.leader_resign("maintenance", "B")
    assert backend.leader_attempt_elect("maintenance", "B", ttl=3600) is False


def test_leadership_names_are_independent(backend: Backend) -> None:
    """Leadership of one name says nothing about another."""
    assert backend.leader_attempt_elect("maintenance", "A", ttl=30)
    assert backend.leader_attempt_elect("cron", "B", ttl=30) is True


# -- promotion -------------------------------------------------------------------------


def test_promote_due_makes_due_scheduled_and_retryable_jobs_available(
    backend: Backend, harness: Harness
) -> None:
    """Due scheduled and retryable jobs become available; future ones stay put."""
    due_scheduled = insert(backend, delay=3600.0)
    harness.backdate_run_at(backend, due_scheduled, 1.0)
    future = insert(backend, delay=3600.0)
    insert(backend, priority=9)
    row = claim_one(backend)
    assert finish(backend, row, "retryable", error=error(), delay=3600.0)
    harness.backdate_run_at(backend, row.id, 1.0)
    available_before = insert(backend)
    assert backend.job_promote_due() == 2
    assert get(backend, due_scheduled).state == "available"
    assert get(backend, row.id).state == "available"
    assert get(backend, future).state == "scheduled"
    assert get(backend, available_before).state == "available"
    assert backend.job_promote_due() == 0


def test_promote_due_relabels_a_bounded_batch_a_call(backend: Backend, harness: Harness) -> None:
    """One statement relabelled every due row: a million due at once held their locks
    (claims skipped them) or the SQLite write lock until it was done, past the leader's
    lease. A call takes at most its batch; the next takes the rest."""
    ids = [insert(backend, delay=3600.0) for _ in range(3)]
    for job_id in ids:
        harness.backdate_run_at(backend, job_id, 1.0)
    assert backend.job_promote_due(2) == 2
    assert backend.job_promote_due(2) == 1
    assert {get(backend, i).state for i in ids} == {"available"}


# -- pruning ---------------------------------------------------------------------------


def test_prune_deletes_only_old_completed_cancelled_and_discarded_jobs(
    backend: Backend, harness: Harness
) -> None:
    """Finished rows past retention go; recent ones, dead and pending ones stay."""
    completed_old, completed_new, cancelled_old = insert(backend), insert(backend), insert(backend)
    rows = {r.id: r for r in claim(backend, limit=3)}
    finish(backend, rows[completed_old], "completed")
    finish(backend, rows[completed_new], "completed")
    finish(backend, rows[cancelled_old], "cancelled")
    discarded_old = make_dead(backend)
    backend.job_discard(ActionParams(actor="ops", ids=[discarded_old], reason="obsolete"))
    dead_old = make_dead(backend)
    pending = insert(backend)
    for job_id in (completed_old, cancelled_old, discarded_old, dead_old):
        harness.backdate_finished(backend, job_id, 8 * 86400)
    assert backend.job_prune(older_than=7 * 86400, limit=100) == 3
    remaining = {r.id for r in backend.job_list(ListParams())}
    assert remaining == {completed_new, dead_old, pending}


def test_prune_deletes_at_most_limit_rows_per_call(backend: Backend, harness: Harness) -> None:
    """Pruning works in small batches."""
    for _ in range(5):
        insert(backend)
    for row in claim(backend, limit=5):
        finish(backend, row, "completed")
        harness.backdate_finished(backend, row.id, 100)
    assert backend.job_prune(older_than=10, limit=2) == 2
    assert backend.job_prune(older_than=10, limit=10) == 3
    assert backend.job_prune(older_than=10, limit=10) == 0


def test_prune_deletes_a_pruned_jobs_signals_with_it(backend: Backend, harness: Harness) -> None:
    """A signal is kept with its job, and goes with it: PostgreSQL kept every pruned
    job's signals for ever (SQLite deleted them)."""
    job_id = insert(backend)
    backend.job_signal(job_id, "approved", '"yes"', "ops")
    [row] = claim(backend, limit=1)
    finish(backend, row, "completed")
    harness.backdate_finished(backend, job_id, 100)
    assert backend.signal_get(job_id, "approved") == '"yes"'
    assert backend.job_prune(older_than=10, limit=10) == 1
    assert backend.signal_get(job_id, "approved") is None
