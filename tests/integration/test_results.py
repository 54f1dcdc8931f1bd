"""Results without polling, with a real worker: a waiter is woken by the commit of its
job's outcome (SQLite: commit detection; PostgreSQL: LISTEN/NOTIFY), many waiters share
one watcher (one LISTEN connection on PostgreSQL), polling remains the fallback
(``listen=false``), and ``wait_all`` / ``as_completed`` wait on many jobs."""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from datetime import timedelta
from fractions import Fraction
from typing import Annotated, Any

import pytest
from pydantic import AfterValidator

import errands
from tests.conftest import cancel_while_inserting, running_worker

from .helpers import results_app

# Far longer than any test here may take: a wait that ends sooner was woken, not polled.
NO_POLL = 30.0


class _LoopGate:
    """A return type's validator that blocks until the event loop has ticked (or gives
    up after ``GIVE_UP`` s): armed, it records whether the loop ran while it waited."""

    GIVE_UP = 10.0
    armed = threading.Event()
    ticked = threading.Event()
    saw: list[bool] = []  # one test's record, reset by it

    @classmethod
    def validate(cls, value: int) -> int:
        if cls.armed.is_set():
            cls.saw.append(cls.ticked.wait(cls.GIVE_UP))
        return value


WaitsForTheLoop = Annotated[int, AfterValidator(_LoopGate.validate)]


def test_result_is_woken_by_the_completion_not_by_polling(store: errands.App) -> None:
    """With polling all but off (poll=30 s), result() returns within a moment of the job
    ending: the store woke the waiter."""
    add, nap = store.registry["results.add"], store.registry["results.nap"]
    assert store.results.ready(), "the store's watcher never started listening"
    with running_worker(store, concurrency=2):
        handle = nap.enqueue(seconds=0.3)
        started = time.monotonic()
        assert handle.result(timeout=20, poll=NO_POLL) == 0.3
        assert time.monotonic() - started < 5
        assert add.enqueue(a=2, b=3).result(timeout=20, poll=NO_POLL) == 5
    assert store.results.wakeups >= 1
    assert store.results.waiting() == 0  # every registration removed


def test_aresult_is_woken_by_the_completion(store: errands.App) -> None:
    """The async waiter is woken the same way, and gets the same errors."""
    nap, fail = store.registry["results.nap"], store.registry["results.fail"]

    async def scenario() -> None:
        handle = await nap.aenqueue(seconds=0.2)
        assert await handle.aresult(timeout=20, poll=NO_POLL) == 0.2
        with pytest.raises(errands.JobFailed, match="RuntimeError: no"):
            await (await fail.aenqueue()).aresult(timeout=20, poll=NO_POLL)

    with running_worker(store, concurrency=2):
        started = time.monotonic()
        asyncio.run(scenario())
        assert time.monotonic() - started < 10


def test_aresult_decodes_the_result_off_the_event_loop(app: errands.App) -> None:
    """The return type's validators (user code, maybe slow) run when aresult() decodes
    the result: off the event loop, so other coroutines keep running meanwhile. Here the
    validator waits until a ticker coroutine has ticked five times; decoded on the loop,
    the ticker could not tick and the validator gave up after 10 s."""

    @app.job(name="results.gated")
    def gated() -> WaitsForTheLoop:
        return 7

    handle = gated.enqueue()
    with running_worker(app, concurrency=1):
        errands.wait_all([handle], timeout=20)  # ended: nothing decoded yet
    _LoopGate.saw.clear()
    _LoopGate.ticked.clear()
    _LoopGate.armed.set()

    async def scenario() -> Any:
        async def ticker() -> None:
            for _ in range(5):
                await asyncio.sleep(0.01)
            _LoopGate.ticked.set()

        ticking = asyncio.create_task(ticker())
        try:
            return await handle.aresult(timeout=30, poll=NO_POLL)
        finally:
            ticking.cancel()

    try:
        assert asyncio.run(scenario()) == 7
    finally:
        _LoopGate.armed.clear()
    assert _LoopGate.saw == [True], "the validator blocked the event loop"


def test_many_waiters_share_one_watcher(store: errands.App) -> None:
    """Fifty threads and fifty tasks wait at once; all are woken, and the process holds
    one watcher (on PostgreSQL: one LISTEN connection) for all of them."""
    nap = store.registry["results.nap"]
    postgres = store.url.startswith("postgresql")
    handles = [nap.enqueue(seconds=0.01) for _ in range(100)]
    results: list[Any] = []
    threads = [
        threading.Thread(target=lambda h=h: results.append(h.result(timeout=30, poll=NO_POLL)))
        for h in handles[:50]
    ]

    async def tasks() -> list[Any]:
        return await asyncio.gather(*(h.aresult(timeout=30, poll=NO_POLL) for h in handles[50:]))

    for thread in threads:
        thread.start()
    with running_worker(store, concurrency=4):
        results.extend(asyncio.run(tasks()))
        for thread in threads:
            thread.join(timeout=30)
    assert len(results) == 100
    assert store.results._watcher is not None
    if postgres:
        listening = _listen_connections(store)
        assert listening == 1, f"{listening} LISTEN connections for the waiters"


def _listen_connections(app: errands.App) -> int:
    import psycopg

    with psycopg.connect(app.backend.config.conninfo, autocommit=True) as conn:  # type: ignore[attr-defined]
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
            (f"errands-results:{os.getpid()}",),
        ).fetchone()
    return int(row[0]) if row else 0


def test_wait_all_and_as_completed_follow_the_jobs_as_they_end(store: errands.App) -> None:
    """as_completed yields the quick job before the slow one; wait_all returns every
    handle once all have ended, dead ones included."""
    nap, fail = store.registry["results.nap"], store.registry["results.fail"]
    slow, quick = nap.enqueue(seconds=1.0), nap.enqueue(seconds=0.05)
    dead = fail.enqueue()
    with running_worker(store, concurrency=3):
        order = [h.id for h in errands.as_completed([slow, quick], timeout=20, poll=NO_POLL)]
        assert order == [quick.id, slow.id]
        assert errands.wait_all([slow, quick, dead], timeout=20) == [slow, quick, dead]
    with pytest.raises(errands.JobFailed):
        dead.result(timeout=1)


def test_wait_all_raises_result_timeout_for_jobs_that_do_not_end(store: errands.App) -> None:
    """No worker runs: wait_all gives up at its timeout with ResultTimeout."""
    add = store.registry["results.add"]
    with pytest.raises(errands.ResultTimeout, match="still not finished"):
        errands.wait_all([add.enqueue(a=1, b=1)], timeout=0.3)


def test_with_listen_false_waiters_fall_back_to_polling(pg_url: str) -> None:
    """Behind PgBouncer (listen=false) nothing is pushed: result() polls and still
    returns the result."""
    app = results_app(pg_url + "&listen=false")
    try:
        assert not app.results.ready(wait=0.1)
        with running_worker(app):
            assert app.registry["results.add"].enqueue(a=1, b=2).result(timeout=20) == 3
    finally:
        app.close()


def test_a_result_timeout_is_honoured_while_the_watcher_is_not_listening(
    app: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's watcher down (PostgreSQL's LISTEN connection reconnecting): each
    result() waited 2 s for it before its own timeout even began (timeout=0.2 took 2.2 s).
    The timeout runs from the call now, and only the first call waits for the watcher."""

    class Deaf:
        listening = threading.Event()  # never set
        self_test_passed = None

    monkeypatch.setattr(app.results, "_start", lambda: Deaf())

    @app.job(name="results.never_run")
    def never_run() -> None: ...

    handle = never_run.enqueue(delay=3600)
    for _ in range(2):
        started = time.monotonic()
        with pytest.raises(errands.ResultTimeout):
            handle.result(timeout=0.2)
        assert time.monotonic() - started < 1.8  # within the timeout, not 2 s after it


def test_wait_all_reads_its_pending_jobs_in_chunks_not_one_by_one(
    app: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each wake of wait_all read every pending handle with a query of its own (1,000
    jobs: 95,000 reads). It reads them in chunks now: a pass over 300 jobs is one read."""

    @app.job(name="results.many")
    def many(n: int) -> None: ...

    handles = app.enqueue_many(many.bind(n=n) for n in range(300))
    single: list[int] = []
    real_get = app.backend.job_get
    monkeypatch.setattr(app.backend, "job_get", lambda i: single.append(i) or real_get(i))
    with pytest.raises(errands.ResultTimeout):
        errands.wait_all(handles, timeout=0.3, poll=0.05)
    assert single == []  # no job read on its own


def test_wait_all_woken_by_the_store_reads_only_the_jobs_that_ended(app: errands.App) -> None:
    """Each wake of wait_all read every job still pending, though the hub hands it the
    rows of those that ended: N jobs ending a few at a time made O(N^2) rows read. Now a
    pushed wake reads nothing more; only the first look (and a poll or a safety recheck,
    or a wake that brought no rows) reads every pending job."""

    @app.job(name="results.ending")
    def ending(n: int) -> int:
        return n

    handles = app.enqueue_many(ending.bind(n=n) for n in range(300))
    waiter_thread = threading.get_ident()
    read_here: list[int] = []
    real_get_many = app.backend.job_get_many

    def counted(ids: list[int]) -> Any:
        if threading.get_ident() == waiter_thread:
            read_here.append(len(ids))
        return real_get_many(ids)

    app.backend.job_get_many = counted  # type: ignore[method-assign]
    assert app.results.ready()  # the store pushes (SQLite: its data_version watcher)
    with running_worker(app, concurrency=2, prefetch=0):
        errands.wait_all(handles, timeout=30)
    assert app.results.wakeups > 5  # woken as the jobs ended, many times
    # the first look (300); every later row came with its wake (reading every pending job
    # on each wake read 7,500 here)
    assert sum(read_here) < 600


def test_as_completed_rereads_every_job_at_the_safety_recheck_while_other_ends_wake_it(
    app: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job whose end never woke the waiter (a notification lost) is found by the
    safety recheck, also while the ends of other jobs keep waking the waiter: the recheck
    ran only after a wait that timed out, so a steady stream of wakes put it off until
    every other job had ended."""
    import errands.results as results

    monkeypatch.setattr(results, "SAFETY_RECHECK", 0.3)

    @app.job(name="results.steady")
    def steady(n: int) -> int:
        time.sleep(0.1)
        return n

    lost = steady.enqueue(n=-1)  # runs first; its end's wake-up is lost
    others = [steady.enqueue(n=n) for n in range(30)]  # then one ends every 0.1 s
    hub = app.results
    real_wake = hub._wake

    def losing(ids: Any, *, read: bool = False) -> None:
        real_wake(None if ids is None else [i for i in ids if i != lost.id], read=read)

    monkeypatch.setattr(hub, "_wake", losing)
    assert hub.ready()
    with running_worker(app, concurrency=1, prefetch=0):
        order = [h.id for h in errands.as_completed([lost, *others], timeout=60)]
    assert order.index(lost.id) < 20, order.index(lost.id)  # not after all 30 others


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"timeout": float("nan")}, "timeout=nan: give a number of seconds"),
        ({"timeout": "5s"}, "timeout='5s': give a number of seconds"),
        ({"poll": 0}, "poll=0: give the longest pause between reads"),
        ({"poll": -1.0}, "poll=-1.0: give the longest pause between reads"),
    ],
)
def test_a_wait_refuses_a_timeout_or_poll_it_cannot_keep_naming_the_fix(
    app: errands.App, options: dict[str, Any], says: str
) -> None:
    """timeout=nan waited for ever, a poll of 0 spun on the store: a clear error instead.
    A timedelta is a timeout too, as everywhere else in the API."""

    @app.job(name="results.waited")
    def waited() -> int:
        return 1

    handle = waited.enqueue()
    with pytest.raises(errands.ConfigurationError, match=re.escape(says)):
        handle.result(**options)
    with pytest.raises(errands.ConfigurationError, match=re.escape(says)):
        asyncio.run(handle.aresult(**options))
    with pytest.raises(errands.ResultTimeout):
        handle.result(timeout=timedelta(milliseconds=50))
    with pytest.raises(errands.ResultTimeout):  # any real number (numpy's too)
        handle.result(timeout=Fraction(1, 20))


def test_an_aenqueue_cancelled_while_its_insert_runs_still_announces_the_job(
    app: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without conn=, cancelling the awaiting task does not undo an insert already sent:
    the job is stored, and announced (errands.job.enqueued) as any other; it was stored
    unannounced (the enqueued metric, traces and subscribers missed it)."""

    @app.job(name="results.announced")
    def announced() -> int:
        return 1

    seen: list[int] = []
    app.events.subscribe(
        lambda event: seen.append(event["job_id"]) if event.name == "errands.job.enqueued" else None
    )
    cancel_while_inserting(monkeypatch, app.backend, "job_insert_many", announced.aenqueue)
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.02)
    stored = [j.id for j in app.jobs(name="results.announced")]
    assert len(stored) == 1 and seen == stored


def test_a_watcher_that_could_not_start_is_tried_again_at_a_later_wait(
    store: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store away at the first wait: the watcher was given up on for the App's life,
    and every later wait polled. A wait START_RETRY seconds later starts it."""
    from errands import results

    monkeypatch.setattr(results, "START_RETRY", 0.2)
    listener = store.backend.result_listener
    calls = []

    def away_once(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("the store is away")
        return listener(*args)

    monkeypatch.setattr(store.backend, "result_listener", away_once)
    add = store.registry["results.add"]
    with pytest.raises(errands.ResultTimeout):
        add.enqueue(a=1, b=1).result(timeout=0.1)
    assert not store.results.pushing
    time.sleep(0.3)
    with running_worker(store, concurrency=2):
        assert add.enqueue(a=2, b=3).result(timeout=20, poll=NO_POLL) == 5
    assert store.results.pushing and len(calls) == 2
