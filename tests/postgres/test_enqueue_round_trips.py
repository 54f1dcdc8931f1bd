"""An enqueue one call per job (no key, no caller's connection) on PostgreSQL is one
statement on one of errands' pool connections: its insert in autocommit, which commits it
(durable when enqueue returns), with no BEGIN, COMMIT, SET or other query around it; and
the cursor it runs on is made once per connection, never once per call."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import errands


@pytest.fixture
def app(pg_url: str) -> Iterator[errands.App]:
    app = errands.App(pg_url)
    app.migrate()
    try:
        yield app
    finally:
        app.close()


def _sent(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What psycopg is asked to send from here on: each statement's text, and each
    commit or rollback (Connection.execute runs through Cursor.execute)."""
    sent: list[str] = []
    execute = psycopg.Cursor.execute
    commit, rollback = psycopg.Connection.commit, psycopg.Connection.rollback

    def counted_execute(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(str(query))
        return execute(self, query, *args, **kwargs)

    def counted_commit(self: Any) -> None:
        sent.append("COMMIT()")
        commit(self)

    def counted_rollback(self: Any) -> None:
        sent.append("ROLLBACK()")
        rollback(self)

    monkeypatch.setattr(psycopg.Cursor, "execute", counted_execute)
    monkeypatch.setattr(psycopg.Connection, "commit", counted_commit)
    monkeypatch.setattr(psycopg.Connection, "rollback", counted_rollback)
    return sent


def test_an_enqueue_is_one_statement_that_commits_itself(
    app: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    @app.job(name="trips.add")
    def add(a: int, b: int) -> int:
        return a + b

    add.enqueue(a=0, b=0)  # the pool open, the queue's first NOTIFY sent
    sent = _sent(monkeypatch)
    handles = [add.enqueue(a=i, b=1) for i in range(3)]
    assert len(sent) == 3, sent
    assert all("INSERT INTO" in s and "errands_jobs" in s for s in sent)
    monkeypatch.undo()
    with app.backend._conn() as conn:  # type: ignore[attr-defined]
        rows = conn.execute(
            f'SELECT id, args FROM "{app.backend.schema}".errands_jobs WHERE id = ANY(%s) '  # type: ignore[attr-defined]
            "ORDER BY id",
            ([h.id for h in handles],),
        ).fetchall()
    assert [r[1] for r in rows] == [{"a": 0, "b": 1}, {"a": 1, "b": 1}, {"a": 2, "b": 1}]
    assert len({h.id for h in handles}) == 3


def test_the_insert_cursor_is_made_once_per_connection(app: errands.App) -> None:
    from errands.backends.postgres.backend import _insert_cursor

    @app.job(name="trips.one")
    def one(n: int) -> None:
        return None

    backend: Any = app.backend
    with backend._conn() as conn:
        first = _insert_cursor(conn)
        assert _insert_cursor(conn) is first
        first.close()  # a cursor found closed is made again
        second = _insert_cursor(conn)
        assert second is not first and not second.closed
    # every connection of the pool serves an enqueue first, and so has its cursor
    for n in range(2 * max(backend.pool.get_stats().get("pool_size", 0), 1)):
        one.enqueue(n=n)
    made: list[object] = []
    cursor = psycopg.Connection.cursor

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        made.append(self)
        return cursor(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(psycopg.Connection, "cursor", counted)
        ids = {one.enqueue(n=i).id for i in range(1, 11)}
    assert len(ids) == 10
    assert made == []  # conn.execute made a cursor per call: ten enqueues made ten


def test_a_refused_insert_leaves_the_cursor_usable(app: errands.App) -> None:
    """An insert the server refuses (its table renamed away) raises as before, and the
    next enqueue, on a connection whose insert cursor saw that error, stores its job."""

    @app.job(name="trips.refused")
    def refused(n: int) -> None:
        return None

    refused.enqueue(n=0)
    backend: Any = app.backend
    with backend._conn() as conn:
        conn.execute(f'ALTER TABLE "{backend.schema}".errands_jobs RENAME TO errands_jobs_away')
    try:
        with pytest.raises(errands.SchemaOutdated):
            refused.enqueue(n=1)
    finally:
        with backend._conn() as conn:
            conn.execute(f'ALTER TABLE "{backend.schema}".errands_jobs_away RENAME TO errands_jobs')
    assert refused.enqueue(n=2).id > 0
