"""A worker that goes silent inside one of errands' own transactions (a network cut that
holds its bytes, a frozen process) no longer holds every other worker up: the server ends
a transaction idle past half a lease (1-5 s), releasing its locks."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

import errands
from errands import faults
from errands.backends.base import ClaimParams, FinishParams, QueueClaim
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
                silent.configure_worker(4, lease=2.0)  # an idle limit of 1 s
                with silent._conn() as conn:  # as job_claim_limited opens it
                    prefix = f"errands:{silent.schema}:"
                    store = _LimitedStore(conn, silent.q, prefix, silent._prepared)
                    with store.transaction():
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


def test_a_member_finish_gone_silent_holding_its_workflow_holds_others_only_to_the_idle_limit(
    pg_url: str,
) -> None:
    """A workflow member's finish locks its workflow's row for the fan-in. Its worker cut
    off there (the transaction was not guarded: "a fixed handful of statements") held
    the lock until the cut healed: every other member's finish of that workflow waited,
    those workers' unwritten outcomes piled up to their limit, and they stopped claiming
    (the full-size soak: no claim anywhere for the 4 s of a cut, rescued jobs late)."""
    app = errands.App(pg_url)

    @app.job(name="silent.member")
    def member(n: int) -> int:
        return n

    silent_app = errands.App(pg_url)  # the worker cut off
    holding, release = threading.Event(), threading.Event()

    def go_silent(point: str) -> None:
        holding.set()
        release.wait(15)  # silent, inside the finish's transaction, the workflow locked

    try:
        wf = errands.Workflow("batch")
        wf.add(member.bind(n=0))
        wf.add(member.bind(n=1))
        app.enqueue_workflow(wf)
        backend: Any = app.backend
        silent: Any = silent_app.backend
        for store in (backend, silent):
            store.configure_worker(4, lease=2.0)  # an idle limit of 1 s
        first, second = backend.job_claim(ClaimParams([QueueClaim("default", 2)], 2, "w", 2.0))
        faults.arm("before_fan_in", go_silent, when=lambda d: first.id in d["job_ids"])
        ended: list[BaseException] = []

        def finish_silently() -> None:
            try:
                silent.job_finish_many([FinishParams(first.id, first.lease_token, "completed",
                                                     member=True)])  # fmt: skip
            except psycopg.Error as exc:
                ended.append(exc)

        thread = threading.Thread(target=finish_silently, daemon=True)
        thread.start()
        assert holding.wait(10)
        answers: list[Any] = []
        other = threading.Thread(
            target=lambda: answers.append(
                backend.job_finish_many(
                    [FinishParams(second.id, second.lease_token, "completed", member=True)]
                )
            ),
            daemon=True,
        )
        other.start()
        other.join(10)
        assert answers == [[True]], "the other member's finish still waits for the silent one"
        release.set()
        thread.join(10)
        assert ended and is_transient(ended[0]), "the silent finish was not ended by the server"
        assert backend.job_get(first.id).state == "running"  # its outcome is written again
    finally:
        faults.disarm()
        release.set()
        app.close()
        silent_app.close()


def test_every_transaction_errands_opens_carries_the_idle_limit(pg_url: str) -> None:
    """Its BEGIN and the limit in one round trip; a savepoint inside keeps it."""
    app = errands.App(pg_url)
    try:
        backend: Any = app.backend
        backend.configure_worker(4, lease=3.0)
        show = "SHOW idle_in_transaction_session_timeout"
        with backend._tx() as conn:
            assert conn.execute(show).fetchone() == ("1500ms",)
            with backend._own_tx(conn):
                assert conn.execute(show).fetchone() == ("1500ms",)
        with backend._conn() as conn:
            assert conn.execute(show).fetchone() == ("0",)  # local to the transaction
    finally:
        app.close()


def test_a_transaction_the_server_ended_for_idling_before_its_commit_runs_again(
    pg_url: str,
) -> None:
    """Its COMMIT met a session already ended (25P03): rolled back for certain, so an
    enqueue runs again rather than raising EnqueueUncertain ("it may have happened")."""
    app = errands.App(pg_url)
    try:
        backend: Any = app.backend
        backend.configure_worker(4, lease=2.0)  # an idle limit of 1 s
        tries: list[int] = []

        def work(conn: Any, progress: Any) -> str:
            tries.append(1)
            with backend._own_tx(conn):
                conn.execute("SELECT 1")
                if len(tries) == 1:
                    time.sleep(1.6)  # silent past the limit: the server ends the session
                progress.committing = True  # leaving the block sends COMMIT
            return "stored"

        uncertain = lambda exc: AssertionError(f"reported uncertain: {exc}")  # noqa: E731
        assert backend._again_if_lost(work, uncertain) == "stored"
        assert len(tries) == 2
    finally:
        app.close()
