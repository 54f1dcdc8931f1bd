"""Idempotency keys on enqueue: ``key=``, ``unique_for=``, retention, concurrent callers.

On SQLite and PostgreSQL. Time passes on the test clock (``tester.clock.advance``), which
moves the stored times the database compares with its own ``now()``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

import errands
from errands.maintenance import Maintenance
from errands.testing import Tester

Make = Callable[..., Any]


def _welcome_app(make_app: Make, **options: Any) -> tuple[errands.App, Any]:
    app = make_app(**options)

    @app.job(name="welcome", retries=0)
    def welcome(user_id: int) -> None: ...

    return app, welcome


def test_unique_for_deduplicates_within_the_period_and_forgets_the_key_after_it(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    app, welcome = _welcome_app(make_app)
    tester = errands_testing(app)
    period = timedelta(minutes=10)

    first = welcome.enqueue(user_id=1, key="welcome:1", unique_for=period)
    assert first.deduplicated is False
    tester.clock.advance(timedelta(minutes=9))
    again = welcome.enqueue(user_id=1, key="welcome:1", unique_for=period)
    assert (again.id, again.deduplicated) == (first.id, True)

    tester.clock.advance(timedelta(minutes=1, seconds=1))  # the period is over
    later = welcome.enqueue(user_id=1, key="welcome:1", unique_for=period)
    assert later.deduplicated is False
    assert later.id != first.id
    old = first.job()
    assert old.idempotency_key is None  # released, and remembered in meta
    assert old.meta["expired_key"] == "welcome:1"
    assert later.job().idempotency_key == "welcome:1"
    # The first job still exists and still runs: unique_for only frees the key.
    assert {j.id for j in tester.all_enqueued(welcome)} == {first.id, later.id}


def test_a_batch_releases_the_keys_whose_period_is_over_and_deduplicates_the_others(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    """In one enqueue_many: a key whose unique_for period is over is released and taken
    by a new job, a key still within its period returns its job, a new key makes one."""
    app, welcome = _welcome_app(make_app)
    tester = errands_testing(app)
    period = timedelta(minutes=10)
    old = welcome.enqueue(user_id=1, key="welcome:1", unique_for=period)
    tester.clock.advance(timedelta(minutes=8))
    held = welcome.enqueue(user_id=2, key="welcome:2", unique_for=period)
    tester.clock.advance(timedelta(minutes=3))  # welcome:1's period is over, not welcome:2's

    again, same, new = app.enqueue_many(
        [
            welcome.bind(user_id=1, key="welcome:1", unique_for=period),
            welcome.bind(user_id=2, key="welcome:2", unique_for=period),
            welcome.bind(user_id=3, key="welcome:3", unique_for=period),
        ]
    )
    assert (again.deduplicated, same.deduplicated, new.deduplicated) == (False, True, False)
    assert again.id != old.id and same.id == held.id
    assert old.job().idempotency_key is None and old.job().meta["expired_key"] == "welcome:1"
    assert again.job().idempotency_key == "welcome:1"
    assert new.job().idempotency_key == "welcome:3"


def test_a_batch_naming_a_key_twice_gets_one_job_for_it_whether_released_held_or_new(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    """Each key twice in one enqueue_many: a released key (its period over) is taken by
    one new job, the second naming returning it; a held key returns its holder both
    times; a new key makes one job. The handles keep the batch's order."""
    app, welcome = _welcome_app(make_app)
    tester = errands_testing(app)
    period = timedelta(minutes=10)
    old = welcome.enqueue(user_id=1, key="welcome:1", unique_for=period)
    tester.clock.advance(timedelta(minutes=8))
    held = welcome.enqueue(user_id=2, key="welcome:2", unique_for=period)
    tester.clock.advance(timedelta(minutes=3))  # welcome:1's period is over, not welcome:2's

    keys = ["welcome:3", "welcome:1", "welcome:2", None, "welcome:1", "welcome:3", "welcome:2"]
    handles = app.enqueue_many(
        [welcome.bind(user_id=n, key=key, unique_for=period) if key else welcome.bind(user_id=n)
         for n, key in enumerate(keys)]
    )  # fmt: skip
    new, again, same, plain, again2, new2, same2 = handles
    assert [h.deduplicated for h in handles] == [False, False, True, False, True, True, True]
    assert (again2.id, new2.id) == (again.id, new.id)
    assert same.id == same2.id == held.id and again.id != old.id
    assert len({new.id, again.id, held.id, plain.id, old.id}) == 5
    assert old.job().idempotency_key is None and old.job().meta["expired_key"] == "welcome:1"
    assert (again.job().args, new.job().args) == ({"user_id": 1}, {"user_id": 0})
    assert len(tester.all_enqueued(welcome)) == 5


def test_unique_for_declared_on_the_job_applies_to_every_keyed_enqueue(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    app = make_app()

    @app.job(name="digest", retries=0, unique_for=60)
    def digest(account: int) -> None: ...

    tester = errands_testing(app)
    first = digest.enqueue(account=3, key="digest:3")
    assert digest.enqueue(account=3, key="digest:3").deduplicated
    tester.clock.advance(61)
    assert not digest.enqueue(account=3, key="digest:3").deduplicated
    assert len(tester.all_enqueued(digest, account=3)) == 2
    assert first.status() is errands.JobState.AVAILABLE

    with pytest.raises(errands.ConfigurationError, match="unique_for= applies to a key"):
        digest.enqueue(account=4)


def test_a_key_without_unique_for_holds_while_the_row_exists_and_is_freed_by_pruning(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    app, welcome = _welcome_app(make_app, retention=timedelta(hours=1))
    tester = errands_testing(app)
    first = welcome.enqueue(user_id=2, key="welcome:2")
    assert tester.drain().completed == 1

    tester.clock.advance(timedelta(minutes=59))
    assert welcome.enqueue(user_id=2, key="welcome:2").deduplicated  # completed, still kept
    tester.clock.advance(timedelta(minutes=2))
    assert Maintenance(app, "test").prune() == 1  # retention over: the row is deleted
    again = welcome.enqueue(user_id=2, key="welcome:2")
    assert again.deduplicated is False
    assert again.id != first.id


def test_pruning_frees_a_key_before_its_unique_for_period_ends(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    """unique_for cannot outlast the row: keep retention at least as long as unique_for."""
    app, welcome = _welcome_app(make_app, retention=timedelta(hours=1))
    tester = errands_testing(app)
    welcome.enqueue(user_id=3, key="welcome:3", unique_for=timedelta(days=30))
    tester.drain()

    tester.clock.advance(timedelta(hours=2))
    assert Maintenance(app, "test").prune() == 1
    assert not welcome.enqueue(
        user_id=3, key="welcome:3", unique_for=timedelta(days=30)
    ).deduplicated


def test_a_dead_job_keeps_its_key_until_unique_for_ends(
    make_app: Make, errands_testing: Callable[..., Tester]
) -> None:
    app = make_app(retention=timedelta(minutes=1))

    @app.job(name="flaky", retries=0)
    def flaky(n: int) -> None:
        raise errands.Permanent("no")

    tester = errands_testing(app)
    first = flaky.enqueue(n=1, key="flaky:1")
    keyed = flaky.enqueue(n=1, key="flaky:1b", unique_for=timedelta(hours=1))
    tester.drain()
    tester.clock.advance(timedelta(minutes=30))
    assert Maintenance(app, "test").prune() == 0  # dead rows are never pruned
    assert flaky.enqueue(n=1, key="flaky:1").id == first.id
    assert flaky.enqueue(n=1, key="flaky:1b", unique_for=timedelta(hours=1)).id == keyed.id
    tester.clock.advance(timedelta(minutes=31))
    assert not flaky.enqueue(n=1, key="flaky:1b", unique_for=timedelta(hours=1)).deduplicated
    assert flaky.enqueue(n=1, key="flaky:1").deduplicated  # no unique_for: held while dead


def test_sixteen_threads_enqueueing_one_key_get_one_job_and_fifteen_deduplicated_handles(
    make_app: Make,
) -> None:
    app, welcome = _welcome_app(make_app)
    app.migrate()
    callers = 16
    start = threading.Barrier(callers)
    handles: list[errands.JobHandle] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def enqueue() -> None:
        try:
            start.wait(10)
            handle = welcome.enqueue(user_id=16, key="welcome:16")
            with lock:
                handles.append(handle)
        except BaseException as exc:
            with lock:
                errors.append(exc)

    threads = [threading.Thread(target=enqueue) for _ in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    assert errors == []
    assert len(handles) == callers
    assert len({h.id for h in handles}) == 1
    assert sorted(h.deduplicated for h in handles) == [False] + [True] * (callers - 1)
    assert [j.id for j in app.jobs(name="welcome")] == [handles[0].id]
