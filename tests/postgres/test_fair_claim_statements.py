"""A fair claim on PostgreSQL runs a fixed handful of statements, counted on the client
(not timed): its first one serialises the queue's claims and reads what the claim needs
of the queue at once."""

from __future__ import annotations

from typing import Any

import errands

from .counting import round_trips, statements


def test_a_fair_claim_takes_its_lock_settings_and_rates_in_one_statement(pg_url: str) -> None:
    """The claim's first statement serialises the queue's claims (its advisory lock) and
    reads the queue's settings and rate-limited job types at once: a fair claim that
    needs no deeper read is four statements (with the window, the lookahead and the
    claim), not six. Counted on the client."""
    from errands.backends.base import QueueClaim

    app = errands.App(pg_url)
    app.queue("tenants", fair=True)

    @app.job(name="plans.counted", queue="tenants", fair_key="tenant:{n}")
    def job(n: int) -> None: ...

    try:
        app.enqueue_many([job.bind(n=n % 50) for n in range(100)])
        backend: Any = app.backend
        backend.queue_declare(app.queues["tenants"], "test")
        rows, sent = statements(
            lambda: backend.job_claim_limited(QueueClaim("tenants", 8), "w", 30.0)
        )
        assert len(rows) == 8
        assert sent[0].startswith("-- A limited claim's first statement"), sent
        assert len(sent) <= 4, sent
    finally:
        app.close()


def test_a_fair_claim_of_a_queue_claimed_before_waits_for_the_server_three_times(
    pg_url: str,
) -> None:
    """A fair claim of a queue this process claimed before sends its BEGIN, its first
    statement, its first window of keys and its lookahead together, then its write with
    its COMMIT: two waits for the server, and the pipeline's end (six before: BEGIN,
    start, window, lookahead, write, COMMIT, each waited for). Counted on the client."""
    from errands.backends.base import QueueClaim

    app = errands.App(pg_url)
    app.queue("tenants", fair=True)

    @app.job(name="plans.trips", queue="tenants", fair_key="tenant:{n}")
    def job(n: int) -> None: ...

    try:
        # 200 keys: the second claim's window (32 keys after the first's) does not wrap
        app.enqueue_many([job.bind(n=n % 200) for n in range(400)])
        backend: Any = app.backend
        backend.queue_declare(app.queues["tenants"], "test")
        first = backend.job_claim_limited(QueueClaim("tenants", 8), "w", 30.0)
        rows, trips = round_trips(
            lambda: backend.job_claim_limited(QueueClaim("tenants", 8), "w", 30.0)
        )
        assert len(first) == 8 and len(rows) == 8
        assert not {r.id for r in rows} & {r.id for r in first}
        assert trips == 3, trips
    finally:
        app.close()
