"""Several statements in one message: queries prepared on the server by name, run by
``EXECUTE`` inside a multi-statement simple query.

A limited claim on PostgreSQL waited for the server six times (BEGIN, its first
statement, a fair queue's window and lookahead, the write, COMMIT), each wait then a wait
for the GIL among the worker's busy threads. psycopg's pipeline mode would send them
together, but it sends each statement as it is executed, and the server counts a
transaction idle (so that ``idle_in_transaction_session_timeout`` ends it) only after a
Sync: a claimer cut off between its statements held the queue's claim lock for the whole
cut. A simple query is one message: the server runs its statements one after another,
each with a snapshot of its own (READ COMMITTED), and counts the transaction idle once it
has answered them all. Prepared once per connection (``PREPARE``), its statements are
planned once, not at each claim.

Only where the server keeps prepared statements for the session: not behind PgBouncer in
transaction mode (``?prepare=false``), where the claim sends its statements one by one.
"""

from __future__ import annotations

import hashlib
import re
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import pq, sql

PREFIX = "errands_"  # prepared statements' names: errands_<digest>_<query name>
_PARAM = re.compile(r"%\((\w+)\)s")


class Prepared:
    """Named queries prepared on the server, per connection, and the ``EXECUTE`` that
    runs each with given parameters (rendered as literals, quoted by psycopg)."""

    def __init__(self, queries: dict[str, str], names: Sequence[str]) -> None:
        self._order: dict[str, list[str]] = {}  # query -> its parameters, as numbered
        self._name: dict[str, str] = {}  # query -> its prepared statement's name
        self._prepare: dict[str, str] = {}
        for name in names:
            order: list[str] = []

            def number(match: re.Match[str], order: list[str] = order) -> str:
                if match[1] not in order:
                    order.append(match[1])
                return f"${order.index(match[1]) + 1}"

            text = _PARAM.sub(number, queries[name]).replace("%%", "%")
            # Named by its text (schema included): behind a pooler a server connection
            # may hold another schema's or another version's statements; a name found
            # there is this very statement.
            digest = hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:12]
            self._order[name] = order
            self._name[name] = f"{PREFIX}{digest}_{name}"
            self._prepare[name] = f"PREPARE {self._name[name]} AS\n{text}"
        self._known: weakref.WeakKeyDictionary[psycopg.Connection[Any], set[str]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def ensure(self, conn: psycopg.Connection[Any]) -> bool:
        """Prepare on ``conn`` what it lacks, once per connection (two round trips: which
        of them the server has, then the others in one message); True when it prepared
        any. A statement the server has already under its name (prepared before this
        process knew: by an earlier claim whose connection was forgotten, or through a
        pooler) is the same statement, and is taken as is. ``conn`` must be idle, outside
        a transaction (a failed PREPARE would abort it)."""
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            raise RuntimeError("Prepared.ensure: the connection is in a transaction")
        with self._lock:
            known = self._known.setdefault(conn, set())
            missing = [name for name in self._prepare if name not in known]
        if not missing:
            return False
        try:
            found = {
                row[0]
                for row in conn.execute(
                    "SELECT name FROM pg_prepared_statements WHERE name = ANY(%s)",
                    [[self._name[name] for name in missing]],
                )
            }
            absent = [name for name in missing if self._name[name] not in found]
            if absent:
                conn.execute(";\n".join(self._prepare[name] for name in absent))
        except BaseException:
            self.forget(conn)  # some may be prepared: asked again next time
            raise
        with self._lock:
            known.update(missing)
        return bool(absent)

    def forget(self, conn: psycopg.Connection[Any]) -> None:
        """``conn`` lost its prepared statements (the server said so): prepare them anew."""
        with self._lock:
            self._known.pop(conn, None)

    def execute(self, conn: psycopg.Connection[Any], name: str, params: dict[str, Any]) -> str:
        """The statement that runs query ``name`` with ``params``."""
        values = ", ".join(_literal(params[k], conn) for k in self._order[name])
        return f"EXECUTE {self._name[name]}({values})" if values else f"EXECUTE {self._name[name]}"


def _literal(value: Any, conn: psycopg.Connection[Any]) -> str:
    """``value`` as an EXECUTE argument. Integers, lists of them, None and booleans are
    written here (a claim's 70 ids through psycopg's adapters took 0.15 ms, a tenth of a
    fair claim's Python); anything else is quoted by psycopg. An array is left untyped:
    the server reads it as the prepared parameter's type."""
    kind = type(value)
    if kind is int:
        return str(value)
    if value is None:
        return "NULL"
    if kind is bool:
        return "true" if value else "false"
    if kind is list and all(type(v) is int for v in value):
        return "'{" + ",".join(map(str, value)) + "}'"
    return sql.Literal(value).as_string(conn)


def run_batch(
    conn: psycopg.Connection[Any], statements: Sequence[str]
) -> list[list[tuple[Any, ...]] | None]:
    """``statements`` as one simple query: each one's rows (None for a statement that
    returns none, such as BEGIN or COMMIT), in order."""
    cur = conn.execute(";\n".join(statements))  # type: ignore[arg-type]
    results: list[list[tuple[Any, ...]] | None] = []
    while True:
        results.append(cur.fetchall() if returns_rows(cur) else None)
        if not cur.nextset():
            return results


def returns_rows(cur: psycopg.Cursor[Any]) -> bool:
    """Whether the cursor's current result is a statement's rows (none or more), as
    ``cur.description is not None`` says without building its columns' descriptions
    (a claim's results have some 50 columns: 0.1 ms of a claim, each time)."""
    res = cur.pgresult
    return res is not None and (res.nfields > 0 or res.status in _ROWS)


_ROWS = frozenset(
    s for s in pq.ExecStatus if s.name in ("TUPLES_OK", "SINGLE_TUPLE", "TUPLES_CHUNK")
)
