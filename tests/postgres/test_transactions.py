"""Enqueue inside the caller's own transaction on PostgreSQL (DESIGN §3, RELIABILITY I2).

``enqueue(conn=...)`` takes a psycopg 3 connection, a SQLAlchemy 2 ``Session`` or a
SQLAlchemy ``Connection`` (using psycopg). The job row is written on that connection, so
it commits or rolls back with the caller's own rows: a rolled-back enqueue leaves no job,
a committed one leaves exactly one, next to the business row written with it. A
connection to another database is refused before anything is written.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pgacc_basic
import psycopg
import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session

import errands

from .harness import PgCluster

pytestmark = pytest.mark.acceptance


@pytest.fixture
def shop(pgc: PgCluster) -> PgCluster:
    """The cluster with a business table (orders) in the test's schema, and the jobs
    tables created (the app migrates on first use)."""
    pgc.query("CREATE TABLE {s}.orders (id integer PRIMARY KEY)")
    pgc.app().queue_stats()  # auto_migrate: the jobs tables exist before any transaction
    return pgc


@pytest.fixture
def engine(pgc: PgCluster) -> Iterator[Engine]:
    url = pgc.config.conninfo.replace("postgresql://", "postgresql+psycopg://", 1)
    eng = create_engine(url)
    try:
        yield eng
    finally:
        eng.dispose()


def _jobs(pgc: PgCluster) -> list[tuple[int, Any]]:
    return [
        (job_id, args["n"])
        for job_id, args in pgc.query("SELECT id, args FROM {s}.errands_jobs ORDER BY id")
    ]


def _orders(pgc: PgCluster) -> list[int]:
    return [r[0] for r in pgc.query("SELECT id FROM {s}.orders ORDER BY id")]


def _insert_order(pgc: PgCluster, order_id: int) -> str:
    return f'INSERT INTO "{pgc.schema}".orders (id) VALUES ({order_id})'


def test_enqueue_in_a_psycopg_transaction_commits_and_rolls_back_with_it(shop: PgCluster) -> None:
    """A job enqueued on a psycopg connection exists iff the caller's transaction commits,
    and is invisible to everyone else until then."""
    with psycopg.connect(shop.config.conninfo) as conn:
        conn.execute(_insert_order(shop, 1))
        pgacc_basic.touch.enqueue(n=1, conn=conn)
        shop.app().enqueue_many([pgacc_basic.touch.bind(n=11)], conn=conn)
        conn.rollback()
        assert _jobs(shop) == [] and _orders(shop) == []

        conn.execute(_insert_order(shop, 2))
        handle = pgacc_basic.touch.enqueue(n=2, conn=conn)
        assert _jobs(shop) == []  # not committed yet: no worker can see it
        conn.commit()
    assert _jobs(shop) == [(handle.id, 2)]
    assert _orders(shop) == [2]
    assert shop.state_of(handle.id) == "available"


def test_enqueue_in_a_sqlalchemy_session_commits_and_rolls_back_with_it(
    shop: PgCluster, engine: Engine
) -> None:
    """conn=session: the job rides on the Session's transaction, ORM-style."""
    with Session(engine) as session:
        session.execute(text(_insert_order(shop, 1)))
        pgacc_basic.touch.enqueue(n=1, conn=session)
        session.rollback()
    assert _jobs(shop) == [] and _orders(shop) == []

    with Session(engine) as session, session.begin():
        session.execute(text(_insert_order(shop, 2)))
        handle = pgacc_basic.touch.enqueue(n=2, conn=session)
        assert _jobs(shop) == []
    assert _jobs(shop) == [(handle.id, 2)]
    assert _orders(shop) == [2]


def test_enqueue_in_a_sqlalchemy_connection_commits_and_rolls_back_with_it(
    shop: PgCluster, engine: Engine
) -> None:
    """conn=connection: the job rides on a Core Connection's transaction."""
    with engine.connect() as connection:
        connection.execute(text(_insert_order(shop, 1)))
        pgacc_basic.touch.enqueue(n=1, conn=connection)
        connection.rollback()
    assert _jobs(shop) == [] and _orders(shop) == []

    with engine.begin() as connection:
        connection.execute(text(_insert_order(shop, 2)))
        handle = pgacc_basic.touch.enqueue(n=2, conn=connection)
    assert _jobs(shop) == [(handle.id, 2)]
    assert _orders(shop) == [2]


def test_enqueue_first_on_a_commit_as_you_go_connection_commits_with_it(
    shop: PgCluster, engine: Engine
) -> None:
    """conn=connection as the connection's first statement, SQLAlchemy 2.0 style (no
    begin()): the enqueue begins its transaction, as a statement would, so commit()
    stores the job and closing without it does not (commit() had nothing to commit and
    the pool rolled the job back: a handle to a job that never was)."""
    with engine.connect() as connection:
        handle = pgacc_basic.touch.enqueue(n=1, conn=connection)
        connection.commit()
    with engine.connect() as connection:
        pgacc_basic.touch.enqueue(n=2, conn=connection)
    assert _jobs(shop) == [(handle.id, 1)]


def test_enqueue_on_a_connection_to_another_database_is_refused(shop: PgCluster) -> None:
    """A connection to another database (same server) cannot carry the job: the app
    stores jobs elsewhere, so committing there would lose it. ConfigurationError, and
    nothing is written on either side."""
    other = psycopg.conninfo.make_conninfo(shop.config.conninfo, dbname="postgres")
    with psycopg.connect(other) as conn:
        with pytest.raises(errands.ConfigurationError, match="same database"):
            pgacc_basic.touch.enqueue(n=1, conn=conn)
        # the caller's transaction is untouched: still usable
        assert conn.execute("SELECT 1").fetchone() == (1,)
    assert _jobs(shop) == []
