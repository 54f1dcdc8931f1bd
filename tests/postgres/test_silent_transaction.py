"""A worker that goes silent inside one of errands' own transactions (a network cut that
holds its bytes, a frozen process) no longer holds every other worker up: the server ends
a transaction idle past half a lease (1-5 s), releasing its locks."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

import errands
from errands.backends.base import QueueClaim
from errands.backends.postgres.backend import _LimitedStore, idle_limit
from errands.errors import is_transient

pytestmark = pytest.mark.acceptance


def test_a_transaction_ended_for_idling_is_a_transient_error_retried_as_a_lost_connection() -> None:
    """The session is gone; what the transaction would have written is not: the completer
    writes the outcome again (a content refusal would split the batch and end the job
    dead as UnstorableOutcome), a claim round retries."""
    assert is_transient(psycopg.errors.IdleInTransactionSessionTimeout("idle too long"))


def test_idle_limit_is_half_a_lease_between_one_and_five_seconds() -> None:
    assert [idle_limit(lease) for lease in (0.5, 2.0, 4.0, 30.0)] == [
        "1000",
        "1000",
        "2000",
        "5000",
    ]


def test_a_claimer_gone_silent_with_a_claim_lock_holds_the_others_up_only_to_the_idle_limit(
    pg_url: str,
) -> None:
    """A limited claim serialises a queue's claimers (an advisory lock, to its
    transaction's end). Its claimer cut off mid-claim left the lock held until the cut
    healed, and every worker's claim round waited on it: in the full-size soak no worker
    claimed anything, rescued jobs included, for the 4-5 s of a proxy cut."""
    app = errands.App(pg_url)
    app.queue("tenants", fair=True)

    @app.job(name="silent.job", queue="tenants", fair_key="tenant:{n}")
    def job(n: int) -> None: ...

    silent_app = errands.App(pg_url)  # another worker's store
    try:
        app.enqueue_many([job.bind(n=n) for n in range(4)])
        backend: Any = app.backend
        backend.queue_declare(app.queues["tenants"], "test")
        silent: Any = silent_app.backend
        holding, release = threading.Event(), threading.Event()
        ended: list[BaseException] = []

        def go_silent() -> None:
            try:
                with silent._tx(guard=False) as conn:  # as job_claim_limited opens it
                    store = _LimitedStore(
                        conn, silent.q, f"errands:{silent.schema}:", idle_limit(2.0)
                    )
                    store.start("tenants")  # the queue's claim lock, held from here
                    holding.set()
                    release.wait(15)  # silent: no statement, the transaction left open
            except psycopg.Error as exc:
                ended.append(exc)

        thread = threading.Thread(target=go_silent, daemon=True)
        thread.start()
        assert holding.wait(10)
        claimed: list[Any] = []
        claimer = threading.Thread(
            target=lambda: claimed.append(
                backend.job_claim_limited(QueueClaim("tenants", 4), "w-other", 2.0)
            ),
            daemon=True,
        )
        claimer.start()
        claimer.join(10)
        assert claimed, "the other claimer still waits for the silent one's lock"
        assert len(claimed[0]) == 4
        release.set()
        thread.join(10)
        assert ended, "the silent transaction was not ended by the server"
    finally:
        app.close()
        silent_app.close()
