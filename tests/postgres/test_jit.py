"""errands' own transactions on PostgreSQL run without JIT compilation.

A statement whose estimated cost passes ``jit_above_cost`` is compiled by LLVM before it
runs: hundreds of milliseconds for statements that run in one. The estimates of a fair
claim's recursive reads grow with the table and with the planner's guess at a recursion's
depth: at the end of a 20,000-job drain a fair claim's read of its last 50 keys took
0.67 s, 451 ms of it JIT, under the queue's claim lock (every claimer of the queue waited).
errands turns JIT off for its own transactions, local to each one (a pooler's other
clients never see it). These tests turn JIT on for every statement of their own
connections (libpq ``options`` in the URL), so nothing leaks to other tests.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

import errands
from errands.backends.base import QueueClaim
from errands.backends.postgres.backend import _LimitedStore
from tests.pg import with_params

JIT_ALWAYS = "-c%20jit%3Don%20-c%20jit_above_cost%3D0"


@pytest.fixture
def app(pg_url: str) -> Iterator[errands.App]:
    app = errands.App(with_params(pg_url, options=JIT_ALWAYS))
    yield app
    app.close()


def _jit(conn: Any) -> str:
    return str(conn.execute("SELECT current_setting('jit')").fetchone()[0])


def test_the_sessions_of_these_tests_compile_every_statement_with_jit(app: errands.App) -> None:
    backend: Any = app.backend
    with backend._conn() as conn:
        assert _jit(conn) == "on"


def test_errands_own_transactions_run_without_jit(app: errands.App) -> None:
    backend: Any = app.backend
    with backend._tx() as conn:
        assert _jit(conn) == "off"
    with backend._conn() as conn:  # local to the transaction: the session keeps its own
        assert _jit(conn) == "on"


@pytest.mark.parametrize("fair", [True, False], ids=["fair", "keyed"])
def test_a_limited_claim_reads_and_writes_without_jit(
    app: errands.App, fair: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every statement of a fair queue's claim (its window of keys, the lookahead, the
    write) and of a keyed queue's runs in a transaction with JIT off."""
    if fair:
        app.queue("tenants", fair=True)

        @app.job(name="jit.fair", queue="tenants", fair_key="tenant:{n}")
        def job(n: int) -> None: ...

    else:

        @app.job(name="jit.keyed", queue="tenants", concurrency_key="k:{n}")
        def job(n: int) -> None: ...

    app.enqueue_many([job.bind(n=n % 20) for n in range(60)])
    backend: Any = app.backend
    if fair:
        backend.queue_declare(app.queues["tenants"], "test")
    seen: list[str] = []
    real_rows, real_claim = _LimitedStore.rows, _LimitedStore.claim

    def rows(self: _LimitedStore, query: str, params: dict[str, object]) -> Any:
        seen.append(f"{query}:{_jit(self.conn)}")
        return real_rows(self, query, params)

    def claim(self: _LimitedStore, params: dict[str, object], *, last: bool) -> Any:
        seen.append(f"claim:{_jit(self.conn)}")
        return real_claim(self, params, last=last)

    monkeypatch.setattr(_LimitedStore, "rows", rows)
    monkeypatch.setattr(_LimitedStore, "claim", claim)
    claimed = 0
    for _ in range(3):  # a fair queue's later claims send their reads with the BEGIN
        claimed += len(backend.job_claim_limited(QueueClaim("tenants", 8), "w", 30.0))
    assert claimed == (24 if fair else 20)  # a key's limit is 1: 20 keys run at most 20
    assert seen and all(s.endswith(":off") for s in seen), seen


def test_a_ctx_transaction_jobs_outcome_is_written_without_jit(
    app: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler's own statements in ``ctx.transaction()`` run at its session's JIT
    setting (its choice); errands' outcome and fan-in statements after them, in the same
    transaction, run without JIT."""
    backend: Any = app.backend
    seen: list[tuple[str, str]] = []
    real_finish = type(backend)._finish

    def finish(self: Any, conn: Any, outcomes: Any) -> Any:
        seen.append(("outcome", _jit(conn)))
        return real_finish(self, conn, outcomes)

    monkeypatch.setattr(type(backend), "_finish", finish)

    @app.job(name="jit.tx", queue="jit", retries=0)
    def writes(ctx: errands.Context) -> None:
        seen.append(("handler", _jit(ctx.transaction())))

    handle = writes.enqueue()
    worker = app.worker(queues=["jit"], concurrency=1, poll_interval=0.1)
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        handle.result(timeout=60)
    finally:
        worker.stop()
        thread.join(30)
    assert seen == [("handler", "on"), ("outcome", "off")]
