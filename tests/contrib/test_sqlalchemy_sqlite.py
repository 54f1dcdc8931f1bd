"""enqueue(conn=session) on SQLite: the job is part of the SQLAlchemy transaction."""

from __future__ import annotations

import pytest

sqlalchemy = pytest.importorskip("sqlalchemy")

from sqlalchemy import create_engine, text  # noqa: E402
from sqlalchemy.orm import Session  # noqa: E402

import errands  # noqa: E402


@pytest.fixture
def setup(tmp_path):  # type: ignore[no-untyped-def]
    path = tmp_path / "shop.db"
    app = errands.App(f"sqlite:///{path}")
    app.migrate()

    @app.job(name="ship")
    def ship(order_id: int) -> None:
        pass

    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE orders (id INTEGER PRIMARY KEY)"))
    yield app, ship, engine
    engine.dispose()
    app.close()


def count(engine, table: str) -> int:  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())


def test_a_committed_session_keeps_both(setup) -> None:  # type: ignore[no-untyped-def]
    app, ship, engine = setup
    with Session(engine) as session, session.begin():
        session.execute(text("INSERT INTO orders (id) VALUES (1)"))
        handle = ship.enqueue(order_id=1, conn=session)
    assert count(engine, "orders") == 1
    assert app.get_job(handle.id).state is errands.JobState.AVAILABLE


def test_a_rolled_back_session_keeps_neither(setup) -> None:  # type: ignore[no-untyped-def]
    app, ship, engine = setup
    with pytest.raises(RuntimeError), Session(engine) as session, session.begin():
        session.execute(text("INSERT INTO orders (id) VALUES (2)"))
        ship.enqueue(order_id=2, conn=session)
        raise RuntimeError("rolled back")
    assert count(engine, "orders") == 0
    assert app.jobs() == []


def test_a_sqlalchemy_connection_works_too(setup) -> None:  # type: ignore[no-untyped-def]
    app, ship, engine = setup
    with engine.begin() as conn:
        ship.enqueue(order_id=3, conn=conn)
    assert len(app.jobs()) == 1


def test_another_database_is_refused(setup, tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, ship, _ = setup
    other = create_engine(f"sqlite:///{tmp_path / 'other.db'}")
    with (
        Session(other) as session,
        session.begin(),
        pytest.raises(errands.ConfigurationError, match="same file"),
    ):
        ship.enqueue(order_id=4, conn=session)
    other.dispose()
