"""A claim whose reply is lost gives its jobs back at once (PostgreSQL).

A worker's claim commits on the server; then the connection breaks before the reply
arrives (a network blip, ``pg_terminate_backend`` at the wrong moment, a restart). The
worker never learns which jobs it took. They stayed ``running`` under its lease until
the lease ran out, then the leader rescued them and charged each an attempt as a lost
worker's. Now the backend keeps the claim's lease token and undoes the claim by it, on a
fresh connection (errands.backends.postgres.lost_claims).

The tests let the claim commit for real on PostgreSQL (its statement, or its
transaction's COMMIT), then lose the reply: the client closes the connection and raises
what psycopg raises when the server's reply never comes. The lease is 300 s, so a job
that runs again within the tests' 20 s was not rescued.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest

import errands
from errands.backends.base import ClaimParams, QueueClaim
from tests.integration.helpers import WorkerThread, wait_until
from tests.pg import with_params

LEASE = 300.0  # a rescue would come after this: far beyond every wait below
PROMPTLY = 20.0  # seconds: generous on a busy 2-core machine, well inside the lease


class LoseClaimReplies:
    """In front of a PostgresBackend's pool connections: the next ``n`` claims that take
    jobs commit on the server, then their reply is lost (the connection closed under the
    call, which raises ``psycopg.OperationalError``). ``refuse``: connections to refuse
    after a lost reply (the server still away), each checkout raising at once."""

    def __init__(self, backend: Any, n: int = 1, refuse: int = 0) -> None:
        self.backend = backend
        self.left = n
        self.refuse = 0
        self.refuse_after_loss = refuse
        self.lost: list[list[tuple[Any, ...]]] = []  # each lost reply's rows (a plain claim's)
        self.lock = threading.Lock()
        self.claiming = threading.local()  # only a claim's connections are seen through
        real = backend._conn

        @contextmanager
        def connection(timeout: float | None = None, **options: Any) -> Iterator[Any]:
            if not getattr(self.claiming, "now", False):
                with real(timeout, **options) as conn:
                    yield conn
                return
            with self.lock:
                refused, self.refuse = self.refuse > 0, max(self.refuse - 1, 0)
            if refused:
                raise psycopg.OperationalError("connection refused (test: the server is away)")
            with real(timeout, **options) as conn:
                yield _Losing(conn, self)

        backend._conn = connection
        for name in ("job_claim", "job_claim_limited"):
            setattr(backend, name, self._claim(getattr(backend, name)))

    def _claim(self, method: Any) -> Any:
        def claim(*args: Any, **kwargs: Any) -> Any:
            self.claiming.now = True
            try:
                return method(*args, **kwargs)
            finally:
                self.claiming.now = False

        return claim

    def take(self) -> bool:
        """Whether to lose this reply (counted)."""
        with self.lock:
            if self.left <= 0:
                return False
            self.left -= 1
            return True

    def lose(self, conn: psycopg.Connection[Any], rows: list[tuple[Any, ...]]) -> None:
        self.lost.append(rows)
        with self.lock:
            self.refuse = self.refuse_after_loss
        conn.close()
        raise psycopg.OperationalError(
            "consuming input failed: server closed the connection unexpectedly "
            "(test: the claim committed, its reply was lost)"
        )


class _Losing:
    """One pool connection seen through :class:`LoseClaimReplies`."""

    def __init__(self, conn: psycopg.Connection[Any], plan: LoseClaimReplies) -> None:
        self._conn = conn
        self._plan = plan
        self._claimed = False  # a limited claim's write ran: its COMMIT is the one to lose
        q = plan.backend.q
        self._plain = {q["job_claim"], q["job_claim_suspect"]}
        self._write = q["job_claim_ids"]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def execute(self, query: Any, params: Any = None, **options: Any) -> Any:
        text = query if isinstance(query, str) else ""
        if text in self._plain:  # one autocommit statement: it commits as it runs
            rows = self._conn.execute(query, params, **options).fetchall()
            if rows and self._plan.take():
                self._plan.lose(self._conn, rows)
            return _Rows(rows)
        # the write alone, or as a prepared statement in a batch (prepared beforehand)
        writes = text == self._write or re.search(r"\bEXECUTE \w+_job_claim_ids\b", text)
        self._claimed = self._claimed or bool(writes)
        cur = self._conn.execute(query, params, **options)
        # the COMMIT of a limited claim that wrote (alone, or with its write in one batch)
        if self._claimed and "COMMIT" in text and self._plan.take():
            self._claimed = False
            self._plan.lose(self._conn, [])
        return cur


class _Rows:
    def __init__(self, rows: list[tuple[Any, ...]]) -> None:
        self.rows = rows

    def fetchall(self) -> list[tuple[Any, ...]]:
        return self.rows


def sql(app: errands.App, query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """One statement on a connection of the test's own; ``{s}``: the schema."""
    backend: Any = app.backend
    with psycopg.connect(backend.config.conninfo, autocommit=True) as conn:
        cur = conn.execute(query.replace("{s}", f'"{backend.schema}"').encode(), params)
        return cur.fetchall() if cur.description else []


def job_rows(app: errands.App, ids: list[int]) -> dict[int, tuple[Any, ...]]:
    rows = sql(
        app,
        "SELECT id, state, attempt, rescues, errors::text, lease_token "
        "FROM {s}.errands_jobs WHERE id = ANY(%s)",
        (ids,),
    )
    return {r[0]: r[1:] for r in rows}


def completed(app: errands.App, ids: list[int]) -> bool:
    rows = job_rows(app, ids)
    return all(rows[i][0] == "completed" for i in ids)


def run_losing_a_claim_reply(
    app: errands.App, ids: list[int], runs: list[tuple[int, int]], queue: str = "default"
) -> None:
    """A worker on ``queue`` runs the jobs ``ids`` while the reply of its first claim that
    takes any is lost. Then each job ran within PROMPTLY seconds, once, on attempt 1
    (``runs``: its handlers' ``(job id, attempt)``), with no rescue and nothing recorded
    on it."""
    plan = LoseClaimReplies(app.backend)
    worker = WorkerThread(app, queues=[queue], concurrency=4).start()
    try:
        wait_until(lambda: completed(app, ids), timeout=PROMPTLY, what="the jobs given back ran")
    finally:
        worker.stop()
    assert len(plan.lost) == 1, "no claim lost its reply"
    for job_id, (state, attempt, rescues, errors, _) in job_rows(app, ids).items():
        assert (state, attempt, rescues, errors) == ("completed", 1, 0, "[]"), job_id
    assert sorted(runs) == sorted((i, 1) for i in ids)


@pytest.fixture
def app(pg_url: str) -> Iterator[errands.App]:
    app = errands.App(pg_url, lease=LEASE)
    app.migrate()
    yield app
    app.close()


def test_a_claim_whose_reply_is_lost_gives_its_jobs_back_at_once(app: errands.App) -> None:
    """Given a job and a worker whose claim of it commits but whose reply is lost, then
    the job runs again within seconds (not after its 300 s lease), once, on attempt 1:
    the lost attempt is not charged and no rescue is recorded."""
    runs: list[tuple[int, int]] = []

    @app.job(name="lost.plain")
    def plain(ctx: errands.Context) -> None:
        runs.append((ctx.job_id, ctx.attempt))

    run_losing_a_claim_reply(app, [plain.enqueue().id for _ in range(3)], runs)


def test_a_limited_claim_whose_reply_is_lost_gives_back_its_keys_and_rate_starts(
    app: errands.App,
) -> None:
    """Given two jobs of one concurrency key (limit 1) of a job type limited to 2 starts an
    hour, in a queue limited to 2 starts an hour, and a worker whose claim of the first
    commits but whose reply is lost, then both run within seconds, each once on attempt
    1: the lost claim held the key (the second waited on it) and counted a start of each
    rate (a third start in the hour would have waited for it); the rate log keeps one
    start a job."""
    app.queue("accounts", rate="2/h")
    runs: list[tuple[int, int]] = []

    @app.job(
        name="lost.keyed",
        queue="accounts",
        concurrency_key="account:{account}",
        concurrency_limit=1,
        rate="2/h",
    )
    def keyed(ctx: errands.Context, account: int) -> None:
        runs.append((ctx.job_id, ctx.attempt))

    run_losing_a_claim_reply(app, [keyed.enqueue(account=7).id for _ in range(2)], runs, "accounts")
    starts = sql(app, "SELECT bucket, count(*) FROM {s}.errands_rate_log GROUP BY bucket")
    assert dict(starts) == {"queue:accounts": 2, "job:lost.keyed": 2}


def test_a_fair_claim_whose_reply_is_lost_folds_no_worker_time(app: errands.App) -> None:
    """Given a fair queue and a worker whose claim of a tenant's job commits but whose
    reply is lost, then the job runs again within seconds, and its key's usage counts
    one attempt: the undone claim is not folded in as a release or a rescue would be."""
    app.queue("tenants", fair=True)
    runs: list[tuple[int, int]] = []

    @app.job(name="lost.fair", queue="tenants", fair_key="tenant:{tenant}")
    def fair(ctx: errands.Context, tenant: int) -> None:
        runs.append((ctx.job_id, ctx.attempt))

    run_losing_a_claim_reply(app, [fair.enqueue(tenant=1).id], runs, "tenants")
    usage = sql(app, "SELECT key, attempts FROM {s}.errands_fair_usage WHERE queue = 'tenants'")
    assert usage == [("tenant:1", 1)]


def test_a_lost_claim_not_given_back_at_once_is_given_back_before_the_next_claim(
    app: errands.App,
) -> None:
    """Given a claim whose reply is lost while the server stays away a moment (the give-back
    right after it finds no connection), then the claim fails and its job stays running,
    kept in mind; the next claim gives it back first, uncharged, and takes it again."""

    @app.job(name="lost.later")
    def later() -> None: ...

    job_id = later.enqueue().id
    backend: Any = app.backend
    plan = LoseClaimReplies(backend, refuse=1)
    params = ClaimParams([QueueClaim("default", 5)], 5, "w-test", LEASE)
    with pytest.raises(psycopg.OperationalError, match="reply was lost"):
        backend.job_claim(params)
    state, attempt, _, _, token = job_rows(app, [job_id])[job_id]
    assert (state, attempt) == ("running", 1)
    assert backend._lost_claims.tokens == [token]
    [row] = backend.job_claim(params)
    assert (row.id, row.attempt) == (job_id, 1)
    assert row.lease_token != token
    assert backend._lost_claims.tokens == []
    assert len(plan.lost) == 1


def test_a_lost_claim_given_back_notifies_the_queues_of_its_jobs(pg_url: str) -> None:
    """Given a listener on the job channel and a claim whose reply is lost, then the
    give-back NOTIFYs the queue of the jobs it made due again, as an enqueue does: an idle
    worker elsewhere takes them at once, not at its next poll. (notify_window=0: the
    enqueue's own NOTIFY does not hold this one back.)"""
    app = errands.App(with_params(pg_url, notify_window="0"), lease=LEASE)
    app.migrate()
    try:

        @app.job(name="lost.notified", queue="wake")
        def notified() -> None: ...

        job_id = notified.enqueue().id
        backend: Any = app.backend
        LoseClaimReplies(backend)
        params = ClaimParams([QueueClaim("wake", 5)], 5, "w-test", LEASE)
        with psycopg.connect(backend.config.conninfo, autocommit=True) as listener:
            listener.execute(f'LISTEN "{backend.channel}"')
            with pytest.raises(psycopg.OperationalError, match="reply was lost"):
                backend.job_claim(params)  # given back on a fresh connection before it raises
            assert job_rows(app, [job_id])[job_id][:2] == ("available", 0)
            # the give-back committed: its notification is on its way, or here already
            heard = [n.payload for n in listener.notifies(timeout=PROMPTLY, stop_after=1)]
        assert heard == ["wake"]
    finally:
        app.close()


def test_a_lost_claim_whose_job_was_cancelled_meanwhile_ends_it_cancelled(
    app: errands.App,
) -> None:
    """Given a claim whose reply is lost and whose job an operator cancels before it is
    given back (a running job's cancel is a request), then the give-back ends the job
    cancelled, as a release does, and the next claim takes nothing."""

    @app.job(name="lost.cancelled")
    def cancelled() -> None: ...

    handle = cancelled.enqueue()
    backend: Any = app.backend
    LoseClaimReplies(backend, refuse=1)
    params = ClaimParams([QueueClaim("default", 5)], 5, "w-test", LEASE)
    with pytest.raises(psycopg.OperationalError, match="reply was lost"):
        backend.job_claim(params)
    handle.cancel()
    assert backend.job_claim(params) == []
    state, attempt, rescues, _, token = job_rows(app, [handle.id])[handle.id]
    assert (state, attempt, rescues, token) == ("cancelled", 0, 0, None)
    assert handle.status() == "cancelled"


def test_a_claim_the_server_refused_is_not_given_back(app: errands.App) -> None:
    """A statement the server refuses (here a serialization failure, the connection still
    up) rolled the claim back: nothing to give back, no token kept."""
    backend: Any = app.backend
    real = backend._conn

    @contextmanager
    def refusing(timeout: float | None = None, **options: Any) -> Iterator[Any]:
        with real(timeout, **options) as conn:
            yield _Refusing(conn)

    backend._conn = refusing
    with pytest.raises(psycopg.errors.SerializationFailure):
        backend.job_claim(ClaimParams([QueueClaim("default", 5)], 5, "w-test", LEASE))
    assert backend._lost_claims.tokens == []


class _Refusing:
    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def execute(self, query: Any, params: Any = None, **options: Any) -> Any:
        raise psycopg.errors.SerializationFailure("could not serialize access (test)")
