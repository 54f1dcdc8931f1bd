"""Which errors came from errands' own transaction connection of ``ctx.transaction()``.

A handler's failure is given back uncharged as the store's (a store that cannot write
now: :meth:`errands.worker.runtime.AttemptRuntime.met_unwritable`) only when it came from
that connection: raised through errands' wrapper of it (its statements, its cursors'), by
its opening, by a step stored in it, or by an enqueue given it as ``conn=``. Those errors
are marked here, on the exception itself. An error of the same kind from anywhere else (a
database of the handler's own, a file it cannot open, one it raised itself) is the
handler's, and charged: taken for the store's, a job whose handler opened the transaction
and then met such an error of its own was given back for ever, never charged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

# On an exception: it was raised by errands' transaction connection
FROM_TRANSACTION = "errands_from_transaction"
# On a driver connection: errands opened a transaction of ctx.transaction() on it (an
# SQLite connection of its own; a connection of the PostgreSQL handler pool, which holds
# nothing else)
TRANSACTION_CONNECTION = "errands_transaction_connection"


def mark_from_transaction(exc: BaseException) -> None:
    """Mark ``exc`` as raised by errands' transaction connection."""
    with contextlib.suppress(Exception):  # (an exception that takes no attribute: unmarked)
        setattr(exc, FROM_TRANSACTION, True)


def from_transaction(exc: BaseException) -> bool:
    """Whether ``exc`` was marked by :func:`mark_from_transaction`."""
    try:
        return getattr(exc, FROM_TRANSACTION, False) is True
    except Exception:
        return False


def mark_connection(conn: Any) -> None:
    """Note on ``conn`` that it holds a transaction of ctx.transaction()."""
    with contextlib.suppress(Exception):
        setattr(conn, TRANSACTION_CONNECTION, True)


def is_transaction_connection(conn: Any) -> bool:
    """Whether ``conn`` is a connection of ctx.transaction(), bare (``.raw``) or as errands
    hands it to the handler (whose wrapper passes the attribute through)."""
    try:
        return getattr(conn, TRANSACTION_CONNECTION, False) is True
    except Exception:
        return False


@contextlib.contextmanager
def marking(conn: Any) -> Iterator[None]:
    """Around a write errands makes on ``conn`` (an enqueue's ``conn=``): its error is
    marked as the transaction connection's when ``conn`` is one."""
    try:
        yield
    except Exception as exc:
        if conn is not None and is_transaction_connection(conn):
            mark_from_transaction(exc)
        raise
