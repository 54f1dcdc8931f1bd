"""Reading: one job, listings with filters and keyset pages, queue stats, the clock."""

from __future__ import annotations

import time

import pytest

from errands.backends import Backend
from errands.backends.base import ListParams
from errands.jobs import parse_cursor

from .conftest import Harness
from .support import claim_one, error, finish, get, insert, request


def test_job_get_of_an_unknown_id_returns_none(backend: Backend) -> None:
    """Asking for a job that does not exist gives None, not an error."""
    assert backend.job_get(424242) is None


def test_job_list_returns_newest_first(backend: Backend) -> None:
    """Listings are ordered by id, newest first."""
    ids = [insert(backend) for _ in range(4)]
    assert [r.id for r in backend.job_list(ListParams())] == ids[::-1]


def test_job_list_filters_by_state_queue_and_name(backend: Backend) -> None:
    """Each filter narrows the listing, and filters combine."""
    email = insert(backend, name="shop.email", queue="emails")
    charge = insert(backend, name="shop.charge", queue="payments")
    refund = insert(backend, name="shop.refund", queue="payments", delay=3600.0)
    assert [r.id for r in backend.job_list(ListParams(queue="payments"))] == [refund, charge]
    assert [r.id for r in backend.job_list(ListParams(name="shop.email"))] == [email]
    assert [r.id for r in backend.job_list(ListParams(state="scheduled"))] == [refund]
    both = ListParams(state="available", queue="payments")
    assert [r.id for r in backend.job_list(both)] == [charge]
    assert backend.job_list(ListParams(state="dead")) == []


def test_job_list_honours_the_limit(backend: Backend) -> None:
    """At most ``limit`` rows come back, the newest ones."""
    ids = [insert(backend) for _ in range(5)]
    assert [r.id for r in backend.job_list(ListParams(limit=2))] == ids[:-3:-1]


def test_job_list_pages_with_before_id_without_gaps_or_repeats(backend: Backend) -> None:
    """Walking pages with before_id = last id seen visits every job exactly once."""
    ids = [insert(backend) for _ in range(7)]
    seen: list[int] = []
    before: int | None = None
    while True:
        page = backend.job_list(ListParams(limit=3, before_id=before))
        if not page:
            break
        seen.extend(r.id for r in page)
        before = page[-1].id
    assert seen == ids[::-1]


def test_available_jobs_of_a_queue_are_listed_by_priority_and_due_time_across_pages(
    backend: Backend,
) -> None:
    """Available jobs of one queue come by priority, then due time, then id (a plain
    queue's claim order), each page after the previous page's last row's position: no
    gap or repeat when that row was claimed, failed and rescheduled meanwhile (its due
    time moved on, its position did not); other queues and states stay out."""
    low = [insert(backend, queue="emails", priority=0) for _ in range(3)]
    high = [insert(backend, queue="emails", priority=5) for _ in range(2)]
    middle = [insert(backend, queue="emails", priority=2) for _ in range(3)]
    insert(backend, queue="payments", priority=9)
    insert(backend, queue="emails", priority=9, delay=3600.0)  # scheduled: not available
    seen: list[int] = []
    after: tuple[int, float, int] | None = None
    while True:
        page = backend.job_list(ListParams(state="available", queue="emails", limit=2, after=after))
        if not page:
            break
        seen.extend(r.id for r in page)
        after = parse_cursor(page[-1].to_job().cursor)
        if len(seen) == 2:  # the page's rows are claimed; its last fails, due again later
            claimed = [claim_one(backend, "emails") for _ in range(2)]
            assert [r.id for r in claimed] == high
            assert finish(backend, claimed[1], "retryable", error=error(), delay=0.5)
    assert seen == high + middle + low
    names = ListParams(state="available", queue="emails", name="nosuch.job")
    assert backend.job_list(names) == []


@pytest.mark.parametrize("due", [None, -1_567_498_643.731115], ids=["now", "in 1920"])
def test_jobs_due_at_the_same_moment_page_one_by_one_without_repeats(
    backend: Backend, due: float | None
) -> None:
    """Jobs sharing one due time (a batch enqueued together), paged one a page, come once
    each in id order: the cursor keeps the due time to the stored microsecond, also for
    a time PostgreSQL's to_timestamp of the float would miss by one (1920)."""
    ids = [
        r.id for r in backend.job_insert_many([request(queue="q", run_at=due) for _ in range(4)])
    ]
    seen: list[int] = []
    after: tuple[int, float, int] | None = None
    for _ in range(6):
        page = backend.job_list(ListParams(state="available", queue="q", limit=1, after=after))
        if not page:
            break
        seen += [r.id for r in page]
        after = parse_cursor(page[-1].to_job().cursor)
    assert seen == ids


def test_queue_stats_counts_jobs_per_queue_and_state(backend: Backend) -> None:
    """Stats give one entry per queue with a count per state present."""
    for _ in range(3):
        insert(backend, queue="emails")
    insert(backend, queue="emails", delay=3600.0)
    insert(backend, queue="payments", priority=1)
    insert(backend, queue="payments")
    row = claim_one(backend, "payments")
    finish(backend, row, "completed")
    stats = {s.queue: s for s in backend.queue_stats()}
    assert set(stats) == {"emails", "payments"}
    assert stats["emails"].counts == {"available": 3, "scheduled": 1}
    assert stats["payments"].counts == {"available": 1, "completed": 1}


def test_queue_stats_reports_how_long_the_oldest_due_job_has_waited(
    backend: Backend, harness: Harness
) -> None:
    """oldest_available_age is the wait of the oldest due job, in seconds."""
    old = insert(backend, queue="emails")
    insert(backend, queue="emails")
    harness.backdate_run_at(backend, old, 120.0)
    (stats,) = backend.queue_stats()
    assert stats.oldest_available_age is not None
    assert 119.0 <= stats.oldest_available_age <= 125.0


def test_queue_stats_has_no_oldest_age_without_due_jobs(backend: Backend) -> None:
    """A queue with only future, running or finished jobs has no waiting age."""
    insert(backend, queue="emails", delay=3600.0)
    insert(backend, queue="emails")
    finish(backend, claim_one(backend, "emails"), "completed")
    (stats,) = backend.queue_stats()
    assert stats.counts == {"scheduled": 1, "completed": 1}
    assert stats.oldest_available_age is None


def test_queue_stats_of_an_empty_store_is_empty(backend: Backend) -> None:
    """No jobs, no queues."""
    assert backend.queue_stats() == []


def test_db_now_is_the_database_clock_in_epoch_seconds(backend: Backend) -> None:
    """db_now is unix epoch seconds and moves forward."""
    first = backend.db_now()
    assert first == pytest.approx(time.time(), abs=5.0)
    time.sleep(0.01)
    assert backend.db_now() > first


def test_job_row_converts_to_a_job_snapshot(backend: Backend) -> None:
    """A stored row decodes to a Job with parsed args, meta, state and times."""
    job_id = insert(backend, args_json='{"x":1}', meta={"sensitive": ["x"]})
    job = get(backend, job_id).to_job()
    assert job.args == {"x": 1} and job.masked_args == {"x": "***"}
    assert job.state == "available" and job.run_at.tzinfo is not None


def test_queue_stats_counts_running_jobs_whose_lease_expired_as_stalled(
    backend: Backend, harness: Harness
) -> None:
    """A running job past its lease (its worker is gone) shows as stalled until rescued."""
    gone = insert(backend)
    claim_one(backend)
    insert(backend)
    claim_one(backend)
    (before,) = backend.queue_stats()
    assert before.stalled == 0
    harness.expire_lease(backend, gone)
    (after,) = backend.queue_stats()
    assert after.stalled == 1
    assert after.counts["running"] == 2
