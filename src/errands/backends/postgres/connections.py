"""The PostgreSQL backend's connections: its two pools, and the budget a worker needs.

A process has two pools:

- the **main pool** (``pool_size``, default 10): errands' own short statements, one at a
  time per caller: claims, heartbeats, outcomes, maintenance, enqueues, steps, reads;
- the **handler pool** (``tx_pool_size``, default the worker's concurrency): one
  connection per open ``ctx.transaction()``, held from its first use to the job's
  completion. Opened on first use, so a process whose handlers never call it opens none.

Handlers holding transactions can therefore never starve the worker's own path: ten
handlers each inside a long ``ctx.transaction()`` leave the main pool to the heartbeats,
claims and the completer. :func:`check_budget` refuses, at worker start-up, a worker that
would need more connections than the server lets it open.

Connections the server closed (a restart or fail-over, ``pg_terminate_backend``,
``idle_session_timeout``) sit in a pool looking healthy until used. :func:`checkout`
looks at each one's socket before handing it out: an idle session receives nothing, so a
readable socket means the server sent its last words ("terminating connection due to
administrator command") and hung up; that connection is discarded (the pool opens a
replacement) and the next one taken. This costs one non-blocking ``poll()`` per checkout
(about 1 us more per checkout, measured), not a round trip (psycopg_pool's
``check_connection`` on each checkout: about 100 us more here).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import random
import select
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigurationError
from ..program import Program, Stmt
from .config import PostgresConfig

log = logging.getLogger("errands.postgres")

try:
    import psycopg
    from psycopg.rows import tuple_row
    from psycopg_pool import ConnectionPool
except ImportError:  # pragma: no cover - backend.py reports the missing extra
    pass

RECONNECT_WINDOW = 5.0  # seconds of backed-off reconnect attempts before starting afresh
# A lost connection is opened again after RECONNECT_FIRST seconds, then doubling up to
# RECONNECT_PAUSE_MAX (each with +-10 % jitter): psycopg_pool's own pace (1 s, then 2, 4 s)
# left a worker without a connection for up to 5 s after a restart of under a second
# whose first attempts it had spent while the server was still away (rescued jobs were
# claimed 5 s late in the chaos soak). An attempt costs the server a refused connection.
RECONNECT_FIRST = 0.1
RECONNECT_PAUSE_MAX = 1.0
POOL_TIMEOUT = 30.0  # seconds a caller waits for a pool connection before PoolTimeout


@functools.cache
def _pool_class() -> Any:
    """ConnectionPool with lost connections opened again at errands' pace (see
    RECONNECT_FIRST), through psycopg_pool's own hook: ``_add_connection(attempt,
    growing)`` and ``AttemptWithBackoff`` (3.2.1 to 3.3 at least). A version without them,
    or whose hook takes other parameters, gets the plain pool and its own pace (logged
    once at debug level): overriding a hook that changed could leave a pool that never
    reconnects."""
    try:
        from psycopg_pool.base import AttemptWithBackoff
    except ImportError:  # pragma: no cover - psycopg_pool older than 3.2.1
        log.debug("psycopg_pool has no AttemptWithBackoff: reconnects at its own pace")
        return ConnectionPool
    hook = getattr(ConnectionPool, "_add_connection", None)
    try:
        params = list(inspect.signature(hook).parameters) if hook is not None else []
    except (TypeError, ValueError):  # pragma: no cover - not introspectable
        params = []
    if params[:3] != ["self", "attempt", "growing"]:  # pragma: no cover - a changed hook
        log.debug("psycopg_pool's _add_connection changed: reconnects at its own pace")
        return ConnectionPool

    class ReconnectSoon(AttemptWithBackoff):  # type: ignore[misc,valid-type]
        """psycopg_pool's reconnect attempt at errands' pace (see RECONNECT_FIRST)."""

        INITIAL_DELAY = RECONNECT_FIRST

        def update_delay(self, now: float) -> None:
            super().update_delay(now)
            jitter = 1.0 + random.uniform(-self.DELAY_JITTER, self.DELAY_JITTER)
            self.delay = min(self.delay, RECONNECT_PAUSE_MAX * jitter)

    class ErrandsPool(ConnectionPool):  # type: ignore[misc,valid-type]
        """A ConnectionPool whose lost connections are opened again at errands' pace."""

        def _add_connection(self, attempt: Any = None, *args: Any, **kwargs: Any) -> None:
            if attempt is None:  # a first attempt: a connection was lost, or is added
                attempt = ReconnectSoon(timeout=self.reconnect_timeout)
            super()._add_connection(attempt, *args, **kwargs)

    return ErrandsPool


def make_pool(
    config: PostgresConfig,
    name: str,
    min_size: int,
    max_size: int,
    reset: Callable[[psycopg.Connection[Any]], None] | None = None,
) -> ConnectionPool:
    """A pool of autocommit connections as errands uses them, not yet open. ``reset``:
    run on each connection given back, off the caller's path (psycopg_pool's worker)."""
    return _pool_class()(
        config.conninfo,
        min_size=min_size,
        max_size=max_size,
        kwargs={"autocommit": True, "prepare_threshold": 5 if config.prepare else None},
        open=False,
        name=name,
        timeout=POOL_TIMEOUT,
        reset=reset,
        # psycopg_pool doubles the pause between reconnect attempts (1, 2, 4, ... s)
        # until reconnect_timeout; after a long outage a worker could sleep a minute
        # past the database's return. Giving up after RECONNECT_WINDOW bounds the
        # pause: the next request for a connection starts a fresh attempt at once.
        reconnect_timeout=RECONNECT_WINDOW,
    )


def reset_session(conn: psycopg.Connection[Any]) -> None:
    """A ``ctx.transaction()`` connection given back by a handler, as the pool gave it:
    tuple rows, autocommit, and no session state a handler set (SET, SET ROLE, LISTEN,
    session advisory locks). A handler's ``dict_row`` made errands' outcome write fail
    (KeyError: 0) on every later job the connection served, and a SET ROLE or
    search_path went on to the next tenant's handler."""
    conn.row_factory = tuple_row  # type: ignore[assignment]
    conn.autocommit = True
    conn.execute("RESET ALL; RESET ROLE; UNLISTEN *; SELECT pg_advisory_unlock_all()")


def server_hung_up(conn: psycopg.Connection[Any]) -> bool:
    """Whether an idle connection was closed by the server (or has anything unasked-for
    to read, which an idle errands session never has: it LISTENs to nothing)."""
    if conn.closed or conn.broken:
        return True
    try:
        fd = conn.pgconn.socket
    except psycopg.OperationalError:  # no socket: the connection is gone
        return True
    if _HAS_POLL:  # no limit on descriptor numbers, unlike select()
        # one poll object per connection and socket, made once (every checkout made and
        # registered one); a socket of another number (never, for one connection) gets
        # its own
        held: tuple[int, Any] | None = getattr(conn, _POLLER, None)
        if held is None or held[0] != fd:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            held = (fd, poller)
            setattr(conn, _POLLER, held)
        return bool(held[1].poll(0))
    return bool(select.select([fd], [], [], 0)[0])  # pragma: no cover - Windows


_HAS_POLL = hasattr(select, "poll")
_POLLER = "_errands_hangup_poller"  # the attribute of a connection holding (fd, poll object)


def checkout(pool: ConnectionPool, timeout: float | None = None) -> psycopg.Connection[Any]:
    """A connection of ``pool`` the server has not closed: each one found closed is
    discarded (the pool opens a replacement in the background) and the next one taken,
    at once. ``timeout``: wait at most that long in all (default: the pool's timeout)."""
    deadline = time.monotonic() + (pool.timeout if timeout is None else timeout)
    for _ in range(pool.max_size + 1):  # after a restart every idle connection is dead
        conn = pool.getconn(timeout=max(deadline - time.monotonic(), 0.0))
        if not server_hung_up(conn):
            return conn
        conn.close()
        pool.putconn(conn)
    # opened after those were discarded
    return pool.getconn(timeout=max(deadline - time.monotonic(), 0.0))


LOST_TRIES = 3  # a call whose connection is lost under it runs at most this many times


@dataclass
class Progress:
    """How far a call got on its connection (see PostgresBackend._again_if_lost)."""

    conn: psycopg.Connection[Any] | None = None  # checked out: something may be sent
    committing: bool = False  # what is sent from here on may commit
    # Whether the connection was gone when the call's error came, read before the pool
    # has it back (None: not read). Read afterwards, a connection the pool closed on its
    # return (past max_lifetime, the pool closing) made a refused statement look like a
    # lost connection: a certain failure reported as EnqueueUncertain, or run again.
    lost: bool | None = None


def lost(conn: psycopg.Connection[Any] | None) -> bool:
    """After an error on ``conn``: whether the connection itself is gone (the server went
    away or ended the session), as opposed to a statement the server refused."""
    return conn is not None and (conn.broken or conn.closed)


# What identifies a database of a running PostgreSQL instance, however it is reached
# (host name, address, Unix socket, a pooler): its name, the port the server listens on
# (not inet_server_port(), NULL over a Unix socket) and when its postmaster started.
IDENTITY_SQL = "SELECT current_database(), current_setting('port')::int, pg_postmaster_start_time()"
Identity = tuple[str, int, Any]


def identity(conn: psycopg.Connection[Any]) -> Identity:
    row = conn.execute(IDENTITY_SQL).fetchone()
    assert row is not None
    return (row[0], row[1], row[2])


def identity_of_caller(status: Any, autocommit: bool) -> Program[Identity]:
    """:func:`identity` asked on a caller's connection (sync or async: a program) without
    disturbing its transaction: inside a savepoint when one is open (an error rolls back
    to it, never aborting the caller's work); when none is open and autocommit is off,
    the question opens the transaction the enqueue would open anyway (rolled back after
    a refusal). ``status``: the connection's transaction status."""
    if status == psycopg.pq.TransactionStatus.IDLE and not autocommit:
        try:
            rows = yield Stmt(IDENTITY_SQL)  # opens the transaction the enqueue would open
        except BaseException:
            with contextlib.suppress(Exception):
                yield Stmt("ROLLBACK")  # and leaves none open if the question failed
            raise
        return (rows[0][0], rows[0][1], rows[0][2])
    if status != psycopg.pq.TransactionStatus.INTRANS:
        rows = yield Stmt(IDENTITY_SQL)
        return (rows[0][0], rows[0][1], rows[0][2])
    yield Stmt("SAVEPOINT errands_identity")
    try:
        rows = yield Stmt(IDENTITY_SQL)
    except BaseException:
        yield Stmt("ROLLBACK TO SAVEPOINT errands_identity")
        yield Stmt("RELEASE SAVEPOINT errands_identity")
        raise
    yield Stmt("RELEASE SAVEPOINT errands_identity")
    return (rows[0][0], rows[0][1], rows[0][2])


# The connections this session's role may open, from the tightest of the server's limits:
# max_connections less the slots reserved for superusers (and, from PostgreSQL 16, for
# pg_use_reserved_connections), the role's CONNECTION LIMIT, the database's.
LIMITS_SQL = """
SELECT current_setting('max_connections')::int,
       current_setting('superuser_reserved_connections')::int
         + coalesce(nullif(current_setting('reserved_connections', true), ''), '0')::int,
       r.rolsuper, r.rolconnlimit, d.datconnlimit, current_user, current_database()
FROM pg_roles r, pg_database d
WHERE r.rolname = current_user AND d.datname = current_database()
"""


@dataclass(frozen=True)
class Budget:
    """The most connections one worker process opens to PostgreSQL."""

    pool_size: int  # the main pool
    handlers: int  # the handler pool (ctx.transaction())
    listen: int  # the LISTEN connection: 1, or 0 with listen=false

    @property
    def total(self) -> int:
        return self.pool_size + self.handlers + self.listen

    def describe(self, concurrency: int, tx_pool_size: int | None) -> str:
        if tx_pool_size is not None:
            handlers = f"tx_pool_size={tx_pool_size} for handlers' ctx.transaction()"
        else:
            handlers = (
                f"{self.handlers} for handlers' ctx.transaction(), one per handler "
                f"(-c {concurrency})"
            )
        listen = " + 1 LISTEN connection" if self.listen else ""
        return f"pool_size={self.pool_size} + {handlers}{listen}"


def server_limit(conn: psycopg.Connection[Any]) -> tuple[int, str, str]:
    """How many connections this session's role may open here, why, and how to raise it."""
    row = conn.execute(LIMITS_SQL).fetchone()
    assert row is not None  # the current role and database always exist
    max_connections, reserved, superuser, role_limit, db_limit, role, dbname = row
    limits = [
        (
            max_connections - (0 if superuser else reserved),
            f"max_connections={max_connections}"
            + ("" if superuser or not reserved else f" less {reserved} reserved for superusers"),
            "raise max_connections",
        )
    ]
    if role_limit >= 0 and not superuser:
        limits.append(
            (
                role_limit,
                f"role {role!r} has CONNECTION LIMIT {role_limit}",
                "raise the role's CONNECTION LIMIT",
            )
        )
    if db_limit >= 0 and not superuser:
        limits.append(
            (
                db_limit,
                f"database {dbname!r} has CONNECTION LIMIT {db_limit}",
                "raise the database's CONNECTION LIMIT",
            )
        )
    return min(limits)


def check_budget(conn: psycopg.Connection[Any], config: PostgresConfig, concurrency: int) -> Budget:
    """The connections a worker running ``concurrency`` handlers at once may open; raise
    ConfigurationError, naming the settings and the fix, when the server allows fewer."""
    budget = Budget(
        pool_size=config.pool_size,
        handlers=config.tx_pool_size or concurrency,
        listen=1 if config.listen else 0,
    )
    allowed, why, raise_it = server_limit(conn)
    if budget.total > allowed:
        fixes = []
        room = allowed - config.pool_size - budget.listen  # left for the handler pool
        if room >= 1 and config.tx_pool_size is None:
            fixes.append(
                f"lower -c (--concurrency) to at most {room}, counting the express lane "
                "of a worker serving a fair queue (--express, default -c / 2; 0: off)"
            )
            fixes.append(
                "if at most N handlers use ctx.transaction() at once, add tx_pool_size=N "
                f"(N <= {room}) to the URL"
            )
        elif room >= 1:
            fixes.append(f"lower tx_pool_size to at most {room}")
        if allowed - budget.listen - budget.handlers >= 2:  # pool_size's smallest value
            fixes.append(f"lower pool_size to at most {allowed - budget.listen - budget.handlers}")
        fixes.append(raise_it)
        raise ConfigurationError(
            f"this worker may open {budget.total} connections to PostgreSQL at "
            f"{config.display} ({budget.describe(concurrency, config.tx_pool_size)}), but the "
            f"server lets it open at most {allowed} ({why}): {'; or '.join(fixes)} (see "
            "'Sizing connections' in docs/postgres.md)"
        )
    return budget
