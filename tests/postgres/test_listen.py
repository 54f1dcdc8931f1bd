"""LISTEN/NOTIFY wake-ups on PostgreSQL (DESIGN §8): an idle worker starts a new job
within milliseconds, not one poll interval later; the notifier's self-test passes on a
direct connection; ``listen=false`` in the URL turns wake-ups off (polling alone)."""

from __future__ import annotations

import pgacc_basic
import pytest

from errands.backends.postgres.backend import PostgresBackend
from tests.pg import with_params

from .harness import PgCluster, wait_until

pytestmark = pytest.mark.acceptance

IDLE_POLL = "5"  # seconds: without a notification a job would wait up to this long


def _listening(pgc: PgCluster) -> bool:
    """A worker session has LISTENed and sent its self-test NOTIFY (its last statement)."""
    return bool(
        pgc.query(
            "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = %s AND query ILIKE 'SELECT pg_notify(%%'",
            (pgc.tag,),
        )
    )


def test_idle_worker_picks_up_a_new_job_well_under_its_poll_interval(pgc: PgCluster) -> None:
    """Given an idle worker polling every 5 s, each new job starts within 1 s of its
    enqueue (in practice milliseconds): the enqueue's NOTIFY woke the worker."""
    pgc.app()
    pgc.start_worker(flags=("--poll-interval", IDLE_POLL, "--maintenance-tick", "0.2"))
    wait_until(lambda: _listening(pgc), 15, "the worker to LISTEN")
    pickups = []
    for n in range(5):
        handle = pgacc_basic.touch.enqueue(n=n)
        wait_until(lambda h=handle: h.status() == "completed", 10, f"job {n} to complete")
        ((pickup,),) = pgc.query(
            "SELECT extract(epoch FROM attempted_at - inserted_at)::float8 "
            "FROM {s}.errands_jobs WHERE id = %s",
            (handle.id,),
        )
        pickups.append(pickup)
    assert max(pickups) < 1.0, pickups
    print(f"idle pickup with notifications: {[round(p * 1000, 1) for p in pickups]} ms")


def test_notifier_self_test_passes_and_it_hears_an_enqueue(pgc: PgCluster) -> None:
    """The LISTEN connection's startup self-test (NOTIFY to itself) passes on a direct
    connection, and an enqueue from another process's pool reaches it with its queue."""
    app = pgc.app()
    app.queue_stats()  # migrate first
    heard: list[str] = []
    notifier = app.backend.listener(heard.append)
    notifier.start()
    try:
        wait_until(lambda: notifier.self_test_passed is True, 10, "the self-test to pass")
        pgacc_basic.touch.enqueue(n=1)
        wait_until(lambda: "default" in heard, 5, "the enqueue's notification")
    finally:
        notifier.stop()
    assert notifier.self_test_passed is True


def test_listen_false_turns_wakeups_off_and_the_worker_still_polls(pgc: PgCluster) -> None:
    """With listen=false in the URL no LISTEN connection is opened (e.g. behind PgBouncer
    in transaction mode) and polling alone still runs every job."""
    url = with_params(pgc.url, listen="false")
    backend = PostgresBackend(url)
    try:
        assert backend.listener(lambda queue: None) is None
    finally:
        backend.close()

    pgc.app()
    worker_url = with_params(pgc.worker_url, listen="false")
    pgc.start_worker(flags=("--poll-interval", "0.2"), ERRANDS_URL=worker_url)
    handle = pgacc_basic.touch.enqueue(n=3)
    wait_until(lambda: handle.status() == "completed", 15, "the job to complete by polling")
    assert not _listening(pgc)


def test_a_woken_worker_looks_again_just_past_the_notify_window(pg_url: str) -> None:
    """A job enqueued within notify_window after a notified one sends no NOTIFY: the
    worker woken by the first looks once more the window plus 5 ms later (it was a flat
    20 ms, four times the default window of 5 ms: now 10 ms there)."""
    import threading

    import errands

    for window, recheck in (("0.02", 0.025), ("0.05", 0.055)):
        app = errands.App(with_params(pg_url, notify_window=window))
        try:
            worker = app.worker(concurrency=1, poll_interval=0.05)
            assert worker.recheck_after_notify == pytest.approx(0.01)  # until it starts
            thread = threading.Thread(target=worker.run, kwargs={"install_signals": False})
            thread.start()
            try:
                wait_until(
                    lambda w=worker: w.recheck_after_notify != pytest.approx(0.01),
                    timeout=30,
                    what="the worker started",
                )
                assert worker.recheck_after_notify == pytest.approx(recheck)
            finally:
                worker.stop()
                thread.join(30)
        finally:
            app.close()
