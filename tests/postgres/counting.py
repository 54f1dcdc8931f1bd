"""Counting the statements a call sends through psycopg, on the client (not timed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import psycopg

T = TypeVar("T")


def statements(call: Callable[[], T]) -> tuple[T, list[str]]:
    """``call()``'s result and the statements it sent (the first line of each, cut to 80
    characters: a query's leading comment names it), transaction control left out (BEGIN,
    COMMIT, ROLLBACK: psycopg's own, sent apart, were never counted)."""
    sent: list[str] = []
    execute = psycopg.Cursor.execute

    def counting(self: Any, query: Any, params: Any = None, **kw: Any) -> Any:
        first = str(query).split("\n", 1)[0][:80]
        if first.split(";")[0].strip() not in ("BEGIN", "COMMIT", "ROLLBACK"):
            sent.append(first)
        return execute(self, query, params, **kw)

    psycopg.Cursor.execute = counting  # type: ignore[method-assign]
    try:
        return call(), sent
    finally:
        psycopg.Cursor.execute = execute  # type: ignore[method-assign]


def round_trips(call: Callable[[], T]) -> tuple[T, list[str]]:
    """``call()``'s result and each time it waited for the server: every statement or
    message of several statements sent (the first line of each, cut to 80 characters)."""
    sent: list[str] = []
    execute = psycopg.Cursor.execute

    def counting(self: Any, query: Any, params: Any = None, **kw: Any) -> Any:
        sent.append(str(query).split("\n", 1)[0][:80])
        return execute(self, query, params, **kw)

    psycopg.Cursor.execute = counting  # type: ignore[method-assign]
    try:
        return call(), sent
    finally:
        psycopg.Cursor.execute = execute  # type: ignore[method-assign]
