"""A fair claim on PostgreSQL waits for the server a fixed, small number of times, counted
on the client (not timed): its first statement serialises the queue's claims and reads
what the claim needs of the queue at once, in the message of its BEGIN; a claim of a
queue this process claimed before sends its first reads with it, and its write with its
COMMIT (errands.backends.postgres.batches)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import errands
from errands.backends.base import QueueClaim
from errands.backends.postgres.backend import _LimitedStore
from errands.backends.postgres.config import parse_postgres_url
from tests.pg import with_params

from .counting import messages, round_trips


@pytest.fixture
def tenants(pg_url: str) -> Iterator[tuple[Any, Any]]:
    """An app on ``pg_url`` with a fair queue of 200 keys, two jobs each; its backend and
    the app. Its statements run one after another on the pool's one connection (it opens
    one, and more only for statements at once)."""
    yield from _tenants(pg_url)


def _tenants(url: str) -> Iterator[tuple[Any, Any]]:
    app = errands.App(url)
    app.queue("tenants", fair=True)

    @app.job(name="plans.counted", queue="tenants", fair_key="tenant:{n}")
    def job(n: int) -> None: ...

    try:
        # 200 keys: the second claim's window (32 keys after the first's) does not wrap
        app.enqueue_many([job.bind(n=n % 200) for n in range(400)])
        backend: Any = app.backend
        backend.queue_declare(app.queues["tenants"], "test")
        yield backend, app
    finally:
        app.close()


def _claim(backend: Any) -> Any:
    return backend.job_claim_limited(QueueClaim("tenants", 8), "w", 30.0)


def test_a_fair_claim_takes_its_lock_settings_and_rates_in_the_message_of_its_begin(
    tenants: tuple[Any, Any],
) -> None:
    """The claim's first statement serialises the queue's claims (its advisory lock) and
    reads the queue's settings and rate-limited job types at once, sent with the BEGIN
    (which sets the idle limit and generic plans): a first fair claim waits for its
    statements to be prepared (once per connection), that message, its window, its
    lookahead and its write with the COMMIT."""
    backend, _ = tenants
    rows, sent = round_trips(lambda: _claim(backend))
    assert len(rows) == 8
    assert sent[0].startswith("SELECT name FROM pg_prepared_statements"), sent
    assert sent[1].startswith("PREPARE errands_"), sent  # the four, in one message
    begin = "BEGIN ISOLATION LEVEL READ COMMITTED; SELECT set_config('idle_in_transaction"
    assert sent[2].startswith(begin), sent
    assert len(sent) == 6, sent  # which are prepared, PREPARE, BEGIN..., window, lookahead, write
    rows, sent = round_trips(lambda: _claim(backend))  # prepared already
    assert len(rows) == 8 and not sent[0].startswith("PREPARE"), sent


def test_a_fair_claim_of_a_queue_claimed_before_waits_for_the_server_twice(
    tenants: tuple[Any, Any],
) -> None:
    """A fair claim of a queue this process claimed before sends its BEGIN, its first
    statement, its first window of keys and its lookahead as one message, then its write
    with its COMMIT: two waits for the server (six before: BEGIN, start, window,
    lookahead, write, COMMIT)."""
    backend, _ = tenants
    first = _claim(backend)
    rows, texts = messages(lambda: _claim(backend))
    sent = [t.split("\n", 1)[0] for t in texts]
    assert len(first) == 8 and len(rows) == 8
    assert not {r.id for r in rows} & {r.id for r in first}
    assert len(sent) == 2, sent
    reads, write = texts[-2:]
    assert reads.startswith("BEGIN ISOLATION LEVEL READ COMMITTED;")
    for query in ("limited_claim_start", "fair_heads", "fair_lookahead"):
        assert re.search(rf"EXECUTE errands_\w+_{query}\(", reads), (query, reads)
    assert re.search(r"EXECUTE errands_\w+_job_claim_ids\(", write) and write.endswith("COMMIT")


def test_a_fair_claim_without_server_prepared_statements_sends_them_one_by_one(
    pg_url: str,
) -> None:
    """Behind PgBouncer in transaction mode (``?prepare=false``) the server keeps no
    prepared statement for the session: the claim sends its statements apart (BEGIN,
    start, window, lookahead, write, COMMIT) and claims as well."""
    for backend, _ in _tenants(with_params(pg_url, prepare="false")):
        _claim(backend)
        rows, sent = round_trips(lambda backend=backend: _claim(backend))
        assert len(rows) == 8
        assert not any("PREPARE" in s or "EXECUTE" in s for s in sent), sent
        assert len(sent) == 6, sent


def test_a_connection_that_lost_its_prepared_statements_prepares_them_again(
    tenants: tuple[Any, Any],
) -> None:
    """Someone ran DEALLOCATE ALL (or DISCARD ALL) on errands' connection: the claim that
    finds its statements gone prepares them again and claims, without an error."""
    backend, _ = tenants
    assert len(_claim(backend)) == 8
    with backend._conn() as conn:  # the pool's one connection, the claim's
        conn.execute("DEALLOCATE ALL")
    rows, sent = round_trips(lambda: _claim(backend))
    assert len(rows) == 8
    assert sum(s.startswith("PREPARE errands_") for s in sent) == 1, sent
    assert backend._prepared is not None  # still sent as two messages
    rows, sent = round_trips(lambda: _claim(backend))
    assert len(rows) == 8 and len(sent) == 2, sent


def test_a_rollback_on_the_claims_connection_costs_the_next_claim_one_retry_not_the_batching(
    tenants: tuple[Any, Any],
) -> None:
    """psycopg sends DEALLOCATE ALL with a ROLLBACK on a connection where it prepared
    statements of its own: the next claim there finds its statements gone, prepares them
    again on that connection and claims; its statements stay batched."""
    backend, _ = tenants
    assert len(_claim(backend)) == 8
    with backend._conn() as conn:
        for _ in range(6):  # psycopg prepares a statement at its fifth execution
            conn.execute("SELECT %s::int", [1])
        conn.execute("BEGIN")
        conn.execute("ROLLBACK")
        assert conn.execute(
            "SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'errands_%%'"
        ).fetchone()[0] == 0  # fmt: skip
    rows, sent = round_trips(lambda: _claim(backend))
    assert len(rows) == 8
    assert backend._prepared is not None
    assert sum(s.startswith("PREPARE errands_") for s in sent) == 1, sent


def test_statements_that_never_stay_prepared_make_the_claims_send_them_one_by_one(
    tenants: tuple[Any, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Behind a pooler in transaction mode a statement prepared by PREPARE lives on one
    server connection, and the next transaction may run on another: prepared again and
    gone again, the claim says so once and sends its statements one by one from then on,
    and claims."""
    backend, _ = tenants
    backend._prepared.ensure = lambda conn: True  # as if prepared on another connection
    assert len(_claim(backend)) == 8
    assert backend._prepared is None
    assert any("vanish between transactions" in r.getMessage() for r in caplog.records)
    rows, sent = round_trips(lambda: _claim(backend))
    assert len(rows) == 8 and not any("EXECUTE" in s for s in sent), sent


def test_claims_after_every_connection_lost_its_statements_stay_batched(
    tenants: tuple[Any, Any],
) -> None:
    """Two connections of the pool both lost the statements prepared on them (a ROLLBACK
    by psycopg comes with DEALLOCATE ALL): each claim that meets a stale one prepares
    again on that very connection, not on the next, and the claims stay batched."""
    backend, _ = tenants
    with backend._conn() as a, backend._conn() as b:  # the pool opens a second one
        for conn in (a, b):
            backend._prepared.ensure(conn)
            conn.execute("DEALLOCATE ALL")
    for _ in range(4):
        assert len(_claim(backend)) == 8
    assert backend._prepared is not None


def test_a_fair_claim_plans_its_reads_once_and_its_write_with_its_ids(
    tenants: tuple[Any, Any],
) -> None:
    """On the claims' connection the server keeps one generic plan for the window's read
    and plans the write with its ids at each claim (plans_with_values, sent with it);
    after its first reads the claim's transaction is back to the server's own choice of
    plans (plans_by_default)."""
    backend, _ = tenants
    seen: list[str] = []
    start = _LimitedStore.start

    def start_and_look(self: Any, queue: str) -> Any:
        out = start(self, queue)
        seen.append(self.conn.execute("SELECT current_setting('plan_cache_mode')").fetchone()[0])
        return out

    _LimitedStore.start = start_and_look  # type: ignore[method-assign]
    try:
        for _ in range(3):
            assert len(_claim(backend)) == 8
    finally:
        _LimitedStore.start = start  # type: ignore[method-assign]
    assert seen == ["auto"] * 3
    with backend._conn() as conn:  # the pool's one connection, the claims'
        plans = dict(
            conn.execute(
                "SELECT regexp_replace(name, '^errands_[0-9a-f]+_', ''), "
                "format('%s/%s', generic_plans, custom_plans) FROM pg_prepared_statements "
                "WHERE name LIKE 'errands_%'"
            ).fetchall()
        )
    assert plans["fair_heads"].startswith(("2/", "3/")), plans  # generic: once per claim sent
    assert plans["job_claim_ids"] == "0/3", plans


def test_a_claim_whose_statements_fail_to_prepare_raises_and_the_next_one_prepares_them(
    tenants: tuple[Any, Any],
) -> None:
    """Preparing the statements fails partway (a broken one among them): that claim
    raises and claims nothing; the connection is forgotten as prepared, so the next
    claim prepares what is missing (taking as is what the failed message left) and
    claims, batched."""
    backend, _ = tenants
    prepared = backend._prepared
    good = prepared._prepare["fair_lookahead"]
    prepared._prepare["fair_lookahead"] = good.split(" AS\n", 1)[0] + " AS SELECT nosuch"
    try:
        with pytest.raises(psycopg.errors.UndefinedColumn):
            _claim(backend)
    finally:
        prepared._prepare["fair_lookahead"] = good
    rows, sent = round_trips(lambda: _claim(backend))
    assert len(rows) == 8
    assert any(s.startswith("PREPARE errands_") for s in sent), sent
    assert backend._prepared is not None


@pytest.mark.parametrize(
    ("cast", "value"),
    [
        ("bigint", 7),
        ("bigint", -(2**62)),
        ("bigint[]", [3, -1, 2**40]),
        ("bigint[]", []),
        ("int[]", [1, 2]),
        ("bigint", None),
        ("boolean", True),
        ("boolean", False),
        ("text", "it's a \\ key"),
        ("text[]", ["a b", "c'd", ""]),
        ("float8", 2.5),
    ],
)
def test_a_prepared_statements_arguments_reach_the_server_as_given(
    pg_url: str, cast: str, value: object
) -> None:
    """The arguments of a claim's EXECUTE are written as literals (integers, lists of
    them, None and booleans by errands, the rest by psycopg): each is read back as it was
    given, in the prepared parameter's type."""
    from errands.backends.postgres.batches import Prepared, run_batch

    prepared = Prepared({"echo": f"SELECT %(v)s::{cast}"}, ["echo"])
    with psycopg.connect(parse_postgres_url(pg_url).conninfo, autocommit=True) as conn:
        prepared.ensure(conn)
        [rows] = run_batch(conn, [prepared.execute(conn, "echo", {"v": value})])
    assert rows == [(value,)]
