"""The PostgreSQL backend: many workers on many machines share one database.

Claims lock due rows with ``FOR UPDATE SKIP LOCKED`` over a partial index of pending jobs,
one statement for all of a worker's queues. Batches (outcomes, heartbeats, releases,
rescues, bulk inserts) travel as arrays through ``unnest()``: one round trip per batch,
not per job. Every write to a running job is fenced by its lease token. Time is the
database's ``now()``.

Wake-ups: enqueue sends ``pg_notify`` in the enqueuing transaction, at most once per queue
per ``notify_window`` per process (NOTIFY takes a database-wide lock at commit, so never
one per insert under load); see :mod:`.notifier` for the listening side. Polling always
remains, so PgBouncer in transaction mode (no LISTEN) still works.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from operator import itemgetter
from typing import Any, TypeVar

from ... import offloop
from ...errors import (
    ConfigurationError,
    DatabaseBusy,
    EnqueueUncertain,
    SchemaOutdated,
    busy_as,
)
from ...faults import fault_point
from ...forking import forget_at_fork, reset_at_fork
from ...interrupts import enter_shield, leave_shield
from ...jobs import EnqueueRequest, JobRow, Step, to_datetime
from ...jsontext import loads_stored
from ..base import (
    PROMOTE_BATCH,
    RELEASED,
    Capabilities,
    ClaimParams,
    CronState,
    ExpiredLease,
    FinishParams,
    HeartbeatResult,
    InsertResult,
    LeaseRef,
    QueueClaim,
    QueueSettings,
    RescueParams,
    connection_wait,
    insert_params,
    lock_wait,
    release_pauses,
    warn_newer_schema,
    writes_several,
)
from ..fair import HALF_LIFE, Weigher, handler_seconds
from ..limits import claim_limited
from ..program import (
    Call,
    Program,
    Stmt,
    arun,
    asavepoint,
    async_driver_connection,
    run,
    savepoint,
    tuple_cursor,
    unwrap_connection,
)
from ..shared_admin import LOCK_CONFLICT_TRIES, suspend_program
from ..sqlfile import load_migrations, load_queries
from ..workflow_store import (
    ENDED,
    WorkflowInserted,
    WorkflowSpec,
    WorkflowStore,
    split_children,
)
from .admin import PostgresAdmin
from .batches import Prepared, returns_rows, run_batch
from .config import (
    CONNECT_TIMEOUT_DEFAULT,
    POOL_SIZE_DEFAULT,
    PostgresConfig,
    parse_postgres_url,
)
from .connections import (
    LOST_TRIES,
    Progress,
    check_budget,
    checkout,
    identity,
    identity_of_caller,
    lost,
    make_pool,
    reset_session,
)
from .lost_claims import LostClaims

try:
    import psycopg
    from psycopg import errors as pg_errors
    from psycopg import sql as pg_sql
    from psycopg.rows import tuple_row
    from psycopg_pool import ConnectionPool
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ConfigurationError(
        "PostgreSQL support needs the postgres extra: pip install 'errands[postgres]'"
    ) from exc

log = logging.getLogger("errands.postgres")
IDLE = psycopg.pq.TransactionStatus.IDLE  # no transaction open on the connection

T = TypeVar("T")

MIGRATE_LOCK_KEY = 7_203_148_551  # pg_advisory_xact_lock key for `errands migrate`
# How long `errands migrate` waits for a lock on errands' tables (the whole transaction,
# every migration; 0017-0019 also set it themselves). A migration's DDL waits for every
# open transaction that touched its table (a caller's that enqueued, a handler's
# ctx.transaction()), and every claim, heartbeat and enqueue queues behind its request
# meanwhile: so it gives up, rolls back whole, and says to run it again.
MIGRATE_LOCK_TIMEOUT = "5s"
# A keyed insert that found its key taken, the key then freed by another caller before
# it could read who holds it, tries again: this many times at most (see _insert_program).
KEY_TRIES = 5
# One of errands' own transactions idling longer than this is ended by the server
# (idle_limit: half the lease, within these bounds, in seconds).
IDLE_MIN, IDLE_MAX = 1.0, 5.0
CANCEL_TIMEOUT = 10.0  # seconds a cancel request for an abandoned handler may take
ABANDON_WARN_AFTER = 5  # cancels sent before saying an abandoned handler keeps its connection

# A job's columns as every read of whole jobs returns them (a claim's rows too). Times as
# seconds since the epoch by date_part, which computes a float8: extract(epoch ...) makes
# an exact numeric that ::float8 converts again, ~4 x the server's work per value (7 a
# row: ~1 us of server CPU a claimed job); equal on a million random times.
JOB_COLUMNS_SQL = ", ".join(
    [
        "j.id", "j.name", "j.queue", "j.args::text", "j.meta::text", "j.state", "j.priority",
        "j.attempt", "j.max_attempts", "date_part('epoch', j.run_at)",
        "j.idempotency_key", "j.errors::text", "j.result::text",
        "date_part('epoch', j.inserted_at)", "date_part('epoch', j.attempted_at)",
        "date_part('epoch', j.finished_at)", "j.lease_owner", "j.lease_token",
        "date_part('epoch', j.lease_expires_at)", "j.rescues",
        "j.cancel_requested::int", "j.timeout", "j.lease_seconds", "j.discarded_by",
        "j.discard_reason", "j.parent_id", "date_part('epoch', j.unique_until)",
        "j.progress", "j.progress_message", "j.wait_signal",
        "date_part('epoch', j.wait_until)", "j.fair_key", "j.workflow_id",
    ]
)  # fmt: skip

# Bulk enqueue by COPY (`job_copy`): the columns every job sets, then the optional ones in
# the order of the values `_copy` computes, each with the test of whether a job sets it
# (a column no job of the batch sets is left out and keeps its default).
COPY_REQUIRED = ("id", "name", "queue", "args", "state", "max_attempts", "run_at")
COPY_OPTIONAL: tuple[tuple[str, Callable[[EnqueueRequest], Any]], ...] = (
    ("meta", lambda r: r.meta),
    ("priority", lambda r: r.priority),
    ("timeout", lambda r: r.timeout is not None),
    ("lease_seconds", lambda r: r.lease_seconds is not None),
    ("parent_id", lambda r: r.parent_id is not None),
    ("unique_until", lambda r: r.unique_for is not None),
    ("concurrency_key", lambda r: r.concurrency_key is not None),
    ("concurrency_limit", lambda r: r.concurrency_limit is not None),
    ("rate_limit", lambda r: r.rate_limit is not None),
    ("rate_period", lambda r: r.rate_period is not None),
    ("fair_key", lambda r: r.fair_key is not None),
)


def _copy_plain(r: EnqueueRequest) -> bool:
    """True when the job sets none of COPY_OPTIONAL (kept in step with it)."""
    return (
        not r.meta
        and not r.priority
        and r.timeout is None
        and r.lease_seconds is None
        and r.parent_id is None
        and r.unique_for is None
        and r.concurrency_key is None
        and r.concurrency_limit is None
        and r.rate_limit is None
        and r.fair_key is None
    )


# The fold of a write none of whose jobs has a fair key (as the worker's claimed rows
# said): an unreferenced CTE that reads nothing, so the write touches no fairness table.
NO_FOLD = "fold AS (SELECT NULL)"
# The statements that end attempts: each also has a "<name>_plain" variant without the fold.
FOLDING = ("job_finish_many", "job_complete_many", "job_release_many", "job_rescue_many")


def fill_markers(text: str, schema: str, *, fold: bool = True) -> str:
    quoted = '"' + schema + '"'  # validated by parse_postgres_url: [a-z_][a-z0-9_]*
    # SQL of this file, no value:
    cte = _RAW_QUERIES["fair_fold_cte"].format(schema=quoted) if fold else NO_FOLD
    due = _RAW_QUERIES["fair_due"].format(schema=quoted)
    channel = f"'{done_channel(schema)}'"
    notify = _RAW_QUERIES["notify_ended_cte"].format(done_channel=channel)
    dead = _RAW_QUERIES["dead_locked_cte"].format(schema=quoted)
    return text.format(
        schema=quoted, job_columns=JOB_COLUMNS_SQL, fair_fold=cte, fair_due=due,
        notify_ended=notify, done_channel=channel, dead_locked=dead,
    )  # fmt: skip


def filled_queries(schema: str) -> dict[str, str]:
    """Every named query with its markers filled, and the plain variants of FOLDING, each
    as sent: without its comment lines but the first (which names it in pg_stat_activity
    and in the tests' counts)."""
    queries = {name: fill_markers(text, schema) for name, text in _RAW_QUERIES.items()}
    for name in FOLDING:
        queries[f"{name}_plain"] = fill_markers(_RAW_QUERIES[name], schema, fold=False)
    return {name: _compact(text) for name, text in queries.items()}


def _compact(text: str) -> str:
    """``text`` without its whole-line comments after the first line. psycopg converts a
    query longer than 4,096 characters anew at each execution (it caches shorter ones):
    fair_heads, 4,841 with its comments, cost its fair claim 0.2 ms of the GIL each."""
    first, _, rest = text.partition("\n")
    kept = [line for line in rest.splitlines() if not line.lstrip().startswith("--")]
    return "\n".join([first, *kept])


def _lean_completion(outcome: FinishParams) -> bool:
    """An outcome job_complete_many writes as job_finish_many would: a completion."""
    return outcome.state == "completed" and outcome.error is None


def folding(name: str, fair: Sequence[bool | None]) -> str:
    """``name``, or its plain variant when no job it ends has a fair key."""
    return name if any(f is not False for f in fair) else f"{name}_plain"


_RAW_QUERIES = load_queries(__package__) | load_queries(__package__, "workflows.sql")
MIGRATIONS = load_migrations(__package__)
SCHEMA_VERSION = MIGRATIONS[-1][0]


# What a child forked from a process that opened a backend let go of: the parent's pools
# (and through them its connections). Kept referenced here for the child's life, so that
# nothing in the child ever closes them, nor collects them: closing one sends Terminate on
# the parent's socket (its session ends under it), and a pool collected runs its __del__,
# which takes the parent's pool locks as the fork copied them (held by a thread that does
# not exist in the child: a hang). See PostgresBackend._forked.
_INHERITED: list[Any] = []


def channel_name(schema: str) -> str:
    return f"errands_jobs_{schema}"


def done_channel(schema: str) -> str:
    """Where the ids of ended jobs are announced (results.py listens)."""
    return f"errands_done_{schema}"


class PostgresBackend(PostgresAdmin):
    capabilities = Capabilities(
        listen_notify=True, skip_locked=True, caller_connection="psycopg.Connection"
    )

    def __init__(self, url: str, *, auto_migrate: bool | None = None) -> None:
        self.url = url
        # Where each fair queue's rotation over its keys stands (errands.backends.limits):
        # this process's own, never stored (no row that every claim would update).
        self._fair_cursors: dict[str, str] = {}
        self.config: PostgresConfig = parse_postgres_url(url)
        self.schema = self.config.schema
        self.q = filled_queries(self.schema)
        # Made once here, not as cached properties: on Python 3.11 those take one lock
        # shared by every instance, which a fork could copy held (the child's first
        # enqueue would then wait for good). lock_bound's statement without its
        # comments; job_insert as bytes: psycopg encoded the text (and hashed the new
        # bytes to find its parsed form) at every call. Its text is ASCII (the schema name
        # is: see config), the same bytes in every client encoding; else the text.
        self._lock_bound = "\n".join(
            line for line in self.q["lock_bound"].splitlines() if not line.startswith("--")
        )
        insert = self.q["job_insert"]
        self._job_insert_sql: str | bytes = insert.encode("ascii") if insert.isascii() else insert
        self._set_idle(30.0)  # configure_worker sets it from the app's lease
        # A limited claim's statements, prepared on the server per connection (batches.py)
        self._prepared = Prepared(self.q, BATCHED) if self.config.prepare else None
        # Claims whose reply was lost: their jobs are given back (lost_claims.py)
        self._lost_claims = LostClaims(lambda wait: self._conn(wait), self._undo_claims)
        self.channel = channel_name(self.schema)
        self._last_notify: dict[str, float] = {}
        self._notify_lock = threading.Lock()
        try:  # fail fast, with one clear line, before the pool starts retrying
            psycopg.connect(
                self.config.conninfo, connect_timeout=int(CONNECT_TIMEOUT_DEFAULT)
            ).close()
        except psycopg.Error as exc:
            raise ConfigurationError(
                f"cannot connect to PostgreSQL at {self.config.display}: "
                f"{str(exc).strip().splitlines()[0]}. Is the server running and the URL right "
                "(postgresql://user@host:5432/dbname)?"
            ) from None
        self.pool = make_pool(self.config, "errands", 1, self.config.pool_size)
        # Handlers' ctx.transaction() connections: a pool of their own, opened on first use
        # and sized by configure_worker, so they never starve the worker's own statements.
        self._handler_pool: ConnectionPool | None = None
        self._handler_pool_size: int | None = self.config.tx_pool_size  # None: no worker yet
        self._handler_lock = threading.Lock()
        # In a forked child, the main pool is opened at its first use (see _forked)
        self._reopen = False
        self._reopen_lock = threading.Lock()
        try:
            self.pool.open(wait=True, timeout=CONNECT_TIMEOUT_DEFAULT)
        except Exception as exc:
            self.pool.close()
            raise ConfigurationError(
                f"cannot connect to PostgreSQL at {self.config.display}: {exc}. Is the server "
                "running and the URL right (postgresql://user@host:5432/dbname)?"
            ) from None
        reset_at_fork(self)  # its pools are let go of in a forked child (_forked)
        with self._conn() as conn:
            # enqueue(conn=): a caller's connection spelled like this reaches our database
            self._address = (conn.info.host, conn.info.port, conn.info.dbname)
            self._identity = identity(conn)  # which server and database that is
        # the verdict on each caller's connection seen, kept as long as that object lives
        self._verdicts: weakref.WeakKeyDictionary[psycopg.Connection[Any], bool] = (
            weakref.WeakKeyDictionary()
        )
        self._verdicts_lock = threading.Lock()
        self.workflows = WorkflowStore(
            self.q, lambda requests: self._insert_program(requests, copy=False), list,
            self._notify_program, self._insert_joined, release_wakeup=_ReleaseWakeup(self),
        )  # fmt: skip
        self._newer_told = False  # a schema newer than this errands: warned once
        if auto_migrate if auto_migrate is not None else self.config.auto_migrate:
            self._migrate_on_open()

    # -- connections ---------------------------------------------------------------------
    def _forked(self) -> None:
        """In a child forked from the process that opened this backend (gunicorn
        --preload, a web server's master that enqueued or migrated at import, the
        forkserver of ``--pool process``, multiprocessing's fork): the child lets go of
        everything of the parent's that holds or tracks a connection, and opens its own.

        The parent's pools are never used by the child, nor closed there (closing sends
        Terminate on the parent's sockets): they are left in ``_INHERITED``. Children
        that went on using them shared the parent's sockets, their messages interleaved
        on the wire: enqueues failed with protocol errors ("server sent data without prior
        row description", DuplicatePreparedStatement) or hung 30 s waiting for a pool
        connection no thread of the child would ever open, and jobs were lost (150 of 900
        enqueues from three children stored). The locks and per-connection bookkeeping
        start afresh too (a lock another thread of the parent held at the fork stays held
        for good in the child): the prepared statements known per connection, the lost
        claims (the parent's to give back), the coalesced NOTIFYs. The new main pool opens
        at the child's first use of the store (_conn), the handler pool at its first
        ctx.transaction(), as in any process. Runs in the child right after the fork
        (os.register_at_fork), on its only thread: no I/O, no logging."""
        inherited = [p for p in (self.pool, self._handler_pool) if p is not None]
        _INHERITED.extend(inherited)
        # a backend closed before the fork stays closed in the child; one forked again
        # before its first use (its pool not opened yet) opens at its own first use
        was_open = self._reopen or not self.pool.closed
        timeout = self.pool.timeout
        self._handler_pool = None
        self._handler_lock = threading.Lock()
        self._notify_lock = threading.Lock()
        self._verdicts_lock = threading.Lock()
        self._reopen_lock = threading.Lock()
        self._last_notify = {}
        if self._prepared is not None:
            self._prepared = Prepared(self.q, BATCHED)
        self._lost_claims = LostClaims(lambda wait: self._conn(wait), self._undo_claims)
        self.pool = make_pool(self.config, "errands", 1, self.config.pool_size)
        self.pool.timeout = timeout
        self._reopen = was_open

    def _open_in_child(self) -> None:
        """Open the main pool of a forked child (see _forked), once."""
        with self._reopen_lock:
            if self._reopen:
                self.pool.open()  # without waiting: a checkout waits for its connection
                self._reopen = False

    def _conn(self, timeout: float | None = None, *, begins: bool = False) -> _Checkout:
        """A pool connection the server has not closed; ``timeout``: wait at most that
        long for one (default: the pool's 30 s, or less before a waiting caller's
        deadline: see base.calls_until).

        A caller's deadline that bounds its lock waits too (base.lock_wait: the
        maintenance leader's duties, its elections) hands the connection over in one of
        errands' own transactions whose lock_timeout is the time left (own_begin and
        lock_bound, one round trip), committed at the end: a statement that waits longer
        for a lock another session holds fails (LockNotAvailable, as DatabaseBusy), by
        the deadline, everything of the call rolled back. ``begins``: the caller opens
        such a transaction itself at once (_tx), whose BEGIN carries the bound instead.
        Session settings are never changed: behind a pooler in transaction mode a
        session's SET lands on a server connection other clients then use. Without such
        a deadline (claims, outcomes, heartbeats, enqueues) nothing is sent here.

        A class of its own (_Checkout), not a generator: every store call goes through
        it, and an enqueue one call per job paid a generator-based context manager (and
        shielded()'s, inside it) for each."""
        return _Checkout(self, timeout, begins)

    def _conn_error(self, exc: BaseException, bound: float | None) -> None:
        """Raise what ``exc``, raised in or around a checkout (see _conn), is to the
        caller when it is more than itself: SchemaOutdated for a missing table, and
        DatabaseBusy for a lock wait past the caller's ``bound``; return when it stands."""
        if isinstance(exc, pg_errors.UndefinedTable):
            raise SchemaOutdated(
                f"errands' tables are missing in schema {self.schema!r} of "
                f"{self.config.display} ({exc.diag.message_primary}); run: "
                f"errands migrate --url '{self.config.display}'"
            ) from None
        if (
            isinstance(exc, pg_errors.LockNotAvailable)
            and bound is not None
            and not isinstance(exc, DatabaseBusy)
        ):
            raise busy_as(
                exc,
                f"PostgreSQL {self.config.display}: a lock this call needed stayed held by "
                f"another session (locked for longer than the {bound:.1f} s its caller "
                f"could wait, or the session's own shorter lock_timeout: {_first_line(exc)}); "
                "nothing of the call was stored",
            ) from exc

    def _checkout(self, timeout: float, begin: str | None) -> psycopg.Connection[Any]:
        """A pool connection (connections.checkout), in the transaction ``begin`` opens
        when given: a connection found lost as it is sent (the server restarted or ended
        the session) is let go of and the next one taken, as _again_if_lost does for the
        call's own first statement, up to LOST_TRIES times."""
        for tries_left in reversed(range(LOST_TRIES)):
            conn = checkout(self.pool, timeout)
            if begin is None:
                return conn
            try:
                conn.execute(begin)
            except BaseException as exc:
                gone = lost(conn)
                if not gone:
                    with contextlib.suppress(psycopg.Error):
                        conn.rollback()
                self.pool.putconn(conn)
                if gone and tries_left and isinstance(exc, psycopg.Error):
                    continue
                raise
            return conn
        raise AssertionError("unreachable")

    def _bounded_begin(self, wait: float) -> str:
        """own_begin, and a lock_timeout of ``wait`` seconds (lock_bound): one simple
        query, one round trip."""
        ms = str(max(int(wait * 1000), 1))
        return f"{self._begin}; {self._lock_bound.replace('$LOCK', ms)}"

    @contextmanager
    def _tx(self) -> Iterator[psycopg.Connection[Any]]:
        """A pool connection in one of errands' own transactions (see _own_tx)."""
        with self._conn(begins=True) as conn, self._own_tx(conn):
            yield conn

    @contextmanager
    def _own_tx(self, conn: psycopg.Connection[Any]) -> Iterator[None]:
        """A transaction of errands' own on ``conn`` (a savepoint inside one already open),
        which the server ends if it idles past the idle limit, releasing its locks: its
        client went silent (see own_begin). Its BEGIN carries the limit: one round trip,
        as a plain BEGIN. Every transaction errands opens is one of these: any of them may
        hold a lock every worker waits for (a queue's claim lock, a workflow's row, a fair
        key's usage), and a proxy cut of one worker holding it stopped the whole cluster's
        claims for the cut's 4-6 s in the full-size chaos soak. Under a caller's deadline
        that bounds its lock waits (see _conn) the BEGIN carries that bound as well, in
        the same round trip."""
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            with conn.transaction():
                yield
            return
        bound = lock_wait()
        conn.execute(self._begin if bound is None else self._bounded_begin(bound))
        try:
            yield
        except BaseException:
            if not conn.closed:
                with contextlib.suppress(psycopg.Error):
                    conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def _guard(self, conn: psycopg.Connection[Any]) -> None:
        """Set the idle limit in a transaction already open (see tx_guard)."""
        conn.execute(self.q["tx_guard"], {"idle": self._idle})

    def _set_idle(self, lease: float) -> None:
        self._idle = idle_limit(lease)
        self._begin = self._begin_text("own_begin")
        # The BEGINs of a limited claim (_LimitedStore), with the idle limit filled in
        self.q["own_begin_filled"] = self._begin
        self.q["limited_claim_begin_filled"] = self._begin_text("limited_claim_begin")

    def _begin_text(self, query: str) -> str:
        """A BEGIN of errands' own (a simple query), with the idle limit filled in."""
        begin = self.q[query].replace("$IDLE", self._idle)
        return "\n".join(x for x in begin.splitlines() if not x.startswith("--"))

    def _again_if_lost(
        self,
        work: Callable[[psycopg.Connection[Any], Progress], T],
        uncertain: Callable[[psycopg.Error], Exception] | None = None,
    ) -> T:
        """Run ``work`` on a pool connection; when the connection is lost under it (the
        server restarted or ended the session), run it again on a fresh one, up to
        LOST_TRIES times. ``work`` marks ``progress.committing`` once what it sends may
        commit (an autocommit write, or COMMIT): a loss after that raises
        ``uncertain(error)`` instead, since the write may have happened."""
        for tries_left in reversed(range(LOST_TRIES)):
            progress = Progress()
            try:
                with self._conn() as conn:
                    progress.conn = conn
                    try:
                        return work(conn, progress)
                    except psycopg.Error:
                        progress.lost = lost(conn)  # before the pool may close it
                        raise
            except psycopg.Error as exc:
                gone = lost(progress.conn) if progress.lost is None else progress.lost
                if not gone:
                    raise
                # 25P03: the server ended the transaction for idling, before any COMMIT
                # of it arrived: rolled back for certain, so it runs again.
                idled = getattr(exc, "sqlstate", None) == "25P03"
                if progress.committing and uncertain is not None and not idled:
                    raise uncertain(exc) from exc
                if not tries_left:
                    raise
                log.info("connection to PostgreSQL lost (%s); trying again on a fresh one", exc)
        raise AssertionError("unreachable")

    def _read(self, work: Callable[[psycopg.Connection[Any]], T]) -> T:
        """An idempotent read, run again on a fresh connection if its connection is lost."""
        return self._again_if_lost(lambda conn, _: work(conn))

    def close(self) -> None:
        self._reopen = False  # (a forked child's pool, never opened: nothing to close)
        forget_at_fork(self)  # closed: a forked child leaves it as it is
        self.pool.close()
        with self._handler_lock:
            handlers, self._handler_pool = self._handler_pool, None
        if handlers is not None:
            handlers.close()

    def configure_worker(self, concurrency: int, lease: float | None = None) -> None:
        """A worker in this process runs up to ``concurrency`` handlers at once: size the
        handler pool to match (one connection per open ``ctx.transaction()``, unless the
        URL sets tx_pool_size), and refuse a worker the server would not let open every
        connection it may need (ConfigurationError naming the settings and the fix).
        Several workers started on one backend in a process keep the largest size."""
        if lease is not None:
            self._set_idle(lease)
        with self._conn() as conn:
            budget = check_budget(conn, self.config, concurrency)
        with self._handler_lock:
            size = max(self._handler_pool_size or 0, budget.handlers)
            self._handler_pool_size = size
            if self._handler_pool is not None:
                self._handler_pool.resize(0, size)
        log.debug(
            "connections for this worker: up to %d (%s)",
            budget.total,
            budget.describe(concurrency, self.config.tx_pool_size),
        )

    def _handlers(self) -> ConnectionPool:
        """The pool of ctx.transaction() connections (opened on first use)."""
        with self._handler_lock:
            if self._handler_pool is None:
                size = self._handler_pool_size or POOL_SIZE_DEFAULT  # no worker: no -c
                pool = make_pool(self.config, "errands-tx", 0, size, reset=reset_session)
                pool.open()
                self._handler_pool = pool
            return self._handler_pool

    # -- schema --------------------------------------------------------------------------
    def migration_sql(self, after: int = 0) -> list[tuple[int, str, str]]:
        """``(version, name, sql)`` of every migration newer than ``after``, markers filled."""
        return [(v, n, fill_markers(s, self.schema)) for v, n, s in MIGRATIONS if v > after]

    def _applied_version(self, conn: psycopg.Connection[Any]) -> int:
        row = conn.execute(
            "SELECT to_regclass(%s)", (f'"{self.schema}".errands_migrations',)
        ).fetchone()
        if row is None or row[0] is None:
            return 0
        version = conn.execute(
            pg_sql.SQL("SELECT max(version) FROM {}.errands_migrations").format(
                pg_sql.Identifier(self.schema)
            )
        ).fetchone()
        return int(version[0] or 0) if version else 0

    def migrate(self) -> list[str]:
        """Apply the pending migrations, all in one transaction under the advisory lock.
        Its lock waits on errands' tables last at most MIGRATE_LOCK_TIMEOUT (every
        migration's, from 0001 on: only 0017-0019 set one themselves): past it, nothing
        is changed and DatabaseBusy says to run it again at a quieter moment."""
        applied: list[str] = []
        schema = pg_sql.Identifier(self.schema)
        step = "errands migrate"  # what is running, for the error if a lock wait runs out
        try:
            with self._tx() as conn:
                # the advisory lock first, waited for as long as another migrate takes
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATE_LOCK_KEY,))
                conn.execute("SELECT set_config('lock_timeout', %s, true)", (MIGRATE_LOCK_TIMEOUT,))
                conn.execute(pg_sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(schema))
                conn.execute(
                    pg_sql.SQL(
                        "CREATE TABLE IF NOT EXISTS {}.errands_migrations (version integer "
                        "PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL "
                        "DEFAULT now())"
                    ).format(schema)
                )
                current = self._applied_version(conn)
                if current > SCHEMA_VERSION:
                    raise SchemaOutdated(
                        f"schema {self.schema!r} has errands schema version {current}, newer "
                        f"than this errands ({SCHEMA_VERSION}); upgrade errands on this host"
                    )
                for version, name, text in self.migration_sql(after=current):
                    step = f"errands migration {version:04d}_{name}"
                    try:
                        conn.execute(text.encode())
                    except (
                        pg_errors.DuplicateTable,
                        pg_errors.DuplicateColumn,
                        pg_errors.DuplicateObject,
                    ) as exc:  # the tables are ahead of what errands_migrations records
                        raise SchemaOutdated(
                            f"cannot apply {step} to schema {self.schema!r} of "
                            f"{self.config.display}: {exc.diag.message_primary}. "
                            f"errands_migrations records version {current}, but the tables do "
                            "not match it (was that table edited, or the schema restored from "
                            "a copy?); nothing was changed; restore the schema from a backup"
                        ) from None
                    conn.execute(
                        pg_sql.SQL(
                            "INSERT INTO {}.errands_migrations (version, name) VALUES (%s, %s)"
                        ).format(schema),
                        (version, name),
                    )
                    applied.append(f"{version:04d}_{name}")
        except pg_errors.LockNotAvailable as exc:
            raise busy_as(
                exc,
                f"{step} waited {MIGRATE_LOCK_TIMEOUT} for a lock on errands' tables in schema "
                f"{self.schema!r} of {self.config.display}, held by another transaction (one "
                "that enqueued or ran a ctx.transaction() and is still open, a long query or "
                f"a dump) ({_first_line(exc)}); nothing was changed (this run's migrations all "
                "rolled back), and the workers' and callers' statements that queued behind it "
                "went on: run errands migrate again at a quieter moment (pg_stat_activity "
                "lists the open transactions)",
            ) from exc
        return applied

    def _migrate_on_open(self) -> None:
        """``auto_migrate=true``: migrate, except a schema newer than this errands (a newer
        release migrated it), which this process runs on as schema_check lets it."""
        with self._conn() as conn:
            current = self._applied_version(conn)
        if current > SCHEMA_VERSION:
            self._newer(current)
            return
        self.migrate()

    def schema_check(self) -> None:
        """Refuse a schema older than this errands needs. A newer one (a newer release
        migrated it: a rolling deploy, whose old workers go on meanwhile) is run on, with
        a warning: the migrations keep the code of the release before them working
        (docs/postgres.md lists what each changes for it)."""
        with self._conn() as conn:
            current = self._applied_version(conn)
        if current < SCHEMA_VERSION:
            raise SchemaOutdated(
                f"schema {self.schema!r} of {self.config.display} has errands schema version "
                f"{current}, this errands needs {SCHEMA_VERSION}; run: "
                f"errands migrate --url '{self.config.display}' (or apply the SQL of "
                "`errands migrate --sql`)"
            )
        if current > SCHEMA_VERSION:
            self._newer(current)

    def _newer(self, current: int) -> None:
        """Warn, once per backend, of a schema newer than this errands."""
        if self._newer_told:
            return
        self._newer_told = True
        where = f"schema {self.schema!r} of {self.config.display}"
        warn_newer_schema(log, where, current, SCHEMA_VERSION)

    # -- enqueue -------------------------------------------------------------------------
    def _caller_program(self, raw: Any) -> Program[None]:
        """Check that a caller's connection (sync or async) reaches our server and
        database: spelled as ours passes as is; any other spelling (localhost for
        127.0.0.1, a Unix socket, a pooler, another host) is asked of the server once per
        connection object, without disturbing its transaction."""
        info = raw.info
        if (info.host, info.port, info.dbname) == self._address:
            return  # spelled as ours: our server and database
        with self._verdicts_lock:
            verdict = self._verdicts.get(raw)
        if verdict is None:
            opened = info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            theirs = yield from identity_of_caller(info.transaction_status, raw.autocommit)
            if theirs != self._identity:  # or ours restarted since: ask ours again
                self._identity = self._read(identity)
            verdict = theirs == self._identity
            if not verdict and opened and not raw.autocommit:  # leave it as found
                yield Stmt("ROLLBACK")
            with self._verdicts_lock:
                self._verdicts[raw] = verdict
        if not verdict:
            host, port, dbname = self._address
            raise ConfigurationError(
                f"enqueue(conn=...) got a connection to database {info.dbname!r} on "
                f"{info.host}:{info.port}, which is not the PostgreSQL server and database "
                f"this app stores jobs in ({dbname!r} on {host}:{port}: "
                f"{self.config.display}); nothing was written. Open the connection on the "
                "same server and the same database"
            )

    def _caller_connection(self, conn: Any) -> psycopg.Connection[Any]:
        raw = unwrap_connection(conn)
        if not isinstance(raw, psycopg.Connection):
            raise ConfigurationError(
                "enqueue(conn=...) on PostgreSQL takes a psycopg 3 Connection, or a SQLAlchemy "
                f"Connection/Session using psycopg; got {type(conn).__name__}"
            )
        _usable(raw)
        run(raw, self._caller_program(raw))
        return raw

    async def _acaller_connection(self, conn: Any) -> psycopg.AsyncConnection[Any]:
        raw = await async_driver_connection(conn)
        if not isinstance(raw, psycopg.AsyncConnection):
            raise ConfigurationError(
                "aenqueue(conn=...) on PostgreSQL takes a psycopg 3 AsyncConnection, or an "
                "SQLAlchemy AsyncSession/AsyncConnection using psycopg; got "
                f"{type(conn).__name__}"
            )
        _usable(raw)
        await arun(raw, self._caller_program(raw))
        return raw

    def _insert(
        self, conn: psycopg.Connection[Any], requests: Sequence[EnqueueRequest]
    ) -> list[InsertResult]:
        return run(conn, self._insert_program(requests, copy=True))

    def _insert_one(self, conn: psycopg.Connection[Any], req: EnqueueRequest) -> list[InsertResult]:
        """One job without a key: the single statement of ``_insert_program``, sent
        straight (the enqueue one call per job runs this; a key can never conflict)."""
        cur = _insert_cursor(conn)
        [(job_id, _)] = cur.execute(self._job_insert_sql, self._one_params(req)).fetchall()
        return [InsertResult(job_id, False)]

    def _one_params(self, req: EnqueueRequest) -> dict[str, Any]:
        """``job_insert``'s parameters: the job's, and the channel when this process is due
        to NOTIFY its queue (see _notify_due)."""
        params = insert_params(req)
        params["channel"] = self.channel if self._notify_due({req.queue}) else None
        return params

    def _insert_program(
        self, requests: Sequence[EnqueueRequest], *, copy: bool
    ) -> Program[list[InsertResult]]:
        """Insert ``requests`` (and NOTIFY their queues, coalesced). ``copy``: jobs without
        a key go in by COPY (a sync connection); else by the INSERT of jobs with keys.

        A key is tried first: only when it is taken does a second statement release it if
        its ``unique_for`` period is over (then the insert is tried again), so a new key
        costs one statement, not two (every keyed enqueue, and every workflow callback,
        paid a release statement that found nothing). The keys a batch found taken are
        released, and their holders looked up, one statement each for all of them (one
        key at a time, a batch of 5,000 taken keys took 14 times as long as 5,000 new
        ones). Statements outside a transaction (``conn=`` in autocommit mode) can see
        another caller free the key between them: the insert is then tried again,
        KEY_TRIES times at most."""
        if len(requests) == 1:
            req = requests[0]
            params = self._one_params(req)
            for _ in range(KEY_TRIES):
                rows = yield Stmt(self.q["job_insert"], params)
                if rows and rows[0][0] is not None:
                    return [InsertResult(rows[0][0], False)]
                if (yield from self._expire_keys([req])):
                    continue  # its period was over: released, insert again
                holder = (yield from self._key_holders([req])).get((req.name, req.key))
                if holder is not None:
                    if params["channel"] is not None:  # recorded as sent; it was not
                        self._notify_unsent(req.queue)
                    return [InsertResult(holder, True)]
            raise self._key_race(req)
        [(ids, now)] = yield Stmt(self.q["job_allocate_ids"], {"n": len(requests)})
        # now: the transaction's now(), as the INSERT would use
        pairs = list(zip(ids, requests, strict=True))
        plain = [(i, r) for i, r in pairs if r.key is None] if copy else []
        rest = [(i, r) for i, r in pairs if r.key is not None] if copy else pairs
        if plain:  # no conflict possible: COPY, the fastest way in
            yield Call(lambda conn: self._copy(conn, plain, now))
        inserted = {i for i, _ in plain}
        if rest:  # ON CONFLICT DO NOTHING needs an INSERT
            rows = yield Stmt(self.q["job_insert_many"], self._insert_many_params(rest))
            inserted |= {r[0] for r in rows}
        holders: dict[int, int] = {}  # request's id -> the job holding its key
        for tried in range(KEY_TRIES + 1):
            missed = [(i, r) for i, r in rest if i not in inserted and i not in holders]
            if not missed:
                break
            # the keys whose period was over: released, inserted again
            expired = yield from self._expire_keys([r for _, r in missed])
            held = [r for _, r in missed if (r.name, r.key) not in expired]
            found = (yield from self._key_holders(held)) if held else {}
            again = []
            for i, r in missed:
                holder = found.get((r.name, r.key))
                if holder is None:  # released, or freed meanwhile by another caller
                    again.append((i, r))
                else:
                    holders[i] = holder
            if not again:
                break
            if tried == KEY_TRIES:
                raise self._key_race(again[0][1])
            rows = yield Stmt(self.q["job_insert_many"], self._insert_many_params(again))
            inserted |= {r[0] for r in rows}
        results = [
            InsertResult(i, False) if i in inserted else InsertResult(holders[i], True)
            for i, _ in pairs
        ]
        # Only the queues a job went into: a batch whose keys were all taken stored
        # nothing, and woke every idle worker of its queues for it.
        for queue in self._notify_due({r.queue for i, r in pairs if i in inserted}):
            yield Stmt(self.q["notify"], {"channel": self.channel, "payload": queue})
        return results

    def _key_holders(
        self, requests: Sequence[EnqueueRequest]
    ) -> Program[dict[tuple[str, str | None], int]]:
        """The jobs holding ``requests``' keys, by (name, key); a key no job holds (any
        more) is left out."""
        rows = yield Stmt(self.q["job_ids_by_keys"], _key_arrays(requests))
        return {(r[0], r[1]): int(r[2]) for r in rows}

    @staticmethod
    def _key_race(request: EnqueueRequest) -> DatabaseBusy:
        return DatabaseBusy(
            f"enqueue of {request.name} with key {request.key!r}: the key was taken and "
            f"freed again by other callers {KEY_TRIES} times in a row; nothing was stored "
            "by this call; try again"
        )

    def _expire_keys(
        self, requests: Sequence[EnqueueRequest]
    ) -> Program[set[tuple[str, str | None]]]:
        """Release ``requests``' keys held by a job enqueued with a ``unique_for`` period
        that is over; the (name, key) of those released."""
        rows = yield Stmt(self.q["job_expire_keys"], _key_arrays(requests))
        return {(r[0], r[1]) for r in rows}

    def _insert_joined(
        self, requests: Sequence[EnqueueRequest], workflow_id: int, waiting: Sequence[int]
    ) -> Program[list[InsertResult]]:
        """Workflow members without keys by COPY, written joined to their workflow (the
        dependents at the indexes ``waiting`` in state 'waiting'): one write per row, not
        an insert and then wf_jobs_join's update of every member. Sync connections only."""
        [(ids, now)] = yield Stmt(self.q["job_allocate_ids"], {"n": len(requests)})
        rows = list(zip(ids, requests, strict=True))
        held = frozenset(waiting)
        yield Call(lambda conn: self._copy(conn, rows, now, workflow_id, held))
        runnable = {r.queue for i, r in enumerate(requests) if i not in held}
        for queue in self._notify_due(runnable):
            yield Stmt(self.q["notify"], {"channel": self.channel, "payload": queue})
        return [InsertResult(i, False) for i in ids]

    def _copy(
        self,
        conn: psycopg.Connection[Any],
        rows: Sequence[tuple[int, EnqueueRequest]],
        now: datetime,
        workflow_id: int | None = None,
        waiting: frozenset[int] = frozenset(),
    ) -> None:
        """COPY jobs without idempotency keys, computing state and times from ``now``
        exactly as the ``job_insert_many`` statement does from ``now()``. With a
        ``workflow_id``, the rows are members of it, those at the indexes ``waiting`` in
        state 'waiting' (dependents; no signal)."""
        # Most batches set none of the optional columns: one test per job finds that out.
        special = [r for _, r in rows if not _copy_plain(r)]
        optional = [i for i, (_, sets) in enumerate(COPY_OPTIONAL) if any(map(sets, special))]
        names = [*COPY_REQUIRED, *(COPY_OPTIONAL[i][0] for i in optional)]
        joined = () if workflow_id is None else (workflow_id,)
        columns = ", ".join([*names, "workflow_id"] if joined else names)
        pick = itemgetter(*optional) if optional else None
        statement = self.q["job_copy"].format(columns=columns)
        # Times go in as ISO text, written once for the common "now": psycopg dumping a
        # datetime costs ~1.7 us a row, a tenth of the whole bulk enqueue (exact either
        # way: both carry microseconds, as timestamptz does).
        now_text = now.isoformat()
        with conn.cursor() as cur, cur.copy(statement) as copy:
            write = copy.write_row
            for index, (job_id, r) in enumerate(rows):
                if r.run_at is None and not r.delay:
                    state, run_at_text = "available", now_text
                else:
                    if r.run_at is not None:
                        run_at = datetime.fromtimestamp(r.run_at, UTC)
                    else:
                        run_at = now + timedelta(seconds=r.delay)
                    state = "scheduled" if run_at > now else "available"
                    run_at_text = run_at.isoformat()
                if waiting and index in waiting:
                    state = "waiting"
                row = (job_id, r.name, r.queue, r.args_json, state, r.max_attempts, run_at_text)
                if pick is not None:
                    values = (
                        json.dumps(r.meta, separators=(",", ":")) if r.meta else "{}",
                        r.priority,
                        r.timeout,
                        r.lease_seconds,
                        r.parent_id,
                        None if r.unique_for is None else now + timedelta(seconds=r.unique_for),
                        r.concurrency_key,
                        r.concurrency_limit,
                        r.rate_limit,
                        r.rate_period,
                        r.fair_key,
                    )
                    chosen = pick(values)
                    row += chosen if len(optional) > 1 else (chosen,)
                write(row + joined if joined else row)

    @staticmethod
    def _insert_many_params(rows: Sequence[tuple[int, EnqueueRequest]]) -> dict[str, Any]:
        """The arrays of ``job_insert_many`` for jobs with pre-allocated ids."""
        requests = [r for _, r in rows]
        return {
            "ids": [i for i, _ in rows],
            "names": [r.name for r in requests],
            "queues": [r.queue for r in requests],
            "args": [r.args_json for r in requests],
            "metas": [json.dumps(r.meta, separators=(",", ":")) for r in requests],
            "priorities": [r.priority for r in requests],
            "max_attempts": [r.max_attempts for r in requests],
            "run_ats": [r.run_at for r in requests],
            "delays": [r.delay for r in requests],
            "keys": [r.key for r in requests],
            "timeouts": [r.timeout for r in requests],
            "leases": [r.lease_seconds for r in requests],
            "parents": [r.parent_id for r in requests],
            "unique_fors": [r.unique_for for r in requests],
            "ckeys": [r.concurrency_key for r in requests],
            "climits": [r.concurrency_limit for r in requests],
            "rlimits": [r.rate_limit for r in requests],
            "rperiods": [r.rate_period for r in requests],
            "fkeys": [r.fair_key for r in requests],
        }

    def _notified_lately(self) -> list[str]:
        """The queues this process NOTIFYed within the window: not again yet."""
        now = time.monotonic()
        window = self.config.notify_window
        with self._notify_lock:
            return [q for q, at in self._last_notify.items() if now - at < window]

    def _notify_due(self, queues: set[str]) -> list[str]:
        """The queues this process should NOTIFY now: at most once per queue per window."""
        now = time.monotonic()
        due = []
        with self._notify_lock:
            for queue in queues:
                if now - self._last_notify.get(queue, 0.0) >= self.config.notify_window:
                    self._last_notify[queue] = now
                    due.append(queue)
        return due

    def _notify_unsent(self, queue: str) -> None:
        """A NOTIFY _notify_due found due was not sent (the job was not stored: its key
        was taken): the next enqueue to ``queue`` sends one (it waited out the window,
        its idle workers waking at their next poll)."""
        with self._notify_lock:
            self._last_notify.pop(queue, None)

    def _notify_program(self, queues: set[str]) -> Program[None]:
        for queue in self._notify_due(queues):
            yield Stmt(self.q["notify"], {"channel": self.channel, "payload": queue})

    def _maybe_notify(self, conn: psycopg.Connection[Any], queues: set[str]) -> None:
        for queue in self._notify_due(queues):
            conn.execute(self.q["notify"], {"channel": self.channel, "payload": queue})

    def job_insert_many(
        self, requests: Sequence[EnqueueRequest], conn: Any = None
    ) -> list[InsertResult]:
        if not requests:
            return []
        if conn is not None:
            caller = self._caller_connection(conn)
            several = writes_several(requests)
            with _caller_conflicts(caller, _enqueue_of(requests)), _atomic(caller, several=several):
                return self._insert(caller, requests)
        single = len(requests) == 1 and requests[0].key is None

        def insert(own: psycopg.Connection[Any], progress: Progress) -> list[InsertResult]:
            if single:  # one autocommit statement: one round trip, its own commit
                progress.committing = True
                return self._insert_one(own, requests[0])
            return self._own_tx_again(
                own, progress, lambda: self._insert(own, requests), _enqueue_of(requests)
            )

        return self._again_if_lost(insert, lambda exc: self._uncertain(requests, exc))

    async def ajob_insert_many(
        self, requests: Sequence[EnqueueRequest], conn: Any = None
    ) -> list[InsertResult]:
        if not requests:
            return []
        if conn is None:  # the pool's connections, in a thread: the loop never blocks
            return await offloop.run(self.job_insert_many, requests)
        caller = await self._acaller_connection(conn)
        with _caller_conflicts(caller, _enqueue_of(requests)):
            async with _aatomic(caller, several=writes_several(requests)):
                return await arun(caller, self._insert_program(requests, copy=False))

    def _own_tx_again(
        self,
        own: psycopg.Connection[Any],
        progress: Progress,
        body: Callable[[], T],
        what: str,
    ) -> T:
        """``body()`` in one of errands' own transactions on ``own``; run again from the
        start when the server aborts it to break a deadlock (or a serialization conflict):
        rolled back whole, nothing of it stored, and the next try sees what the other side
        committed. LOCK_CONFLICT_TRIES tries at most, then DatabaseBusy naming ``what``.
        Marks ``progress.committing`` as the COMMIT goes out (see _again_if_lost)."""
        for attempt in range(1, LOCK_CONFLICT_TRIES + 1):
            mark = self.workflows.mark()
            try:
                with self._own_tx(own):
                    result = body()
                    progress.committing = True  # leaving the block sends COMMIT
                return result
            except psycopg.Error as exc:
                if lost(own) or not self._lock_conflict(exc):
                    raise
                if attempt == LOCK_CONFLICT_TRIES:
                    raise DatabaseBusy(
                        f"{what}: PostgreSQL aborted its transaction {attempt} times in a "
                        "row to break a lock conflict with other transactions "
                        f"({_first_line(exc)}); nothing was stored by this call; try again"
                    ) from exc
                progress.committing = False
                self.workflows.back_to(mark)  # what the rolled-back try reported never happened
                with self._notify_lock:  # its NOTIFY neither (sent at COMMIT): due again
                    self._last_notify.clear()
                log.info("%s: the server broke a lock cycle (%s); running it again", what, exc)
                time.sleep(random.uniform(0.0, 0.01 * attempt))  # jitter
        raise AssertionError("unreachable")  # pragma: no cover

    def _uncertain(self, requests: Sequence[EnqueueRequest], exc: psycopg.Error) -> Exception:
        names = ", ".join(sorted({r.name for r in requests}))
        what = f"job {names}" if len(requests) == 1 else f"{len(requests)} jobs ({names})"
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return EnqueueUncertain(
            f"the connection to PostgreSQL at {self.config.display} was lost while the "
            f"enqueue of {what} was committing ({reason}): it may or may not have been "
            "stored. An enqueue with key= can simply be retried (the key makes it happen "
            "once); without a key, a retry may enqueue it twice"
        )

    # -- workflows ---------------------------------------------------------------------
    def workflow_insert(self, spec: WorkflowSpec, conn: Any = None) -> WorkflowInserted:
        if conn is not None:
            caller = self._caller_connection(conn)
            what = f"enqueue of workflow {spec.name!r}"
            with _caller_conflicts(caller, what), _atomic(caller, several=True):
                return run(caller, self.workflows.insert(spec, bulk=True))
        with self._conn() as own:
            return self._own_tx_again(
                own,
                Progress(),
                lambda: run(own, self.workflows.insert(spec, bulk=True)),
                f"enqueue of workflow {spec.name!r}",
            )

    async def aworkflow_insert(self, spec: WorkflowSpec, conn: Any = None) -> WorkflowInserted:
        if conn is None:  # the pool's connections, in a thread: the loop never blocks
            return await offloop.run(self.workflow_insert, spec)
        caller = await self._acaller_connection(conn)
        with _caller_conflicts(caller, f"enqueue of workflow {spec.name!r}"):
            async with _aatomic(caller, several=True):
                return await arun(caller, self.workflows.insert(spec))

    def _read_program(self, factory: Callable[[], Program[T]]) -> T:
        return self._read(lambda conn: run(conn, factory()))

    # -- the hot path ----------------------------------------------------------------------
    def job_claim(self, params: ClaimParams) -> list[JobRow]:
        if params.limit <= 0 or not params.queues:
            return []

        def claim(conn: psycopg.Connection[Any], token: str) -> list[JobRow]:
            rows = conn.execute(
                self.q["job_claim_suspect" if params.suspects else "job_claim"],
                {
                    "queues": [q.name for q in params.queues],
                    "limits": [q.limit for q in params.queues],
                    "limit": params.limit,
                    "worker_id": params.worker_id,
                    "token": token,
                    "lease_default": params.lease_seconds_default,
                    "names": None if params.names is None else list(params.names),
                },
            ).fetchall()
            return [JobRow(*r) for r in rows]

        return self._lost_claims.run(claim)

    def _undo_claims(self, conn: psycopg.Connection[Any], tokens: list[str]) -> list[int]:
        """Undo the claims of ``tokens``, whose replies were lost (see lost_claims.py):
        the ids of the jobs given back. Their queues are NOTIFYed in the same transaction,
        as an enqueue's are: the jobs are due again now, and an idle worker elsewhere
        would otherwise wait for its next poll to take them."""
        with self._own_tx(conn):
            rows = conn.execute(self.q["job_claim_undo"], {"tokens": tokens}).fetchall()
            self._fan_in(conn, rows)  # a member cancelled meanwhile ends now
            self._maybe_notify(conn, {r[3] for r in rows if r[2] == "available"})
        return [r[0] for r in rows]

    def job_finish_many(self, outcomes: Sequence[FinishParams]) -> list[bool]:
        if not outcomes:
            return []
        self.workflows.forget()
        if any(o.children for o in outcomes):  # children commit with their parent's outcome
            with self._tx() as conn:
                answers = self._finish(conn, outcomes)
        else:
            with self._conn() as conn:  # one autocommit statement: one round trip
                answers = self._finish(conn, outcomes)
        fault_point("after_finish_commit")
        if self.workflows.take_fanned():
            fault_point("after_fan_in_commit")
        return answers

    def _finish(
        self, conn: psycopg.Connection[Any], outcomes: Sequence[FinishParams]
    ) -> list[bool]:
        if any(o.state == "waiting" for o in outcomes):  # suspensions: rare, one at a time
            rest = [o for o in outcomes if o.state != "waiting"]
            answers = dict(
                zip(map(id, rest), self._finish(conn, rest) if rest else [], strict=True)
            )
            for o in outcomes:
                if o.state == "waiting":
                    with self._own_tx(conn):  # the suspension locks the row, then looks
                        answers[id(o)] = run(
                            conn, suspend_program(self.q, o, self.workflows.fan_in)
                        )
            return [answers[id(o)] for o in outcomes]
        # Jobs outside workflows: one statement, as ever. Workflow members (and stale
        # outcomes, which no statement accepts) then in a transaction with their fan-in;
        # the members known from their claimed rows go there at once.
        others = [o for o in outcomes if not o.member]
        done = self._finish_rows(conn, others, members=False) if others else {}
        accepted = [(o.id, o.lease_token) in done for o in outcomes]
        rest = [o for o, ok in zip(outcomes, accepted, strict=True) if not ok]
        children = [
            child
            for o, ok in zip(outcomes, accepted, strict=True)
            if ok and o.state == "completed"
            for child in o.children
        ]
        if children:
            self._insert(conn, children)
        if rest:
            with self._own_tx(conn):
                ended = self._finish_rows(conn, rest, members=True)
                members = [o.id for o in rest if ended.get((o.id, o.lease_token)) in ENDED]
                parts = [
                    (o, *split_children(o))
                    for o in rest
                    if (o.id, o.lease_token) in ended and o.state == "completed"
                ]
                if len(members) > 1 and any(adds for _, _, adds in parts):
                    run(conn, self.workflows.lock_fan_in(members))  # in id order, first
                for o, plain, adds in parts:
                    if plain:
                        self._insert(conn, plain)
                    if adds:
                        [(workflow_id,)] = conn.execute(
                            self.q["wf_job_workflow"], {"id": o.id}
                        ).fetchall()
                        run(conn, self.workflows.add(workflow_id, adds))
                run(conn, self.workflows.fan_in(members))
            landed = {(o.id, o.lease_token) for o in rest} & set(ended)
            accepted = [
                ok or (o.id, o.lease_token) in landed
                for o, ok in zip(outcomes, accepted, strict=True)
            ]
        return accepted

    def _finish_rows(
        self, conn: psycopg.Connection[Any], outcomes: Sequence[FinishParams], members: bool
    ) -> dict[tuple[int, str], str]:
        """The fenced write of ``outcomes`` (of members or of other jobs): the state each
        one that landed is in, by ``(id, lease token)``."""
        if not members and all(_lean_completion(o) for o in outcomes):
            name = folding("job_complete_many", [o.fair for o in outcomes])
            plain = name.endswith("_plain")
            params: dict[str, Any] = {
                "ids": [o.id for o in outcomes],
                "tokens": [o.lease_token for o in outcomes],
                "results": [o.result_json for o in outcomes],
                # only the fold reads them: the plain variant (every plain queue's batch)
                # gets none to bind (unnest pads the shorter array with NULLs)
                "rans": [] if plain else [handler_seconds(o.ran) for o in outcomes],
                "half_life": HALF_LIFE,
            }
            query = self.q[name]
        else:
            query = self.q[folding("job_finish_many", [o.fair for o in outcomes])]
            params = {
                "ids": [o.id for o in outcomes],
                "tokens": [o.lease_token for o in outcomes],
                "states": [o.state for o in outcomes],
                "results": [o.result_json for o in outcomes],
                "errors": [None if o.error is None else json.dumps(o.error) for o in outcomes],
                "delays": [float(o.delay) for o in outcomes],
                "rans": [handler_seconds(o.ran) for o in outcomes],
                "members": members,
                "half_life": HALF_LIFE,
            }
        return {(r[0], r[1]): r[2] for r in conn.execute(query, params).fetchall()}

    # -- queues and limits ----------------------------------------------------------------
    def queue_settings(self) -> list[QueueSettings]:
        with self._conn() as conn:
            rows = conn.execute(self.q["queue_settings_list"]).fetchall()
        return [
            QueueSettings(
                name=r[0], paused=bool(r[1]), max_running=r[2], rate_limit=r[3],
                rate_period=r[4], jobs_declare_limits=bool(r[5]), updated_at=r[6], updated_by=r[7],
                fair=bool(r[8]), aging=r[9],
            )
            for r in rows
        ]  # fmt: skip

    def queue_declare(self, settings: QueueSettings, actor: str) -> None:
        with self._conn() as conn:
            conn.execute(
                self.q["queue_declare"],
                {
                    "name": settings.name,
                    "max_running": settings.max_running,
                    "rate_limit": settings.rate_limit,
                    "rate_period": settings.rate_period,
                    "has_keys": settings.jobs_declare_limits,
                    "fair": settings.fair,
                    "aging": settings.aging,
                    "actor": actor,
                },
            )

    def queue_declare_keyed(self, name: str, actor: str) -> None:
        with self._conn() as conn:
            conn.execute(self.q["queue_declare_keyed"], {"name": name, "actor": actor})

    def queue_set_paused(self, name: str, paused: bool, actor: str) -> None:
        with self._tx() as conn:
            conn.execute(
                self.q["queue_set_paused"], {"name": name, "paused": paused, "actor": actor}
            )
            conn.execute(
                self.q["audit_insert"],
                {
                    "actor": actor,
                    "action": "pause" if paused else "resume",
                    "job_id": None,
                    "detail": json.dumps({"queue": name}),
                },
            )

    def job_limit_declare(
        self, name: str, queue: str, rate_limit: int | None, rate_period: float | None
    ) -> None:
        with self._conn() as conn:
            conn.execute(
                self.q["job_limit_declare"],
                {
                    "name": name,
                    "queue": queue,
                    "rate_limit": rate_limit,
                    "rate_period": rate_period,
                },
            )

    def job_claim_limited(
        self,
        queue: QueueClaim,
        worker_id: str,
        lease_default: float,
        suspects: bool = False,
        names: Sequence[str] | None = None,
        weights: Weigher | None = None,
        express: bool = False,
        turns: int | None = None,
        key_limits: Mapping[str, int] | None = None,
    ) -> list[JobRow]:
        def claim(conn: psycopg.Connection[Any], token: str) -> list[JobRow]:
            while True:
                store = _LimitedStore(conn, self.q, f"errands:{self.schema}:", self._prepared)
                cursor = self._fair_cursors.get(queue.name)  # where a retry starts again
                try:
                    with store.transaction():
                        rows = claim_limited(
                            store,
                            queue.name,
                            queue.limit,
                            {
                                "worker_id": worker_id,
                                "token": token,  # a retry's too: the first rolled back
                                "lease_default": lease_default,
                            },
                            suspects=suspects,
                            names=names,
                            weights=weights,
                            cursors=self._fair_cursors,
                            express=express,
                            turns=turns,
                            key_limits=key_limits,
                        )
                    return rows.carrying(JobRow(*r) for r in rows)
                except Exception as exc:
                    # It served no key: rolled back, or given back (lost_claims.py)
                    self._fair_rewind(queue.name, cursor)
                    if not isinstance(exc, pg_errors.InvalidSqlStatementName):
                        raise
                    # The connection lost its prepared statements (psycopg sends
                    # DEALLOCATE ALL with a ROLLBACK once it has prepared its own): the
                    # claim, rolled back, runs again and prepares them anew. Gone though
                    # prepared by this very claim: the server does not keep them for the
                    # session (a pooler in transaction mode): send them one by one.
                    if store.prepared is None:
                        raise
                    if store.prepared_now:
                        self._unbatch()

        return self._lost_claims.run(claim)

    def _fair_rewind(self, queue: str, cursor: str | None) -> None:
        """A fair queue's rotation back where it stood before a claim that took nothing:
        the keys it passed were not served."""
        if cursor is None:
            self._fair_cursors.pop(queue, None)
        else:
            self._fair_cursors[queue] = cursor

    def _unbatch(self) -> None:
        """Limited claims send their statements one by one from now on (see _LimitedStore)."""
        if self._prepared is not None:
            log.warning(
                "statements prepared on the PostgreSQL server (PREPARE) vanish between "
                "transactions (a pooler in transaction mode?): limited claims send their "
                "statements one by one from now on"
            )
        self._prepared = None

    def queues_with_limits(self, queues: Sequence[str]) -> set[str]:
        if not queues:
            return set()
        with self._conn() as conn:
            rows = conn.execute(self.q["queues_with_limits"], {"queues": list(queues)}).fetchall()
        return {r[0] for r in rows}

    def dead_hooks_due(self, older_than: float, limit: int) -> list[int]:
        with self._tx() as conn:
            conn.execute(self.q["dead_hooks_forget"], {"older_than": older_than})
            if limit <= 0:
                return []
            rows = conn.execute(
                self.q["dead_hooks_due"], {"older_than": older_than, "limit": limit}
            ).fetchall()
        return [int(r[0]) for r in rows]

    def dead_hooks_done(self, job_id: int, died_at: float) -> None:
        with self._conn() as conn:
            conn.execute(self.q["dead_hooks_done"], {"job_id": job_id, "died_at": died_at})

    def rate_log_prune(self, older_than: float) -> int:
        with self._conn() as conn:
            return conn.execute(self.q["rate_log_prune"], {"older_than": older_than}).rowcount

    # -- cron ------------------------------------------------------------------------------
    def cron_states(self) -> list[CronState]:
        with self._conn() as conn:
            rows = conn.execute(self.q["cron_states"]).fetchall()
        return [CronState(*r) for r in rows]

    def cron_save(
        self,
        name: str,
        expression: str,
        timezone: str,
        last_slot: float,
        last_job_id: int | None,
        next_slot: float | None,
        rewind: bool = False,
    ) -> None:
        with self._conn() as conn:
            conn.execute(
                self.q["cron_save"],
                {
                    "name": name,
                    "expression": expression,
                    "timezone": timezone,
                    "last_slot": last_slot,
                    "last_job_id": last_job_id,
                    "next_slot": next_slot,
                    "rewind": rewind,
                },
            )

    # -- transactional completion (ctx.transaction) ---------------------------------------
    def tx_begin(self) -> psycopg.Connection[Any]:
        """A connection of the handler pool in an open transaction, for one attempt."""
        pool = self._handlers()
        conn = checkout(pool)
        try:
            # READ COMMITTED whatever the database's default: the outcome's fenced write
            # updates the job's row, which the heartbeats update while the handler runs
            # (under REPEATABLE READ, a serialization failure: every job that outlived a
            # heartbeat failed). The handler cannot change it: its connection refuses
            # isolation_level, and SET TRANSACTION inside errands' savepoint.
            conn.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
        except BaseException:
            pool.putconn(conn)
            raise
        return conn

    def tx_finish(self, conn: psycopg.Connection[Any], outcome: FinishParams) -> bool:
        """Write the fenced outcome in the attempt's transaction and commit it all, or
        roll it all back when the lease is no longer ours."""
        try:
            # From here only errands' statements follow (the outcome, its fan-in, COMMIT),
            # holding the job's row, a fair key's usage, a workflow's row: the idle limit.
            # They read their rows by position, whatever rows the handler asked for.
            conn.row_factory = tuple_row  # type: ignore[assignment]
            self._guard(conn)
            self.workflows.forget()  # the caller reports what this fan-in did, once
            [ok] = self._finish(conn, [outcome])
            fault_point("before_complete_commit")
            conn.execute("COMMIT" if ok else "ROLLBACK")
            fault_point("after_complete_commit")
            return ok
        except BaseException:
            with contextlib.suppress(psycopg.Error):
                conn.execute("ROLLBACK")
            raise
        finally:
            self._give_back(conn)

    def tx_rollback(self, conn: psycopg.Connection[Any]) -> None:
        try:
            with contextlib.suppress(psycopg.Error):
                conn.execute("ROLLBACK")
        finally:
            self._give_back(conn)

    def tx_abandon(self, conn: psycopg.Connection[Any]) -> None:
        """From a thread of its own (never waited for): cancel the statement the handler
        may be running (psycopg's cancel_safe takes no lock of the connection, which the
        handler's thread holds while a statement runs; the request opens a connection to
        the server), then, once the connection is free, close it: the server rolls the
        transaction back and releases its locks, the handler's next statement on it
        fails, and the pool opens another in its place."""
        threading.Thread(
            target=self._end_abandoned, args=(conn,), name="errands-tx-abandon", daemon=True
        ).start()

    def _end_abandoned(self, conn: psycopg.Connection[Any]) -> None:
        wait, tries = 1.0, 0
        while True:
            try:
                conn.cancel_safe(timeout=CANCEL_TIMEOUT)
            except Exception as exc:
                log.warning("could not cancel the statement of an abandoned handler: %s", exc)
            # No statement of the handler's runs while it is closed. A handler may hold the
            # lock past the cancel (inside a stream() loop, or a statement begun just
            # after it): the cancel is sent again, less often as it goes on.
            if conn.lock.acquire(timeout=wait):
                break
            tries += 1
            if tries == ABANDON_WARN_AFTER:
                log.warning(
                    "an abandoned handler still holds its ctx.transaction() connection after "
                    "%d cancels; its transaction stays open until it lets go",
                    tries,
                )
            wait = min(wait * 2, 30.0)
        try:
            conn.close()
        finally:
            conn.lock.release()
            try:
                self._give_back(conn)
            except Exception:
                log.exception("could not give an abandoned handler's connection back")

    def _give_back(self, conn: psycopg.Connection[Any]) -> None:
        with self._handler_lock:
            pool = self._handler_pool
        if pool is None:  # the backend was closed meanwhile
            conn.close()
        else:
            pool.putconn(conn)

    # -- durable steps -------------------------------------------------------------------
    def step_list(self, job_id: int) -> list[Step]:
        with self._conn() as conn:
            rows = conn.execute(self.q["step_list"], {"job_id": job_id}).fetchall()
        return [
            Step(job_id=r[0], name=r[1], result=None if r[2] is None else loads_stored(r[2]),
                 attempt=r[3], created_at=to_datetime(r[4]))  # type: ignore[arg-type]
            for r in rows
        ]  # fmt: skip

    def step_store(
        self, job_id: int, name: str, result_json: str, attempt: int, conn: Any = None
    ) -> str:
        params = {"job_id": job_id, "name": name, "result": result_json, "attempt": attempt}
        if conn is not None:  # ctx.transaction()'s: rows as tuples, whatever it was set to
            cur = tuple_cursor(conn)
            cur.execute(self.q["step_insert"], params)
            return str(cur.execute(self.q["step_get"], params).fetchone()[0])
        with self._conn() as own:
            own.execute(self.q["step_insert"], params)
            return str(own.execute(self.q["step_get"], params).fetchone()[0])  # type: ignore[index]

    def job_heartbeat_many(self, leases: Sequence[LeaseRef]) -> HeartbeatResult:
        if not leases:
            return HeartbeatResult(frozenset(), frozenset())
        # Give up well before the shortest lease runs out: the caller self-fences. Without
        # a bound, an unreachable server makes this wait the pool's 30 s, past the lease.
        limit = min(lease.lease_seconds for lease in leases) / 3
        with self._conn(timeout=limit) as conn:
            rows = conn.execute(
                self.q["job_heartbeat_many"],
                {
                    "ids": [lease.id for lease in leases],
                    "tokens": [lease.lease_token for lease in leases],
                    "leases": [float(lease.lease_seconds) for lease in leases],
                    "progress": [lease.progress for lease in leases],
                    "messages": [lease.progress_message for lease in leases],
                },
            ).fetchall()
        return HeartbeatResult(
            frozenset((r[0], r[1]) for r in rows), frozenset((r[0], r[1]) for r in rows if r[2])
        )

    def job_release_many(
        self,
        leases: Sequence[LeaseRef],
        message: str = RELEASED,
        *,
        unrun: bool = False,
        prefetched: bool = False,
        delays: Sequence[float] | None = None,
    ) -> list[bool]:
        if not leases:
            return []
        # a prefetched job never ran: no worker time to fold (the plain statement)
        fair = [False if prefetched else lease.fair for lease in leases]
        pauses = release_pauses(leases, delays)
        with self._tx() as conn:
            rows = conn.execute(
                self.q[folding("job_release_many", fair)],
                {
                    "ids": [lease.id for lease in leases],
                    "tokens": [lease.lease_token for lease in leases],
                    "delays": pauses,
                    "message": message,
                    "unrun": unrun,
                    "prefetched": prefetched,
                    "half_life": HALF_LIFE,
                },
            ).fetchall()
            self._fan_in(conn, rows)
            done = {r[0] for r in rows}
            if prefetched and done:  # never begun: the starts counted for them go back
                given = [lease for lease in leases if lease.id in done]
                conn.execute(
                    self.q["rate_log_unstart"],
                    {
                        "ids": [lease.id for lease in given],
                        "tokens": [lease.lease_token for lease in given],
                    },
                )
        return [lease.id in done for lease in leases]

    def _fan_in(self, conn: psycopg.Connection[Any], ended: Sequence[Any]) -> None:
        """The fan-in of the ``(id, workflow_id, state)`` just written that ended members."""
        members = [r[0] for r in ended if r[1] is not None and r[2] in ENDED]
        if members:
            run(conn, self.workflows.fan_in(members))

    # -- maintenance ---------------------------------------------------------------------
    def leader_attempt_elect(self, name: str, owner: str, ttl: float) -> bool:
        with self._conn() as conn:
            row = conn.execute(
                self.q["leader_attempt_elect"], {"name": name, "owner": owner, "ttl": ttl}
            ).fetchone()
        return row is not None and row[0] == owner

    def leader_resign(self, name: str, owner: str) -> None:
        with self._conn() as conn:
            conn.execute(self.q["leader_resign"], {"name": name, "owner": owner})

    def job_list_expired(self, limit: int) -> list[ExpiredLease]:
        with self._conn() as conn:
            rows = conn.execute(self.q["job_list_expired"], {"limit": limit}).fetchall()
        return [
            ExpiredLease(
                id=r[0], name=r[1], queue=r[2], lease_token=r[3], attempt=r[4],
                max_attempts=r[5], rescues=r[6], cancel_requested=bool(r[7]), lease_owner=r[8],
                fair=bool(r[9]),
            )
            for r in rows
        ]  # fmt: skip

    def job_rescue_many(self, rescues: Sequence[RescueParams]) -> list[bool]:
        if not rescues:
            return []
        with self._tx() as conn:
            rows = conn.execute(
                self.q[folding("job_rescue_many", [r.fair for r in rescues])],
                {
                    "ids": [r.id for r in rescues],
                    "tokens": [r.lease_token for r in rescues],
                    "states": [r.state for r in rescues],
                    "errors": [json.dumps(r.error) for r in rescues],
                    "delays": [r.delay for r in rescues],
                    "half_life": HALF_LIFE,
                },
            ).fetchall()
            self._fan_in(conn, rows)
        done = {r[0] for r in rows}
        return [r.id in done for r in rescues]

    def job_promote_due(self, limit: int = PROMOTE_BATCH) -> int:
        with self._conn() as conn:
            return conn.execute(self.q["job_promote_due"], {"limit": limit}).rowcount

    def job_prune(self, older_than: float, limit: int) -> int:
        with self._conn() as conn:
            row = conn.execute(
                self.q["job_prune"], {"older_than": older_than, "limit": limit}
            ).fetchone()
        return int(row[0]) if row else 0

    # -- wake-ups --------------------------------------------------------------------------
    def listener(self, on_queue: Callable[[str], None]) -> Any:
        if not self.config.listen:  # listen=false: polling alone (e.g. behind PgBouncer)
            return None
        from .notifier import Notifier

        return Notifier(self.config.conninfo, self.channel, on_queue)

    def result_listener(
        self,
        on_done: Callable[[list[int] | None], None],
        on_listen: Callable[[], None],
        on_lost: Callable[[], None] | None = None,
    ) -> Any:
        """One LISTEN connection on ``errands_done_<schema>``, where the ids of ended jobs
        are announced: by the statement that ends an attempt (its notify_ended CTE), and
        by the errands_jobs_ended trigger for every other end (schema 17). ``on_lost``:
        called when that connection drops (re-opened with backoff)."""
        if not self.config.listen:  # listen=false: waiters poll (e.g. behind PgBouncer)
            return None
        from .notifier import Notifier

        def parse(payload: str) -> None:
            try:
                on_done(None if payload == "*" else [int(i) for i in payload.split(",")])
            except ValueError:
                on_done(None)

        channel = done_channel(self.schema)
        name = f"errands-results:{os.getpid()}"  # which process's waiters, in pg_stat_activity
        return Notifier(
            self.config.conninfo, channel, parse, on_listen, "errands-results", name, on_lost
        )


def idle_limit(lease: float) -> str:
    """How long (ms, as text for set_config) one of errands' own transactions may idle
    before the server ends it: half a lease, between 1 and 5 s. Its statements follow one
    another at once; a transaction that idles longer has a client gone silent (a network
    cut, a frozen process) and holds locks others wait for: a limited queue's claim lock
    held so stopped every worker's claims, rescued jobs among them, for the 5 s of a cut
    (the full-size chaos soak)."""
    return str(int(min(max(lease / 2, IDLE_MIN), IDLE_MAX) * 1000))


# What a limited claim sends as one message where the server keeps prepared statements
# (errands.backends.postgres.batches): its first statement and a fair queue's first
# reads, then its write with the COMMIT.
BATCHED = ("limited_claim_start", "fair_heads", "fair_lookahead", "job_claim_ids")


class _LimitedStore:
    """A limited claim's statements, in one transaction. Where the server keeps prepared
    statements, it waits for the server twice: its BEGIN (with the idle limit and generic
    plans: limited_claim_begin), its first statement and the reads expected after it (a
    fair queue's first window and lookahead: ``expect``) go as one message, its write
    and its COMMIT as another (see batches.py); other reads, when a claim needs them, one
    by one. A fair claim waited six times, each wait then a wait for the GIL among the
    worker's busy threads: 5.4 ms a claim of 20 jobs, against 1.8 ms for a plain
    queue's one statement.

    Its first statement and a fair queue's first reads run with generic plans
    (plan_cache_mode, local to the transaction): planned once per connection, not at
    each claim. Left to choose, the server planned fair_heads anew every time (1 ms of a
    2 ms statement): a claim alone took 4.1 ms, 2.3 ms with generic plans. Their plans
    reach their rows through btree indexes whatever the statistics, and made on an empty
    table too (tests/postgres/test_claim_plans.py); the write is planned with its ids
    (plans_with_values), and the other statements as the server chooses."""

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        queries: dict[str, str],
        prefix: str,
        prepared: Prepared | None,
    ) -> None:
        self.conn = conn
        self.q = queries
        self.prefix = prefix  # lock names are per schema
        self.prepared = prepared  # None: each statement sent apart (?prepare=false)
        self.prepared_now = False  # this claim prepared them on its connection
        self._ahead: dict[str, tuple[dict[str, object], list[tuple[object, ...]] | None]] = {}
        self._begun = self._committed = False

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """The claim's transaction, begun by ``start``; rolled back when the claim
        raises."""
        conn = self.conn
        if self.prepared is not None:
            self.prepared_now = self.prepared.ensure(conn)  # outside the transaction
        try:
            yield
            if self._begun and not self._committed:
                conn.execute("COMMIT")
        except BaseException:
            if self.prepared is not None:
                # psycopg's ROLLBACK may come with a DEALLOCATE ALL: prepared anew next time
                self.prepared.forget(conn)
            idle = psycopg.pq.TransactionStatus.IDLE
            if not conn.closed and conn.info.transaction_status != idle:
                with contextlib.suppress(psycopg.Error):
                    conn.execute("ROLLBACK")
            raise

    def expect(self, query: str, params: dict[str, object]) -> bool:
        if self.prepared is not None and query in BATCHED:
            self._ahead[query] = (params, None)  # sent with start's statement
            return True
        return False

    def start(self, queue: str) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
        """BEGIN; then one limited claimer per queue at a time, cluster-wide, for this
        transaction; the queue's settings and its rate-limited types: one statement (and
        the reads expected after it, in the same message)."""
        params = {"lock": self.prefix + queue, "queue": queue}
        self._begun = True
        if self.prepared is None:  # generic plans only for statements prepared
            self.conn.execute(self.q["own_begin_filled"])
            [row] = self.conn.execute(self.q["limited_claim_start"], params).fetchall()
        else:
            ahead = list(self._ahead.items())
            results = run_batch(
                self.conn,
                [
                    self.q["limited_claim_begin_filled"],
                    self.prepared.execute(self.conn, "limited_claim_start", params),
                    *(self.prepared.execute(self.conn, q, p) for q, (p, _) in ahead),
                    self.q["plans_by_default"],
                ],
            )
            # BEGIN and the settings answer first; then the claim's statement, the reads
            [row] = results[2] or []
            for (query, (sent, _)), rows in zip(ahead, results[3:-1], strict=True):
                self._ahead[query] = (sent, rows or [])
        settings = [row[:10]] if row[0] is not None else []
        rates = [tuple(rate) for rate in json.loads(str(row[10]))] if row[10] else []
        return settings, rates

    def lock(self, names: list[str]) -> None:
        if names:
            self.conn.execute(self.q["limit_locks"], {"prefix": self.prefix, "names": names})

    def rows(self, query: str, params: dict[str, object]) -> list[tuple[object, ...]]:
        sent, ahead = self._ahead.pop(query, (None, None))
        if ahead is not None and sent == params:
            return ahead
        cur = self.conn.execute(self.q[query], params)
        return cur.fetchall() if returns_rows(cur) else []

    def claim(self, params: dict[str, object], *, last: bool) -> list[tuple[object, ...]]:
        if self.prepared is None or not last:
            if self.prepared is not None:  # psycopg prepares it too: planned with its ids
                self.conn.execute(self.q["plans_with_values"])
            return self.conn.execute(self.q["job_claim_ids"], params).fetchall()
        # the COMMIT in the same message: the rows are returned once it is done
        _, rows, _ = run_batch(
            self.conn,
            [
                self.q["plans_with_values"],
                self.prepared.execute(self.conn, "job_claim_ids", params),
                "COMMIT",
            ],
        )
        self._committed = True
        return rows or []

    def id_list(self, values: list[object]) -> object:
        return values


class _ReleaseWakeup:
    """The release of workflow dependents NOTIFYs their queues in its own statement,
    coalesced as every wake-up of this process is: a queue NOTIFYed within the window is
    skipped, and the queues the statement NOTIFYed are recorded."""

    def __init__(self, backend: PostgresBackend) -> None:
        self.backend = backend

    def params(self) -> dict[str, Any]:
        return {"channel": self.backend.channel, "recent": self.backend._notified_lately()}

    def sent(self, queues: set[str]) -> None:
        self.backend._notify_due(queues)  # records them (the statement sent what was due)


@contextmanager
def _atomic(conn: psycopg.Connection[Any], *, several: bool) -> Iterator[None]:
    """An enqueue of several statements (a batch, a keyed job, a workflow) on a caller's
    connection is stored whole or not at all. In autocommit mode, where each statement
    commits on its own, it runs in a transaction of its own (a workflow's nested members
    were claimable before their parent's rows existed; a batch's COPY stayed when its
    keyed INSERT failed). In the caller's transaction (open, or opened by it now), it
    runs in a savepoint: a failure midway takes back what it wrote, and the caller's
    transaction stays usable (a caller that caught the error and committed kept a
    workflow row with no members, running for ever, and part of a batch)."""
    if not several:
        yield
        return
    if _on_its_own(conn):
        with conn.transaction():
            yield
        return
    with savepoint(conn, (psycopg.Error,)):
        yield


@contextlib.asynccontextmanager
async def _aatomic(conn: psycopg.AsyncConnection[Any], *, several: bool) -> AsyncIterator[None]:
    """:func:`_atomic` for a psycopg ``AsyncConnection``."""
    if not several:
        yield
        return
    if _on_its_own(conn):
        async with conn.transaction():
            yield
        return
    async with asavepoint(conn, (psycopg.Error,)):
        yield


@contextmanager
def _caller_conflicts(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], what: str
) -> Iterator[None]:
    """An enqueue on a caller's connection that the server aborted to break a deadlock,
    for a serialization conflict, or at the connection's lock_timeout (SQLSTATE 40P01,
    40001, 55P03) raises DatabaseBusy saying what became of the caller's transaction and
    what to do: the driver's error said neither (and errands cannot run the caller's
    transaction again, as it runs its own). It is an instance of the driver's error class
    too, so a retry loop on that class (SERIALIZABLE's, on 40001) still catches it.
    Around :func:`_atomic`: what the enqueue wrote is already undone when it is read."""
    try:
        yield
    except psycopg.Error as exc:
        sqlstate = getattr(exc, "sqlstate", None)
        if sqlstate not in _CALLER_CONFLICTS or conn.broken or conn.closed:
            raise
        status = conn.info.transaction_status
        if status == psycopg.pq.TransactionStatus.IDLE:  # autocommit: its own, rolled back
            state = "nothing of it was stored (its transaction was rolled back): call it again"
        elif status == psycopg.pq.TransactionStatus.INERROR:
            state = "your transaction is aborted: roll it back and run it again, this enqueue too"
        elif sqlstate == "55P03":  # its savepoint rolled back; nothing else lost
            state = (
                "nothing of it was stored (rolled back to its savepoint) and your transaction "
                "is still open and usable: enqueue again once the other transaction has "
                "ended, or roll yours back"
            )
        else:  # its savepoint rolled back
            state = (
                "nothing of it was stored (rolled back to its savepoint) and your transaction "
                "is still open, but cannot go on as it is: roll it back and run it again, "
                "this enqueue too"
            )
        message = f"{what} on your connection failed: {_CALLER_CONFLICTS[sqlstate]}"
        raise busy_as(exc, f"{message} ({_first_line(exc)}); {state}") from exc


# What a caller's connection is told of each conflict _caller_conflicts turns into
# DatabaseBusy, by SQLSTATE
_CALLER_CONFLICTS = {
    "40P01": "PostgreSQL aborted it to break a deadlock with another transaction (each "
    "waited for a lock the other held: the same job keys, or rows, taken in opposite orders)",
    "40001": "it conflicts with a transaction that committed after yours began: your "
    "transaction is REPEATABLE READ or SERIALIZABLE, and that one took (or released) a job "
    "key this enqueue uses, which yours can neither see nor wait for",
    "55P03": "another transaction holds a job key this enqueue uses (it enqueued the same "
    "job name and key, or is releasing it, and has not ended yet), and your connection's "
    "lock_timeout ran out waiting for it",
}


def _on_its_own(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """An autocommit connection with no transaction open (a BEGIN sent by hand opens one:
    the enqueue is then part of it)."""
    idle = conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    return bool(conn.autocommit and idle)


def _usable(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """A caller's connection the enqueue can write through, or ConfigurationError naming
    the fix (the driver's own error came from deep inside)."""
    if conn.closed:
        raise ConfigurationError(
            "enqueue(conn=...): the connection is closed; pass an open one (the one whose "
            "transaction the jobs should commit with)"
        )
    if conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
        raise ConfigurationError(
            "enqueue(conn=...): the connection's transaction was aborted by a statement that "
            "failed earlier; nothing more can be written in it. Roll it back (and redo its "
            "work) before enqueueing in it"
        )


class _Checkout:
    """PostgresBackend._conn: a pool connection (checkout, its lock bound's BEGIN when
    the caller has one), inside an interrupt shield (interrupts.shielded: no hook's or
    handler's interrupt lands inside); at the end, as pool.connection() does (psycopg's
    Connection.__exit__), a transaction left open commits, or rolls back when the block
    raised, and the connection goes back to the pool. Errors are raised as
    PostgresBackend._conn_error makes them."""

    __slots__ = ("_backend", "_begins", "_bound", "_conn", "_ident", "_mark", "_timeout")

    def __init__(self, backend: PostgresBackend, timeout: float | None, begins: bool) -> None:
        self._backend = backend
        self._timeout = timeout
        self._begins = begins
        self._conn: psycopg.Connection[Any] | None = None

    def __enter__(self) -> psycopg.Connection[Any]:
        if self._conn is not None:  # (a generator's context manager refused it too)
            raise RuntimeError("a connection checkout is entered once")
        backend = self._backend
        if backend._reopen:
            backend._open_in_child()
        timeout = self._timeout
        if timeout is None:
            timeout = connection_wait(backend.pool.timeout)
        self._bound = bound = lock_wait()
        begin = backend._bounded_begin(bound) if bound is not None and not self._begins else None
        # as shielded() does: the shield begins inside the try whose handler ends it
        ident, mark = self._ident, self._mark = threading.get_ident(), object()
        try:
            enter_shield(ident, mark)
            self._conn = conn = backend._checkout(timeout, begin)
        except BaseException as exc:
            leave_shield(ident, mark)
            backend._conn_error(exc, bound)
            raise
        return conn

    def __exit__(self, typ: Any, exc: BaseException | None, tb: Any) -> None:
        backend, conn = self._backend, self._conn
        if conn is None:  # never entered, or left already: nothing to give back twice
            raise RuntimeError("a connection checkout is left once, after it was entered")
        self._conn = None
        try:
            try:
                if exc is None:
                    try:  # errands' connections are in autocommit: usually nothing to
                        # commit, no round trip (the status read off pgconn: conn.info
                        # builds an object per read)
                        if not conn.closed and conn.pgconn.transaction_status != IDLE:
                            conn.commit()
                    except BaseException:
                        _rollback_quietly(conn)
                        raise
                else:
                    _rollback_quietly(conn)
            finally:
                backend.pool.putconn(conn)
        except BaseException as raised:
            leave_shield(self._ident, self._mark)
            backend._conn_error(raised, self._bound)
            raise
        leave_shield(self._ident, self._mark)
        if exc is not None:
            backend._conn_error(exc, self._bound)  # else the block's error goes on as it is


def _rollback_quietly(conn: psycopg.Connection[Any]) -> None:
    """Roll back what a block that raised left open on ``conn``; a rollback that fails
    itself is logged, never hiding the error that got here."""
    if not conn.closed:
        try:
            conn.rollback()
        except Exception as exc:
            log.warning("error ignored in rollback on %s: %s", conn, exc)


_INSERT_CURSOR = "_errands_insert_cursor"


def _insert_cursor(conn: psycopg.Connection[Any]) -> psycopg.Cursor[Any]:
    """The cursor of ``conn`` (one of errands' own pool connections) the single-job
    insert runs on, made once per connection: ``conn.execute`` made a cursor per call
    (its adapters map, transformer and state), a fifth of the psycopg side of an enqueue
    one call per job. The pool hands a connection to one caller at a time, so its cursor
    is never used by two at once; it lives and closes with its connection."""
    cur: psycopg.Cursor[Any] | None = getattr(conn, _INSERT_CURSOR, None)
    if cur is None or cur.closed:
        cur = conn.cursor()
        setattr(conn, _INSERT_CURSOR, cur)
    return cur


def _enqueue_of(requests: Sequence[EnqueueRequest]) -> str:
    """'enqueue of job NAME' / 'enqueue of N jobs (NAMES)', for messages."""
    names = ", ".join(sorted({r.name for r in requests}))
    if len(requests) == 1:
        key = requests[0].key
        return f"enqueue of job {names}" + ("" if key is None else f" with key {key!r}")
    return f"enqueue of {len(requests)} jobs ({names})"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _key_arrays(requests: Sequence[EnqueueRequest]) -> dict[str, list[Any]]:
    """The ``names`` and ``keys`` arrays of ``requests``' keys, each (name, key) once."""
    pairs = sorted({(r.name, r.key) for r in requests if r.key is not None})
    return {"names": [n for n, _ in pairs], "keys": [k for _, k in pairs]}
