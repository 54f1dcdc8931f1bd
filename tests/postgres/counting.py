"""Counting the statements a call sends through psycopg, on the client (not timed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import psycopg

T = TypeVar("T")


def messages(call: Callable[[], T]) -> tuple[T, list[str]]:
    """``call()``'s result and every message it sent through psycopg (a statement, or
    several in one simple query), whole, in order: each one a wait for the server."""
    sent: list[str] = []
    execute = psycopg.Cursor.execute

    def recording(self: Any, query: Any, params: Any = None, **kw: Any) -> Any:
        sent.append(str(query))
        return execute(self, query, params, **kw)

    psycopg.Cursor.execute = recording  # type: ignore[method-assign]
    try:
        return call(), sent
    finally:
        psycopg.Cursor.execute = execute  # type: ignore[method-assign]


def _first_line(query: str) -> str:
    return query.split("\n", 1)[0][:80]  # a query's leading comment names it


def statements(call: Callable[[], T]) -> tuple[T, list[str]]:
    """``call()``'s result and the statements it sent (the first line of each, cut to 80
    characters: a query's leading comment names it), transaction control left out (BEGIN,
    COMMIT, ROLLBACK: psycopg's own, sent apart, were never counted)."""
    result, sent = messages(call)
    control = ("BEGIN", "COMMIT", "ROLLBACK")  # (errands' BEGIN names its isolation level)
    return result, [
        _first_line(q)
        for q in sent
        if (_first_line(q).split(";")[0].split() or [""])[0] not in control
    ]


def round_trips(call: Callable[[], T]) -> tuple[T, list[str]]:
    """``call()``'s result and each time it waited for the server: every statement or
    message of several statements sent (the first line of each, cut to 80 characters)."""
    result, sent = messages(call)
    return result, [_first_line(q) for q in sent]
