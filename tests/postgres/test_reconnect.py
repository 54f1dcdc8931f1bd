"""After PostgreSQL restarts, or kills sessions, the application's next calls just work.

A web process keeps idle connections in its pool. When the server restarts (or an
administrator's ``pg_terminate_backend`` ends them), every one of them is dead, and used
to fail the next call made on it: after every restart or fail-over, one error per pooled
connection. errands now finds a connection the server closed before it sends anything on
it (a readability check of its socket, no round trip) and takes another; a connection
lost under a read, or under an enqueue's transaction before its COMMIT, is replaced and
the call run again. Only an enqueue lost while it may have committed is an error:
``errands.EnqueueUncertain``, saying so.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

import errands
from tests.pg import OwnServer, fresh_own_pg_url, own_server

from .harness import wait_until, with_params

# One xdist worker runs every test that uses the tests' own PostgreSQL cluster: one
# cluster per run, restarted by one test at a time.
pytestmark = [pytest.mark.acceptance, pytest.mark.xdist_group("own_postgres")]

POOLED = 5  # idle connections in the app's pool when the fault strikes


class Shop:
    """An app on the test schema whose sessions carry their own application_name."""

    def __init__(self, url: str, tag: str) -> None:
        self.tag = tag
        self.app = errands.App(with_params(url, application_name=tag))

        @self.app.job(name="ship")
        def ship(order: int) -> int:
            return order

        self.ship = ship
        self.conninfo = self.app.backend.config.conninfo  # type: ignore[attr-defined]
        # the test's own session, spared by the pg_terminate_backend of the app's
        self.admin = psycopg.connect(self.conninfo, autocommit=True, application_name="test")
        self.schema = self.app.backend.schema  # type: ignore[attr-defined]

    def fill_pool(self) -> None:
        """Hold POOLED connections at once, then give them back: all idle in the pool."""
        pool = self.app.backend.pool  # type: ignore[attr-defined]
        held = [pool.getconn() for _ in range(POOLED)]
        for conn in held:
            pool.putconn(conn)
        assert self.sessions() >= POOLED

    def sessions(self) -> int:
        rows = self.sql(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (self.tag,)
        )
        return int(rows[0][0])

    def sql(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """One statement on the test's own connection; ``{s}``: the schema."""
        cur = self.admin.execute(sql.replace("{s}", f'"{self.schema}"').encode(), params)
        return cur.fetchall() if cur.description else []

    def complete(self, job_id: int, result: int) -> None:
        self.sql(
            "UPDATE {s}.errands_jobs SET state = 'completed', result = %s::jsonb, "
            "finished_at = now() WHERE id = %s",
            (str(result), job_id),
        )

    def close(self) -> None:
        self.app.close()
        self.admin.close()


@pytest.fixture
def shop(pg_url: str) -> Iterator[Shop]:
    s = Shop(pg_url, f"errands_reconnect_{id(pg_url):x}")
    try:
        yield s
    finally:
        s.close()


def _every_call_succeeds_at_once(shop: Shop, done: errands.JobHandle) -> None:
    """Enqueues (one statement; a transaction with a key; a batch) and reads, each made
    once: none may raise."""
    handles = [shop.ship.enqueue(order=i) for i in range(POOLED + 2)]
    handles.append(shop.ship.enqueue(order=100, key="order-100"))
    handles += shop.app.enqueue_many([shop.ship.bind(order=200 + i) for i in range(3)])
    assert len({h.id for h in handles}) == len(handles)
    for handle in handles:
        assert shop.app.get_job(handle.id).state is errands.JobState.AVAILABLE
    assert {j.id for j in shop.app.jobs(state="available", limit=100)} >= {h.id for h in handles}
    assert done.result(timeout=10) == 7


@pytest.fixture
def server() -> OwnServer:
    """The tests' own PostgreSQL cluster: restarting it disturbs no other test."""
    return own_server()


@pytest.fixture
def shop_on_own_server(server: OwnServer) -> Iterator[Shop]:
    for url in fresh_own_pg_url():
        s = Shop(url, f"errands_reconnect_{id(url):x}")
        try:
            yield s
        finally:
            s.close()


def test_every_enqueue_and_read_after_a_postgres_restart_succeeds_on_its_first_call(
    shop_on_own_server: Shop, server: OwnServer
) -> None:
    """A restart (`pg_ctl restart -m fast`) with POOLED idle connections in the app's pool:
    the next enqueues, reads and handle.result() all succeed on their first call."""
    shop = shop_on_own_server
    done = shop.ship.enqueue(order=7)
    shop.complete(done.id, 7)
    shop.fill_pool()
    server.restart("fast")
    _every_call_succeeds_at_once(shop, done)


def test_every_enqueue_and_read_after_the_pools_sessions_are_terminated_succeeds_on_its_first_call(
    shop: Shop,
) -> None:
    """pg_terminate_backend on every idle session of the app's pool (as an administrator,
    or idle_session_timeout, would): the next enqueues and reads succeed at once."""
    done = shop.ship.enqueue(order=7)
    shop.complete(done.id, 7)
    shop.fill_pool()
    killed = shop.sql(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
        (shop.tag,),
    )
    assert len(killed) >= POOLED
    wait_until(lambda: shop.sessions() == 0, 10, "the terminated sessions to end")
    _every_call_succeeds_at_once(shop, done)


class Blocked:
    """Run ``call`` in a thread while the jobs table is locked, so its statement waits
    on the server; ``terminate()`` ends that session mid-statement."""

    def __init__(self, shop: Shop, call: Callable[[], Any]) -> None:
        self.shop = shop
        self.outcome: list[Any] = []
        self.lock = psycopg.connect(shop.conninfo, application_name="test-lock")
        self.lock.execute(f'LOCK TABLE "{shop.schema}".errands_jobs IN ACCESS EXCLUSIVE MODE')

        def run() -> None:
            try:
                self.outcome.append(call())
            except Exception as exc:
                self.outcome.append(exc)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def waiting(self) -> set[int]:
        rows = self.shop.sql(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s "
            "AND wait_event_type = 'Lock'",
            (self.shop.tag,),
        )
        return {pid for (pid,) in rows}

    def terminate(self) -> None:
        """End the waiting session; then wait until the call either gave up or waits
        again on a session of its own (a retry)."""
        (pid,) = wait_until(self.waiting, 10, "the call to wait on the lock")
        self.shop.sql("SELECT pg_terminate_backend(%s)", (pid,))
        wait_until(
            lambda: not self.thread.is_alive() or self.waiting() - {pid},
            10,
            "the call to give up or to wait again on a fresh connection",
        )

    def release(self) -> Any:
        self.lock.rollback()
        self.lock.close()
        self.thread.join(10)
        assert not self.thread.is_alive()
        return self.outcome[0]


def _orders(shop: Shop) -> list[int]:
    return sorted(r[0] for r in shop.sql("SELECT (args->>'order')::int FROM {s}.errands_jobs"))


def test_enqueue_transaction_whose_connection_is_lost_before_commit_runs_again_on_a_fresh_one(
    shop: Shop,
) -> None:
    """enqueue_many's session is terminated while its INSERT waits: nothing was
    committed, so errands runs the transaction again on a fresh connection; every job
    is stored exactly once."""
    blocked = Blocked(
        shop, lambda: shop.app.enqueue_many([shop.ship.bind(order=i) for i in range(3)])
    )
    blocked.terminate()
    handles = blocked.release()
    assert not isinstance(handles, Exception), handles
    assert [shop.app.get_job(h.id).args["order"] for h in handles] == [0, 1, 2]
    assert _orders(shop) == [0, 1, 2]


def test_read_whose_connection_is_lost_mid_statement_is_run_again(shop: Shop) -> None:
    """A get_job whose session is terminated mid-statement returns the job anyway."""
    handle = shop.ship.enqueue(order=5)
    blocked = Blocked(shop, lambda: shop.app.get_job(handle.id))
    blocked.terminate()
    job = blocked.release()
    assert isinstance(job, errands.Job), job
    assert job.id == handle.id


def test_enqueue_lost_while_it_may_have_committed_raises_enqueue_uncertain_saying_keys_retry_safely(
    shop: Shop,
) -> None:
    """A single enqueue is one autocommit statement, its own commit: lost mid-statement,
    errands cannot know whether it happened, and says so (EnqueueUncertain, naming the
    job and that an enqueue with key= can simply be retried). Retried with a key, it
    happens once."""
    blocked = Blocked(shop, lambda: shop.ship.enqueue(order=9))
    blocked.terminate()
    raised = blocked.release()
    assert isinstance(raised, errands.EnqueueUncertain), raised
    message = str(raised)
    for part in (
        "was lost while the enqueue of job ship was committing",
        "may or may not",
        "key= can simply be retried",
        "terminating connection due to administrator",
    ):
        assert part in message, message
    first = shop.ship.enqueue(order=9, key="order-9")
    again = shop.ship.enqueue(order=9, key="order-9")
    assert again.id == first.id and again.deduplicated
    assert _orders(shop) == [9]  # the lost statement was rolled back by the server


def test_a_lost_connection_is_opened_again_within_a_second_not_after_psycopg_pools_1_2_4_s() -> (
    None
):
    """psycopg_pool tries a failed connect again after 1 s, then 2 and 4 s: after a restart
    of under a second whose first attempts failed, a worker had no connection for up to
    5 s (rescued jobs claimed 5 s late in the chaos soak). errands' pools try again after
    0.1 s, doubling up to 1 s (+-10 %), until RECONNECT_WINDOW, then start afresh. Checked
    through psycopg_pool's own hook, so an upgrade that moves it fails here."""
    from errands.backends.postgres import connections
    from errands.backends.postgres.config import parse_postgres_url

    config = parse_postgres_url("postgresql://postgres@127.0.0.1:1/nowhere?connect_timeout=1")
    pool = connections.make_pool(config, "errands-reconnect-test", 0, 1)
    scheduled: list[tuple[Any, float]] = []
    pool.schedule_task = lambda task, delay: scheduled.append((task, delay))  # type: ignore[method-assign]
    pool._add_connection(None)  # the first attempt, as the pool makes it after a loss
    while scheduled and len(scheduled) < 12:  # each failed connect schedules the next
        task, _ = scheduled[-1]
        before = len(scheduled)
        pool._add_connection(task.attempt)
        if len(scheduled) == before:  # given up: RECONNECT_WINDOW ran out
            break
    delays = [delay for _, delay in scheduled]
    assert len(delays) >= 4, delays
    assert 0.09 <= delays[0] <= 0.11, delays
    assert max(delays) <= connections.RECONNECT_PAUSE_MAX * 1.1, delays
