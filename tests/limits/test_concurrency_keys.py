"""Per-key concurrency: ``@app.job(concurrency_key="account:{account_id}",
concurrency_limit=1)`` (item 3).

At most N jobs with the same key run at once across the cluster; jobs of other keys run
beside them; a job waiting for its key stays pending and burns no attempt.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import pytest

import errands
from errands.backends.base import QueueClaim
from errands.errors import ConfigurationError

from .helpers import Intervals, wait_until, workers

JOBS = 200
KEYS = 10


def test_per_key_limit_of_one_never_overlaps_within_a_key_but_keys_run_in_parallel(
    store: errands.App,
) -> None:
    """Given 200 jobs over 10 accounts with a per-key limit of 1, and two workers of 10
    slots each, then no two jobs of one account ever ran at once, jobs of different
    accounts did (the peak across keys is above 1), and every job ran exactly once."""
    runs = Intervals()

    @store.job(name="accounts.sync", concurrency_key="account:{account_id}", concurrency_limit=1)
    def sync_account(account_id: int, n: int) -> None:
        with runs.run(f"account:{account_id}"):
            time.sleep(0.03)

    rng = random.Random(5)
    store.enqueue_many(
        [sync_account.bind(account_id=rng.randrange(KEYS), n=i) for i in range(JOBS)]
    )
    peer = errands.App(store.url, lease=2)
    peer.job(name="accounts.sync", concurrency_key="account:{account_id}")(sync_account.fn)
    try:
        with workers([store, peer], concurrency=10):
            wait_until(
                lambda: len(store.jobs(state="completed", limit=JOBS)) == JOBS,
                60,
                f"{JOBS} completed jobs",
            )
    finally:
        peer.close()

    per_key = runs.peak_by_label()
    assert len(per_key) == KEYS
    assert set(per_key.values()) == {1}, per_key
    assert runs.peak() > 1
    jobs = store.jobs(limit=JOBS)
    assert {j.attempt for j in jobs} == {1}, "waiting for a key must not burn attempts"
    assert len(runs.runs) == JOBS


def test_per_key_limit_above_one_allows_that_many_and_keys_are_shared_across_job_types(
    store: errands.App,
) -> None:
    """Two job types with the same key template share the key's limit of 2."""
    runs = Intervals()

    @store.job(name="acct.a", concurrency_key="acct:{account_id}", concurrency_limit=2)
    def a(account_id: int, n: int) -> None:
        with runs.run(f"acct:{account_id}"):
            time.sleep(0.05)

    @store.job(name="acct.b", concurrency_key="acct:{account_id}", concurrency_limit=2)
    def b(account_id: int, n: int) -> None:
        with runs.run(f"acct:{account_id}"):
            time.sleep(0.05)

    store.enqueue_many([(a if i % 2 else b).bind(account_id=7, n=i) for i in range(16)])
    with workers([store], concurrency=8):
        wait_until(lambda: len(store.jobs(state="completed", limit=50)) == 16, 30, "16 jobs")
    assert runs.peak_by_label() == {"acct:7": 2}


def test_bad_concurrency_key_options_fail_at_definition(tmp_path: Path) -> None:
    app = errands.App(f"sqlite:///{tmp_path}/errands.db")
    with pytest.raises(ConfigurationError, match="names \\['acount_id'\\], which are not"):

        @app.job(name="typo", concurrency_key="account:{acount_id}")
        def typo(account_id: int) -> None: ...

    with pytest.raises(ConfigurationError, match="needs a concurrency_key"):

        @app.job(name="no_key", concurrency_limit=2)
        def no_key(account_id: int) -> None: ...

    with pytest.raises(ConfigurationError, match="concurrency_limit=0: give an int from 1"):

        @app.job(name="zero", concurrency_key="account:{account_id}", concurrency_limit=0)
        def zero(account_id: int) -> None: ...

    assert app.registry == {}


@pytest.mark.parametrize("limit", [2**31, 2**40, 2**63, True, 1.0, "2"])
def test_a_concurrency_limit_beyond_what_the_store_holds_or_not_an_int_fails_at_definition(
    store: errands.App, limit: object
) -> None:
    """concurrency_limit=2**40 was accepted, then every enqueue failed on PostgreSQL
    (NumericValueOutOfRange) and 2**63 on SQLite (OverflowError); True ran as 1. It is
    checked as app.queue(limit=) is: an int from 1 to 2,147,483,647."""
    with pytest.raises(
        ConfigurationError, match=r"concurrency_limit=.*: give an int from 1 to 2,147,483,647"
    ):

        @store.job(name="too_many", concurrency_key="account:{a}", concurrency_limit=limit)  # type: ignore[arg-type]
        def too_many(a: int) -> None: ...

    assert "too_many" not in store.registry


def test_the_largest_concurrency_limit_is_stored_and_claimed_on_every_backend(
    store: errands.App,
) -> None:
    """The maximum, 2**31 - 1, goes through enqueue and claim on both stores."""

    @store.job(name="wide", concurrency_key="account:{a}", concurrency_limit=2**31 - 1)
    def wide(a: int) -> None: ...

    store.enqueue_many([wide.bind(a=1) for _ in range(3)])
    rows = store.backend.job_claim_limited(QueueClaim("default", 10), "w-test", 30.0)
    assert len(rows) == 3


def test_a_concurrency_limit_lowered_by_a_deploy_holds_the_jobs_enqueued_before_it(
    store: errands.App,
) -> None:
    """Given 12 jobs of account 7 enqueued by a deploy whose limit was 3 and a worker of the
    next deploy, which lowered it to 1, then no two of them run at once: the claim holds
    each row to the lower of its stored limit and the worker's own. Each row kept its own
    limit, and the new deploy ran 3 at once until the old backlog drained."""
    runs = Intervals()

    @store.job(name="accounts.sync", concurrency_key="account:{a}", concurrency_limit=3)
    def sync_v1(a: int, n: int) -> None: ...

    store.enqueue_many([sync_v1.bind(a=7, n=i) for i in range(12)])
    deployed = errands.App(store.url, lease=2)

    @deployed.job(name="accounts.sync", concurrency_key="account:{a}", concurrency_limit=1)
    def sync_v2(a: int, n: int) -> None:
        with runs.run(f"account:{a}"):
            time.sleep(0.05)

    try:
        with workers([deployed], concurrency=6):
            wait_until(lambda: len(store.jobs(state="completed", limit=20)) == 12, 60, "12 jobs")
    finally:
        deployed.close()
    assert runs.peak_by_label() == {"account:7": 1}


def test_a_concurrency_limit_raised_by_a_deploy_applies_to_jobs_enqueued_with_it(
    store: errands.App,
) -> None:
    """The other way: rows enqueued with limit 1 keep it under a worker whose code says 3
    (a row never runs past the limit it was enqueued with); rows enqueued by the new code
    run 3 at once."""
    runs = Intervals()

    @store.job(name="accounts.sync", concurrency_key="account:{a}", concurrency_limit=1)
    def sync_v1(a: int, n: int) -> None: ...

    store.enqueue_many([sync_v1.bind(a=1, n=i) for i in range(8)])
    deployed = errands.App(store.url, lease=2)

    @deployed.job(name="accounts.sync", concurrency_key="account:{a}", concurrency_limit=3)
    def sync_v2(a: int, n: int) -> None:
        with runs.run(f"account:{a}"):
            time.sleep(0.1)

    deployed.enqueue_many([sync_v2.bind(a=2, n=i) for i in range(9)])
    try:
        with workers([deployed], concurrency=6):
            wait_until(lambda: len(store.jobs(state="completed", limit=20)) == 17, 60, "17 jobs")
    finally:
        deployed.close()
    peaks = runs.peak_by_label()
    assert peaks["account:1"] == 1 and peaks["account:2"] >= 2, peaks


def test_a_long_run_of_jobs_waiting_for_a_busy_key_does_not_hold_back_other_keys(
    store: errands.App,
) -> None:
    """Given 150 jobs of one account queued first, one of them running (limit 1), and a
    job of another account behind them, then a claim takes the other account's job: jobs
    waiting for a busy key never fill the claim's lookahead (100 rows)."""

    @store.job(name="accounts.sync", concurrency_key="account:{account_id}", concurrency_limit=1)
    def sync_account(account_id: int, n: int) -> None: ...

    store.enqueue_many([sync_account.bind(account_id=1, n=i) for i in range(150)])
    behind = sync_account.enqueue(account_id=2, n=150)
    backend = store.backend
    backend.queue_declare(store.queues.get("default") or _keyed("default"), "test")
    claim = QueueClaim("default", 1)
    [first] = backend.job_claim_limited(claim, "w-test", 30.0)
    assert first.id != behind.id  # account 1's first job, now running
    [second] = backend.job_claim_limited(claim, "w-test", 30.0)
    assert second.id == behind.id
    assert backend.job_claim_limited(claim, "w-test", 30.0) == []  # both keys busy now


def test_a_claim_fills_its_room_past_a_lookahead_of_one_free_keys_jobs(
    store: errands.App,
) -> None:
    """Given 150 jobs of one free account queued first (limit 1), then jobs of 20 other
    accounts and 20 without a key, then one claim with 10 free slots takes 10: one job of
    the first account and nine behind them. It took one: the lookahead (100 rows) held
    only the first account's jobs, and the others waited a poll interval at a time."""

    @store.job(name="accounts.sync", concurrency_key="account:{a}", concurrency_limit=1)
    def sync(a: int, n: int) -> None: ...

    @store.job(name="accounts.plain")
    def plain(n: int) -> None: ...

    store.enqueue_many([sync.bind(a=1, n=i) for i in range(150)])
    store.enqueue_many([sync.bind(a=100 + i, n=0) for i in range(20)])
    store.enqueue_many([plain.bind(n=i) for i in range(20)])
    backend = store.backend
    backend.queue_declare(store.queues.get("default") or _keyed("default"), "test")
    rows = backend.job_claim_limited(QueueClaim("default", 10), "w-test", 30.0)
    assert len(rows) == 10
    keys = [json.loads(r.args).get("a") for r in rows]
    assert keys.count(1) == 1 and len(set(keys)) == 10  # one per account, none twice


def test_a_keys_backlog_ahead_of_other_jobs_runs_without_waiting_for_polls(
    store: errands.App,
) -> None:
    """Given 300 jobs of one account (limit 1) queued ahead of 20 plain jobs, and a worker
    polling every 2 minutes, then the plain jobs and a run of the account's jobs finish well
    within one poll interval: a claim fills its room past the account's jobs, and a
    keyed job ending wakes the claim loop for the next one (on PostgreSQL the plain jobs
    ran none in 30 s, and the account's backlog one job per poll). The poll interval is
    two minutes, the waits well under it: a loaded machine has room."""
    done: list[str] = []

    @store.job(name="accounts.busy", concurrency_key="account:{a}", concurrency_limit=1)
    def busy(a: int, n: int) -> None:
        done.append("keyed")

    @store.job(name="accounts.other")
    def other(n: int) -> None:
        done.append("plain")

    store.enqueue_many([busy.bind(a=1, n=i) for i in range(300)])
    store.enqueue_many([other.bind(n=i) for i in range(20)])
    with workers([store], concurrency=4, poll_interval=120.0):
        wait_until(lambda: done.count("plain") == 20, 90, "the plain jobs behind the key's")
        wait_until(lambda: done.count("keyed") >= 10, 90, "a run of the key's own jobs")


def _keyed(name: str) -> Any:
    from errands.backends.base import QueueSettings

    return QueueSettings(name, jobs_declare_limits=True)


def test_a_keyed_job_is_not_held_back_by_a_backlog_of_plain_jobs_enqueued_before_it(
    store: errands.App,
) -> None:
    """Given a worker whose plain queue has a backlog that keeps every slot busy, and one
    keyed job (a limited queue) enqueued after it, then the keyed job starts while most of
    the backlog still waits: each claim round turns which path goes first, so the plain
    claim does not take every free slot of every round (it did: limited queues waited for
    the plain backlog to drain, minutes in the PostgreSQL chaos soak)."""
    backlog = 400
    started: list[str] = []

    @store.job(name="bulk.item", queue="bulk")
    def item(n: int) -> None:
        started.append("bulk")
        time.sleep(0.002)

    @store.job(
        name="accounts.sync", queue="accounts", concurrency_key="account:{a}", concurrency_limit=1
    )
    def sync(a: int) -> None:
        started.append("keyed")

    store.enqueue_many([item.bind(n=n) for n in range(backlog)])
    handle = sync.enqueue(a=1)
    with workers([store], concurrency=2, queues=["bulk", "accounts"]):
        handle.result(timeout=60)
        ahead = started.index("keyed")
        wait_until(lambda: len(started) == backlog + 1, 60, "the backlog drained")
    assert ahead < backlog // 2, f"the keyed job started after {ahead} of {backlog} bulk jobs"


def test_a_starting_worker_keeps_what_another_deployment_stored_for_a_keyed_queue_it_leaves_open(
    store: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a worker whose code has a keyed job type in queue "accounts" but declares no
    settings for it (no ``app.queue``), when another deployment stores the queue's limits,
    and an operator pauses it, after this worker read the queue's settings at its start
    and before it wrote them, then both survive: the worker turns the queue's keyed flag
    on and writes nothing else. It wrote back what it had read, putting max_running,
    fairness and aging back to the stale values."""
    from errands.backends.base import QueueSettings

    @store.job(name="accounts.sync", queue="accounts", concurrency_key="account:{account}")
    def sync(account: int) -> None: ...

    backend = store.backend
    read_at_start = backend.queue_settings()  # nothing stored for "accounts" yet
    declared = QueueSettings("accounts", max_running=2, fair=True, aging=60.0)
    backend.queue_declare(declared, "worker:another-deployment")
    store.pause("accounts", actor="ops:dana")
    settings_now = type(backend).queue_settings.__get__(backend)  # around the stale read
    monkeypatch.setattr(backend, "queue_settings", lambda: read_at_start)

    with workers([store]):
        wait_until(
            lambda: [s.jobs_declare_limits for s in settings_now()] == [True],
            10,
            "the worker's declaration of its keyed queue",
        )
    [stored] = settings_now()
    assert (stored.max_running, stored.fair, stored.aging, stored.paused) == (2, True, 60.0, True)
