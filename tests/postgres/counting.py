"""Counting the statements a call sends through psycopg, on the client (not timed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import psycopg

T = TypeVar("T")
# Settings of a transaction, sent with its BEGIN (a limited claim's, in pipeline mode).
CONTROL = ("-- The idle limit of own_begin", "-- A limited claim's statements use generic")


def statements(call: Callable[[], T]) -> tuple[T, list[str]]:
    """``call()``'s result and the statements it sent (the first line of each, cut to 80
        characters: a query's leading comment names it), transaction control left out (BEGIN,
        COMMIT, ROLLBACK: psycopg's own, sent apart, were never counted; the settings sent with
    a BEGIN)."""
    sent: list[str] = []
    execute = psycopg.Cursor.execute

    def counting(self: Any, query: Any, params: Any = None, **kw: Any) -> Any:
        first = str(query).split("\n", 1)[0][:80]
        if first.split(";")[0].strip() not in ("BEGIN", "COMMIT", "ROLLBACK") and not any(
            first.startswith(c) for c in CONTROL
        ):
            sent.append(first)
        return execute(self, query, params, **kw)

    psycopg.Cursor.execute = counting  # type: ignore[method-assign]
    try:
        return call(), sent
    finally:
        psycopg.Cursor.execute = execute  # type: ignore[method-assign]


def round_trips(call: Callable[[], T]) -> tuple[T, int]:
    """``call()``'s result and how many times it waited for the server: each statement
    outside pipeline mode, and in pipeline mode each Sync, each fetch of results with
    statements sent since the last wait (those go out together), and each pipeline's
    end."""
    count = [0]
    pending = [0]
    execute, fetchall = psycopg.Cursor.execute, psycopg.Cursor.fetchall
    fetchone, exit_ = psycopg.Cursor.fetchone, psycopg.Pipeline.__exit__
    sync = psycopg.Pipeline.sync

    def counting_execute(self: Any, query: Any, params: Any = None, **kw: Any) -> Any:
        if self.connection._pipeline is None:
            count[0] += 1
        else:
            pending[0] += 1
        return execute(self, query, params, **kw)

    def waited() -> None:
        if pending[0]:
            count[0] += 1
            pending[0] = 0

    def counting_fetchall(self: Any) -> Any:
        waited()
        return fetchall(self)

    def counting_fetchone(self: Any) -> Any:
        waited()
        return fetchone(self)

    def counting_sync(self: Any) -> Any:
        count[0] += 1  # a Sync: a wait for every result sent before it
        pending[0] = 0
        return sync(self)

    def counting_exit(self: Any, *exc: Any) -> Any:
        count[0] += 1  # the pipeline's Sync: one more wait, whatever was fetched
        pending[0] = 0
        return exit_(self, *exc)

    psycopg.Cursor.execute = counting_execute  # type: ignore[method-assign]
    psycopg.Cursor.fetchall = counting_fetchall  # type: ignore[method-assign]
    psycopg.Cursor.fetchone = counting_fetchone  # type: ignore[method-assign]
    psycopg.Pipeline.__exit__ = counting_exit  # type: ignore[method-assign]
    psycopg.Pipeline.sync = counting_sync  # type: ignore[method-assign]
    try:
        return call(), count[0]
    finally:
        psycopg.Cursor.execute = execute  # type: ignore[method-assign]
        psycopg.Cursor.fetchall = fetchall  # type: ignore[method-assign]
        psycopg.Cursor.fetchone = fetchone  # type: ignore[method-assign]
        psycopg.Pipeline.__exit__ = exit_  # type: ignore[method-assign]
        psycopg.Pipeline.sync = sync  # type: ignore[method-assign]
