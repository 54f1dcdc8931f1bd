"""A worker never runs further ahead of its store than twice its slots and prefetch.

Handlers hand their outcomes to the completer, which writes them in batches; the slot is
free again at once. When the store records outcomes slower than the handlers finish (a
slow or struggling store), the worker used to claim on: its unwritten outcomes piled up
in memory, each still held and heartbeated, so the heartbeats grew with them and slowed
the store further (a PostgreSQL worker grew by 80 MB and wrote ~160 outcomes a second
for 100 s in the memory benchmark). Now it claims nothing while too many wait.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from typing import Any

import errands

from .helpers import query, wait_until

JOBS = 120
LIMIT = 10  # the worker's ceiling on unwritten outcomes, lowered for the test
CONCURRENCY = 4


def _run_on_a_slow_store(
    app: errands.App, worker_factory: Any, *, prefetch: int, limit: int | None
) -> tuple[list[int], list[int], int]:
    """Run JOBS quick jobs on a store taking 0.1 s per batch of outcomes; ``limit``: the
    worker's ceiling, lowered for the test (None: its default). What it held unwritten,
    what it held in all, sampled, and the ceiling it ran with."""

    @app.job(name="bp.quick")
    def quick(n: int) -> int:
        return n

    app.enqueue_many([quick.bind(n=i) for i in range(JOBS)])
    backend: Any = app.backend
    write = backend.job_finish_many

    def slow_write(outcomes: Any) -> Any:
        time.sleep(0.1)  # a store that records outcomes slower than handlers finish
        return write(outcomes)

    backend.job_finish_many = slow_write
    unwritten: list[int] = []
    held: list[int] = []
    stop = threading.Event()
    with worker_factory(concurrency=CONCURRENCY, prefetch=prefetch) as worker:
        if limit is not None:
            worker._unwritten_max = limit
        ceiling = worker._unwritten_max

        def watch() -> None:
            while not stop.is_set():
                unwritten.append(worker.completer.pending)
                held.append(len(worker.attempts()))
                time.sleep(0.005)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            wait_until(
                lambda: (
                    query(app, "SELECT count(*) FROM errands_jobs WHERE state = 'completed'")
                    == [(JOBS,)]
                ),
                timeout=60,
                what="every job completed",
            )
        finally:
            stop.set()
            watcher.join(5)
    return unwritten, held, ceiling


def test_a_worker_claims_no_more_while_its_outcomes_wait_to_be_written(
    app: errands.App, worker_factory: Any
) -> None:
    unwritten, held, _ = _run_on_a_slow_store(app, worker_factory, prefetch=0, limit=LIMIT)
    # a claim in flight when the ceiling is reached adds at most its room
    assert max(unwritten) <= LIMIT + CONCURRENCY, max(unwritten)
    assert max(held) <= LIMIT + 2 * CONCURRENCY, max(held)


def test_by_default_a_worker_holds_at_most_twice_its_slots_and_prefetch_unwritten(
    app: errands.App, worker_factory: Any
) -> None:
    """Each unwritten outcome is a job that ran and runs again if the worker then loses
    the store past its lease. The default ceiling is twice the slots and prefetch (here
    2 x (4 + 4) = 16), not a batch of 500: a soak worker held 505 when its connection
    went, and their rescues queued for isolated runs for seconds."""
    prefetch = 4
    unwritten, held, ceiling = _run_on_a_slow_store(
        app, worker_factory, prefetch=prefetch, limit=None
    )
    assert ceiling == 2 * (CONCURRENCY + prefetch)
    room = CONCURRENCY + prefetch  # a claim in flight when the ceiling is reached
    assert max(unwritten) <= ceiling + room, max(unwritten)
    assert max(held) <= ceiling + 2 * room, max(held)


def test_a_worker_held_back_by_a_store_that_refuses_writes_resumes_when_it_answers(
    app: errands.App, worker_factory: Any
) -> None:
    """The completer retries a write the store refuses for a while (a busy or restarting
    store); meanwhile the worker claims nothing past its ceiling, and once the store
    answers again it catches up and claims on: every job completes, none twice."""
    ran: list[int] = []

    @app.job(name="bp.counted")
    def counted(n: int) -> int:
        ran.append(n)
        return n

    app.enqueue_many([counted.bind(n=i) for i in range(JOBS)])
    backend: Any = app.backend
    write = backend.job_finish_many
    refusals = {"left": 6}

    def flaky_write(outcomes: Any) -> Any:
        if refusals["left"] > 0:
            refusals["left"] -= 1
            raise sqlite3.OperationalError("database is locked")  # transient: retried
        return write(outcomes)

    backend.job_finish_many = flaky_write
    held: list[int] = []
    with worker_factory(concurrency=CONCURRENCY, prefetch=0) as worker:
        worker._unwritten_max = LIMIT
        wait_until(
            lambda: (
                held.append(len(worker.attempts()))
                or query(app, "SELECT count(*) FROM errands_jobs WHERE state = 'completed'")
                == [(JOBS,)]
            ),
            timeout=60,
            what="every job completed after the store answered again",
        )
    assert refusals["left"] == 0
    assert sorted(ran) == list(range(JOBS))  # each ran once: no lease ran out meanwhile
    assert max(held) <= LIMIT + 2 * CONCURRENCY, max(held)
