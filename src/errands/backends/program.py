"""Statement programs: SQL logic written once, driven on a sync or an async connection.

Enqueueing inside a caller's transaction runs on whatever connection the caller holds: a
``sqlite3`` or psycopg connection (sync), or an aiosqlite or psycopg ``AsyncConnection``
(async, also behind an SQLAlchemy ``AsyncSession``/``AsyncConnection``). Rather than
write every such call twice (procrastinate's cost), the logic is a generator that
*yields* the statements it wants run and *receives* their rows (sans-I/O)::

    def insert(req):
        rows = yield Stmt(Q["job_insert"], params)
        return rows[0][0]

    run(conn, insert(req))              # a sync connection
    await arun(aconn, insert(req))      # an async one: the same statements, awaited

A statement that fails is thrown into the program at its ``yield``, which may handle it
(roll back to a savepoint) or let it propagate. A program may also yield a :class:`Call`
(a function of the connection, for what only a sync driver offers, such as PostgreSQL's
COPY); only sync programs do.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Stmt:
    """Run ``sql`` with ``params``; the program receives every row it returns (a list)."""

    sql: str
    params: Any = None


@dataclass(frozen=True, slots=True)
class Call:
    """Call ``fn(conn)`` (sync drivers only); the program receives what it returns."""

    fn: Callable[[Any], Any]


Program = Generator[Stmt | Call, Any, T]


def run(conn: Any, program: Program[T]) -> T:
    """Drive ``program`` on a sync DB-API connection (sqlite3, psycopg)."""
    try:
        step = next(program)
        while True:
            try:
                if isinstance(step, Call):
                    answer = step.fn(conn)
                else:
                    cur = tuple_cursor(conn)
                    cur.execute(step.sql, step.params or ())
                    answer = cur.fetchall() if cur.description else []
            except Exception as exc:  # the program may handle it (a savepoint, a rollback)
                step = program.throw(exc)
                continue
            step = program.send(answer)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


async def arun(conn: Any, program: Program[T]) -> T:
    """Drive ``program`` on an async connection (aiosqlite, psycopg AsyncConnection):
    each statement is awaited, so the event loop never blocks on the database."""
    try:
        step = next(program)
        while True:
            if isinstance(step, Call):  # pragma: no cover - async programs yield none
                raise TypeError("a Call cannot run on an async connection")
            try:
                cur = await atuple_cursor(conn)
                await cur.execute(step.sql, step.params or ())
                answer = await cur.fetchall() if cur.description else []
            except Exception as exc:
                step = program.throw(exc)
                continue
            step = program.send(answer)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def tuple_cursor(conn: Any) -> Any:
    """A cursor of ``conn`` whose rows are tuples, whatever row factory the caller gave
    the connection (psycopg's ``dict_row``, a sqlite3 ``row_factory``): programs read
    columns by position. With a caller's dict rows, an enqueue in autocommit mode was
    stored and then failed reading its own id (KeyError: 0): a retry stored it twice."""
    if _is_psycopg(conn):
        from psycopg.rows import tuple_row

        return conn.cursor(row_factory=tuple_row)
    cur = conn.cursor()  # sqlite3: the connection's factory is the cursor's default
    cur.row_factory = None
    return cur


def _is_psycopg(conn: Any) -> bool:
    """A psycopg connection, sync or async, a subclass of one included (told apart by
    the module its class is defined in, a subclass of psycopg.Connection was taken
    for sqlite3's)."""
    return _psycopg_class(type(conn))  # type: ignore[arg-type]


@functools.cache
def _psycopg_class(kind: type) -> bool:  # once per connection class: every statement asks
    return any(c.__module__.startswith("psycopg") for c in kind.__mro__)


async def atuple_cursor(conn: Any) -> Any:
    """:func:`tuple_cursor` for an async connection (psycopg, aiosqlite)."""
    if _is_psycopg(conn):
        from psycopg.rows import tuple_row

        return conn.cursor(row_factory=tuple_row)
    cur = await conn.cursor()
    cur.row_factory = None
    return cur


def is_async_connection(conn: Any) -> bool:
    """Whether ``conn`` is an async driver connection or an SQLAlchemy async object."""
    module = type(conn).__module__
    return module.startswith(("aiosqlite", "sqlalchemy.ext.asyncio")) or (
        module.startswith("psycopg") and type(conn).__name__ == "AsyncConnection"
    )


def unwrap_connection(conn: Any) -> Any:
    """The DB-API connection behind a SQLAlchemy ``Session`` or ``Connection``, in the
    transaction it has open or begins now, as a statement of its own would; else ``conn``.
    SQLAlchemy's ``commit()`` commits only a transaction it began: a job written first on
    a connection used commit-as-you-go was rolled back when the connection went back to
    its pool, and the caller held the handle of a job that never was. An async connection
    is refused, naming the call that takes it."""
    if is_async_connection(conn):
        from ..errors import ConfigurationError

        raise ConfigurationError(
            f"conn= is an async connection ({type(conn).__name__}): a synchronous enqueue "
            "cannot use it; await job.aenqueue(..., conn=...) (or app.aenqueue_many) instead"
        )
    if type(conn).__module__.startswith("sqlalchemy"):
        if hasattr(conn, "get_bind") and hasattr(conn, "connection"):  # a Session
            conn = conn.connection()  # (its transaction: begun by this if not yet)
        elif hasattr(conn, "in_transaction") and not conn.in_transaction():
            conn.begin()
        dbapi = getattr(conn, "connection", None)  # Connection -> PoolProxiedConnection
        driver = getattr(dbapi, "driver_connection", None)
        if driver is not None:
            return driver
    return conn


async def async_driver_connection(conn: Any) -> Any:
    """The async driver connection behind an SQLAlchemy ``AsyncSession`` or
    ``AsyncConnection`` (in the transaction it has open, or begins now: see
    :func:`unwrap_connection`), else ``conn``."""
    if not type(conn).__module__.startswith("sqlalchemy.ext.asyncio"):
        return conn
    if hasattr(conn, "get_bind"):  # an AsyncSession: its connection, in its transaction
        conn = await conn.connection()
    elif not conn.in_transaction():
        await conn.begin()
    raw = await conn.get_raw_connection()
    return raw.driver_connection


# An enqueue of several statements in a caller's transaction: its savepoint's statements.
SAVEPOINT = "SAVEPOINT errands_enqueue"
ROLLBACK_TO_SAVEPOINT = "ROLLBACK TO SAVEPOINT errands_enqueue"
RELEASE_SAVEPOINT = "RELEASE SAVEPOINT errands_enqueue"


@contextlib.contextmanager
def savepoint(conn: Any, errors: tuple[type[Exception], ...]) -> Iterator[None]:
    """A savepoint in the caller's open transaction around an enqueue of several
    statements: a failure midway takes back what it wrote and leaves the transaction
    usable. ``errors``: the driver's, suppressed while rolling back to it (a lost
    connection: the enqueue's own error is the one raised)."""
    conn.execute(SAVEPOINT)
    try:
        yield
    except BaseException:
        with contextlib.suppress(*errors):
            conn.execute(ROLLBACK_TO_SAVEPOINT)
            conn.execute(RELEASE_SAVEPOINT)
        raise
    conn.execute(RELEASE_SAVEPOINT)


@contextlib.asynccontextmanager
async def asavepoint(conn: Any, errors: tuple[type[Exception], ...]) -> AsyncIterator[None]:
    """:func:`savepoint` on an async connection (psycopg, aiosqlite)."""
    await conn.execute(SAVEPOINT)
    try:
        yield
    except BaseException:
        with contextlib.suppress(*errors):
            await conn.execute(ROLLBACK_TO_SAVEPOINT)
            await conn.execute(RELEASE_SAVEPOINT)
        raise
    await conn.execute(RELEASE_SAVEPOINT)
