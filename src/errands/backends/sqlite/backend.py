"""The embedded SQLite backend: one file, many threads and processes on one host.

Every write runs under ``BEGIN IMMEDIATE`` so writers queue on the file lock (with a busy
timeout) instead of failing when a deferred transaction tries to upgrade. WAL mode lets
readers run beside the single writer. Each thread has its own connection. Lock contention
past the busy timeout is retried here with backoff, so "database is locked" never reaches
a user; only a store locked for ``write_timeout`` seconds raises :class:`DatabaseBusy`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import secrets
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar
from urllib.parse import unquote_plus, urlsplit

from ... import offloop
from ...errors import (
    ConfigurationError,
    DatabaseBusy,
    SchemaOutdated,
    StorageFull,
    busy_as,
)
from ...faults import fault_point
from ...interrupts import shielded
from ...jobs import EnqueueRequest, JobRow, Step, to_datetime
from ...jsontext import loads_stored
from .. import redact_url
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
    release_pauses,
    stop_asked,
    warn_newer_schema,
    writes_several,
)
from ..fair import HALF_LIFE, Weigher, fold_params, handler_seconds
from ..limits import claim_limited
from ..program import (
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
from ..shared_admin import suspend_program
from ..workflow_store import (
    ENDED,
    WorkflowInserted,
    WorkflowSpec,
    WorkflowStore,
    split_children,
)
from .admin import SQLiteAdmin
from .statements import MIGRATIONS, SCHEMA_VERSION, Q

log = logging.getLogger("errands.sqlite")
T = TypeVar("T")

BUSY_TIMEOUT_MS_DEFAULT = 5_000
WRITE_TIMEOUT_DEFAULT = 60.0
# An abandoned handler's transaction (see _end_abandoned): seconds its ROLLBACK waits for
# a statement still running before interrupting it, and how many times it is tried.
ABANDON_INTERRUPT_AFTER = 0.2
ABANDON_TRIES = 50
# Waiting for the write lock: tries this far apart at first, backing off to the most.
BEGIN_PAUSE_FIRST = 0.0001
BEGIN_PAUSE_MAX = 0.002
SYNCHRONOUS_CHOICES = ("OFF", "NORMAL", "FULL", "EXTRA")
# The write-ahead log: SQLite checkpoints it into the file every 1000 pages, but not past
# the snapshot of a read transaction still open, and it never shrinks the -wal file on
# its own (one long reader grew it from 4.5 MB to 152 MB in 15 s, and it stayed so after
# the reader ended). SQLite truncates it to WAL_LIMIT_BYTES when it starts the log over
# (PRAGMA journal_size_limit), and the maintenance leader empties it once it has grown
# past WAL_TRIM_BYTES, four times what the checkpoints every 1000 pages let it reach.
WAL_LIMIT_BYTES = 64 * 1024 * 1024
WAL_TRIM_BYTES = 16 * 1024 * 1024
WAL_WARN_AFTER = 60.0  # seconds a log stays too large to empty before a warning says why
WAL_WARN_EVERY = 300.0  # seconds between two such warnings


def parse_sqlite_url(url: str) -> tuple[str, dict[str, str]]:
    """``sqlite:///rel.db`` -> ``rel.db``; ``sqlite:////abs.db`` -> ``/abs.db``.

    The path is taken as written (no percent-decoding: ``%20`` is those three characters).
    ``?`` starts the options (``name=value``, joined by ``&``; their values are
    percent-decoded) and ``#`` is refused: a path holding either cannot be written here.
    (A ``#`` ended the path and the rest was ignored, and a ``?`` part without ``=`` was
    dropped: ``jobs#2.db`` and ``jobs?3.db`` both opened ``jobs``, another file.)"""
    parts, shown = urlsplit(url), redact_url(url)  # a mistyped URL may carry a password
    if "#" in url:
        raise ConfigurationError(
            f"SQLite URL {shown!r} holds '#', which would end the file's path there (a URL "
            "fragment); a file whose name holds '#' or '?' cannot be named in a URL: "
            "rename it, or name a symbolic link to it"
        )
    if parts.netloc:
        host = redact_url(f"sqlite://{parts.netloc}").removeprefix("sqlite://")
        raise ConfigurationError(
            f"SQLite URL {shown!r} has a host part {host!r}; write sqlite:///relative.db "
            "(three slashes) or sqlite:////absolute/path.db (four)"
        )
    path = parts.path[1:] if parts.path.startswith("/") else parts.path
    if not path:
        raise ConfigurationError(
            f"SQLite URL {shown!r} names no file; write e.g. sqlite:///errands.db"
        )
    options: dict[str, str] = {}
    for part in parts.query.split("&"):
        if not part:
            continue
        name, equals, value = part.partition("=")
        if not equals or not name:
            raise ConfigurationError(
                f"SQLite URL {shown!r}: {redact_url(part)!r} after '?' is not an option "
                "(write name=value, e.g. ?synchronous=FULL&write_timeout=30); a file whose "
                "name holds '?' cannot be named in a URL: rename it, or name a symbolic "
                "link to it"
            )
        name, value = unquote_plus(name), unquote_plus(value)
        if name in options:
            raise ConfigurationError(
                f"SQLite URL {shown!r}: option {redact_url(name)} is given twice; give it once"
            )
        options[name] = value
    unknown = set(options) - {"synchronous", "busy_timeout_ms", "write_timeout"}
    if unknown:
        names = ", ".join(sorted(redact_url(n) for n in unknown))  # a name may hold a password
        raise ConfigurationError(
            f"SQLite URL {shown!r}: unknown option(s) {names}; "
            "known: synchronous, busy_timeout_ms, write_timeout"
        )
    return path, options


SQLITE_BUSY_SNAPSHOT = 517  # (SQLITE_BUSY | 2 << 8): a reader's snapshot is out of date


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    text = str(exc).lower()
    return "locked" in text or "busy" in text


def _is_full(exc: sqlite3.Error) -> bool:
    """SQLITE_FULL: the disk is full, or the file reached ``PRAGMA max_page_count``."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code == sqlite3.SQLITE_FULL or "database or disk is full" in str(exc)


def _not_writable(exc: sqlite3.Error) -> bool:
    """SQLITE_READONLY, SQLITE_CANTOPEN or SQLITE_PERM: this process may not write the file,
    or create the ``-wal`` and ``-shm`` files beside it (a file or folder of another user,
    a read-only mount)."""
    code = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF
    return code in (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PERM)


# What a migration meets on tables that do not match the version errands_migrations records
SCHEMA_MISMATCH = ("already exists", "duplicate column", "no such table", "no such column")


def _split_statements(script: str) -> list[str]:
    statements, buffer = [], ""
    for line in script.splitlines(keepends=True):
        buffer += line
        if sqlite3.complete_statement(buffer):
            if buffer.strip():
                statements.append(buffer.strip())
            buffer = ""
    if buffer.strip() and not all(
        ln.strip().startswith("--") or not ln.strip() for ln in buffer.splitlines()
    ):
        raise ValueError(f"incomplete SQL statement at the end of a migration: {buffer!r}")
    return statements


# Connections a forked child inherited from its parent and let go of: kept referenced here
# for the child's life, never closed (see _Connection.__del__).
_INHERITED: list[sqlite3.Connection] = []


class _Connection(sqlite3.Connection):
    """A connection of the store's, which knows the process that opened it.

    Dropped (its last reference gone: sqlite3 closes a connection it collects, and Python
    3.13 warns of each), it is closed here only in these cases, and otherwise not (a leak
    shows):

    - in a child forked from the process that opened it, it is never closed: SQLite's
      docs forbid carrying a connection across ``fork()``, and closing one there uses it
      (the close runs on SQLite's lock bookkeeping as the fork copied it from the parent:
      it can release the POSIX locks of the child's own connections to the file, and a
      close taken for the file's last checkpoints and deletes the ``-wal`` and ``-shm``
      files the parent still writes through). It is kept in ``_INHERITED`` instead, so
      that no garbage collection closes it either;
    - one marked ``close_when_dropped`` is closed once nothing refers to it any more,
      which is when no call can be running on it (a running call holds its connection):
      an abandoned handler's ``ctx.transaction()`` connection (``tx_abandon``: the handler,
      or a thread it started, may be in a statement on it until it lets go, and nothing
      tells errands when it does), and the in-memory store's one (close() could not wait
      for a call on it to end, or the store was never closed).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.opened_in = os.getpid()
        self.close_when_dropped = False

    def __del__(self, _getpid: Callable[[], int] = os.getpid) -> None:
        opened_in = getattr(self, "opened_in", None)
        if opened_in is None:  # its open failed (a folder, a missing one): nothing to close
            return
        if _getpid() != opened_in:
            _INHERITED.append(self)  # resurrected: never collected, never closed
        elif self.close_when_dropped:
            with contextlib.suppress(sqlite3.Error):
                self.close()


class _CloseWithThread:
    """Kept in a thread's locals beside its connection: when the thread ends, its locals
    are dropped and this closes the connection, on that thread. (sqlite3's connection
    refers to itself through its statement cache, so dropping it closes nothing until a
    garbage collection: the connections of finished threads stayed open, two file
    descriptors each, and a thread per request ran out of them.)

    The only other time a thread's locals are dropped is when the store itself is
    collected (they are its ``_local``): then the closer runs on whichever thread
    collects it, and closes the connection there (hence ``check_same_thread=False``).
    That is safe, as no call can be running on the connection then: a call's frames
    hold the store. (A store closed while a long-lived thread, such as a hook lane's, kept
    its connection left that connection to the garbage collector.) In a forked child it
    closes nothing (see :class:`_Connection`)."""

    __slots__ = ("conn",)

    def __init__(self, conn: _Connection) -> None:
        self.conn = conn

    def __del__(self, _getpid: Callable[[], int] = os.getpid) -> None:
        if _getpid() == self.conn.opened_in:
            with contextlib.suppress(Exception):
                self.conn.close()


class SQLiteBackend(SQLiteAdmin):
    capabilities = Capabilities(
        listen_notify=False,
        skip_locked=False,
        caller_connection="sqlite3.Connection",
        single_writer=True,
    )

    def __init__(self, url: str, *, auto_migrate: bool = True) -> None:
        self.url = url
        # Where each fair queue's rotation over its keys stands (errands.backends.limits):
        # this process's own, never stored (no row that every claim would update).
        self._fair_cursors: dict[str, str] = {}
        path, options = parse_sqlite_url(url)
        self.memory = path == ":memory:"
        self.path = path if self.memory else os.path.abspath(path)
        synchronous = options.get("synchronous", "NORMAL").upper()
        if synchronous not in SYNCHRONOUS_CHOICES:
            raise ConfigurationError(
                f"SQLite URL option synchronous={synchronous!r}: choose one of "
                f"{', '.join(SYNCHRONOUS_CHOICES)}"
            )
        self.synchronous = synchronous
        try:
            self.busy_timeout_ms = int(options.get("busy_timeout_ms", BUSY_TIMEOUT_MS_DEFAULT))
            self.write_timeout = float(options.get("write_timeout", WRITE_TIMEOUT_DEFAULT))
        except ValueError:
            raise ConfigurationError(
                f"SQLite URL {url!r}: busy_timeout_ms must be a whole number of milliseconds "
                "and write_timeout a number of seconds"
            ) from None
        # A negative write_timeout made the in-process write lock wait for ever, nan never
        # time out: both are refused, as are timeouts past an hour (a writer held that
        # long is a fault to report, not to wait out).
        if not 0 <= self.busy_timeout_ms <= 3_600_000 or not 0 < self.write_timeout <= 3600:
            raise ConfigurationError(
                f"SQLite URL {url!r}: busy_timeout_ms must be 0 to 3600000 (ms) and "
                "write_timeout more than 0 and at most 3600 (s)"
            )
        if not self.memory:
            folder = os.path.dirname(self.path)
            if not os.path.isdir(folder):
                raise ConfigurationError(
                    f"SQLite URL {url!r}: folder {folder!r} does not exist; create it first"
                )
        self._wal_warned_at = float("-inf")
        self._wal_big_since: float | None = None  # since when wal_trim cannot empty the log
        self._pid = -1
        self._fresh_process()
        self.workflows = WorkflowStore(Q, self._insert_program, json.dumps, rows=json.dumps)
        self._newer_told = False  # a schema newer than this errands: warned once
        if auto_migrate:
            self._migrate_on_open()

    # -- connections ---------------------------------------------------------------
    def _fresh_process(self) -> None:
        """Connections and locks of this process: at start, and in a child after a fork.
        A child never shares the parent's connections, nor inherits its locks as they
        were at the fork: a lock another thread held then stayed held for good (every
        write in the child raised DatabaseBusy; one taking the in-memory store's lock hung).

        The parent's connections that the child lets go of here (the forking thread's,
        the in-memory store's) are never closed in the child: they keep themselves
        referenced for its life (:class:`_Connection`), as do those of the parent's other
        threads, whose thread-locals the interpreter clears at the fork."""
        self._local = threading.local()
        # ":memory:" is one database per connection, so it gets one connection and a lock.
        self._memory_lock = threading.RLock() if self.memory else None
        self._writer = threading.Lock()  # one write transaction of this process at a time
        self._shared: _Connection | None = None
        self._pid = os.getpid()

    def _connect(self, statement_cache: int = 128) -> _Connection:
        """A new connection. Usable from any thread (``check_same_thread=False``): the
        in-memory store's one is every thread's, a ctx.transaction() connection is
        committed by whichever thread decides the outcome, and a thread's own is closed
        by whichever thread collects the store (see :class:`_CloseWithThread`). That a
        thread's connection is used by that thread alone is this class's to keep
        (``_local``)."""
        try:
            conn = sqlite3.connect(
                self.path,
                factory=_Connection,
                isolation_level=None,
                timeout=self.busy_timeout_ms / 1000,
                check_same_thread=False,
                cached_statements=statement_cache,
            )
        except sqlite3.OperationalError as exc:
            if os.path.isdir(self.path):
                raise ConfigurationError(
                    f"cannot open SQLite database {self.path!r}: it is a folder; name a file "
                    "in it, e.g. sqlite:///folder/errands.db"
                ) from exc
            if _not_writable(exc):
                raise self._not_writable(exc) from exc
            raise ConfigurationError(f"cannot open SQLite database {self.path!r}: {exc}") from exc
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_ms)}")
            if not self.memory:
                self._retry(lambda: conn.execute("PRAGMA journal_mode = WAL"))
            conn.execute(f"PRAGMA synchronous = {self.synchronous}")
            conn.execute(f"PRAGMA journal_size_limit = {int(WAL_LIMIT_BYTES)}")
        except sqlite3.DatabaseError as exc:  # e.g. "file is not a database"
            conn.close()
            if _not_writable(exc):  # (it said to check the URL names an errands file)
                raise self._not_writable(exc) from exc
            if isinstance(exc, sqlite3.OperationalError):  # a disk I/O error: no such hint
                raise ConfigurationError(
                    f"cannot use SQLite database {self.path!r}: {exc}"
                ) from exc
            raise ConfigurationError(
                f"cannot use SQLite database {self.path!r}: {exc}; check that the URL names "
                "an errands SQLite file (or a new one)"
            ) from exc
        return conn

    def _not_writable(self, exc: sqlite3.Error) -> ConfigurationError:
        """The error for a file this process may not write (see :func:`_not_writable`)."""
        folder = os.path.dirname(self.path)
        name = getattr(exc, "sqlite_errorname", "") or type(exc).__name__
        uid = f" (uid {os.getuid()})" if hasattr(os, "getuid") else ""
        return ConfigurationError(
            f"SQLite database {self.path!r} cannot be written ({exc}; {name}): errands writes "
            f"the file and creates its -wal and -shm files beside it. Let the user this "
            f"process runs as{uid} write the file and its folder {folder!r} (or run as the "
            "file's owner), and check that the file system is not mounted read-only"
        )

    def _conn(self) -> _Connection:
        """This thread's connection (the in-memory store's one: take ``_memory_lock``
        first, so that close() cannot close it under the call)."""
        if os.getpid() != self._pid:
            self._fresh_process()
        if self.memory:
            shared = self._shared
            if shared is None:
                shared = self._shared = self._connect()
                shared.close_when_dropped = True  # (see close)
            return shared
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._connect()
            self._local.closer = _CloseWithThread(conn)
        return conn

    def close(self) -> None:
        """Close the store's connections that no call can be using now: the calling
        thread's own, and the in-memory store's one once no thread is in a call on it.

        Another thread's connection is never closed here: that thread may be inside a
        call on it, and closing a connection under a running call freed what the call was
        using and crashed the process. It is closed on its thread when the thread ends,
        or, for a thread that outlives the store (a hook lane's, an executor's), when the
        store is collected (see :class:`_CloseWithThread`); until then the thread goes on
        using it if it calls the store again. A ctx.transaction() connection is never
        closed here either, for the same reason (its handler's thread may be in COMMIT,
        on an App closed while its worker still completed a job): whoever ends that
        transaction closes it (tx_finish, tx_rollback), and an abandoned one closes once
        its handler lets go of it (:class:`_Connection`)."""
        if os.getpid() != self._pid:  # forked: the parent's are not the child's to close
            self._fresh_process()
            return
        own = getattr(self._local, "conn", None)
        if own is not None:
            del self._local.conn, self._local.closer
            with contextlib.suppress(sqlite3.Error):
                own.close()
        shared, self._shared = self._shared, None
        lock = self._memory_lock
        # The in-memory store's one connection, once no thread is in a call on it (closed
        # under a running statement, it crashed the process as above). A call that holds
        # it past write_timeout: it closes once that call lets go of it (_Connection).
        if shared is not None and lock is not None and lock.acquire(timeout=self.write_timeout):
            try:
                with contextlib.suppress(sqlite3.Error):
                    shared.close()
            finally:
                lock.release()

    def _retry(
        self, fn: Any, timeout: float | None = None, first: float = 0.005, most: float = 0.5
    ) -> Any:
        """``fn()``, tried again while the file is locked: after ``first`` seconds, doubling
        to ``most`` (with jitter), until ``timeout`` (default ``write_timeout``), then
        DatabaseBusy."""
        limit = self.write_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        pause = first
        while True:
            try:
                return fn()
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc):
                    raise
                if stop_asked():  # (a stopping worker's claim: base.calls_until_stopped)
                    raise DatabaseBusy(
                        f"SQLite database {self.path!r} is locked, and the caller is "
                        "stopping: given up"
                    ) from exc
                if time.monotonic() >= deadline:
                    raise DatabaseBusy(
                        f"SQLite database {self.path!r} stayed locked for "
                        f"{limit:.1f} s; is a long transaction holding it "
                        "(a sqlite3 shell, or a caller's open transaction)?"
                    ) from exc
                time.sleep(pause * (0.5 + random.random()))
                pause = min(pause * 2, most)

    def _begin(self, conn: sqlite3.Connection, timeout: float | None = None) -> None:
        """BEGIN IMMEDIATE, waiting for the file's write lock at most ``timeout`` (default
        ``write_timeout``), then DatabaseBusy.

        SQLite's own busy handler waits for the lock by sleeping 1, 2, 5, 10, 15, 20, 25 ...
        ms between tries: two worker processes whose transactions take well under a
        millisecond then spend most of a run asleep (measured: 8 ms a wait on average).
        The wait here tries again after 0.1 ms, backing off to 2 ms, so the lock changes
        hands within about as long as a transaction holds it.
        """
        conn.execute("PRAGMA busy_timeout = 0")
        try:
            self._retry(
                lambda: conn.execute("BEGIN IMMEDIATE"),
                timeout,
                first=BEGIN_PAUSE_FIRST,
                most=BEGIN_PAUSE_MAX,
            )
        finally:
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_ms)}")

    @contextmanager
    def _write(self, timeout: float | None = None) -> Iterator[sqlite3.Connection]:
        """One write transaction under BEGIN IMMEDIATE, waiting while the file is locked.

        ``timeout`` bounds the wait for the lock below ``write_timeout`` (heartbeats must
        give up before the lease they renew runs out, so the worker can self-fence). The
        threads of one process queue on a lock of their own first (woken at once when it
        is free), so only one of them at a time waits for the file. A write with a
        ``timeout`` does not queue there: a thread's lock is not fair, and the claim and
        completion loops, taking it again and again, could keep a heartbeat out past its
        lease; it tries for the file directly, between their transactions.
        """
        # no hook's or handler's interrupt lands while the lock is held (errands.interrupts)
        with shielded(), self._write_unshielded(timeout) as conn:
            yield conn

    @contextmanager
    def _write_unshielded(self, timeout: float | None) -> Iterator[sqlite3.Connection]:
        if os.getpid() != self._pid:  # forked: this process's own locks, before taking one
            self._fresh_process()
        started = time.monotonic()
        lock = self._memory_lock or (self._writer if timeout is None else None)
        # A caller's deadline (base.calls_until: a stopping worker's release and its
        # leaving the registry, the leader's election) bounds the wait for the lock as it
        # bounds PostgreSQL's wait for a connection: its helper thread, whose answer is
        # no longer waited for, does not write it late, write_timeout after.
        limit = connection_wait(self.write_timeout) if timeout is None else timeout
        if lock is not None and not lock.acquire(timeout=limit):
            raise DatabaseBusy(
                f"SQLite database {self.path!r}: another thread of this process held its "
                f"write transaction open for {limit:.1f} s"
            )
        try:
            conn = self._conn()
            try:
                # inside: an exception (a Ctrl-C) just after BEGIN IMMEDIATE took the lock
                # left the transaction open, and the file locked for every writer
                self._begin(conn, max(limit - (time.monotonic() - started), 0.0))
                yield conn
                conn.execute("COMMIT")
            except BaseException as exc:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                if isinstance(exc, sqlite3.Error) and _is_full(exc):
                    raise self._storage_full(exc) from exc
                if isinstance(exc, sqlite3.Error) and _not_writable(exc):
                    raise self._not_writable(exc) from exc
                raise
        finally:
            if lock is not None:
                lock.release()

    def _storage_full(self, exc: sqlite3.Error) -> StorageFull:
        return StorageFull(
            f"SQLite database {self.path!r} is full ({exc}): nothing was written. Free disk "
            "space (or raise PRAGMA max_page_count), and prune finished jobs (App(retention=...))"
        )

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        if os.getpid() != self._pid:
            self._fresh_process()
        lock = self._memory_lock
        with shielded():
            if lock is not None:
                lock.acquire()
            try:
                yield self._conn()
            finally:
                if lock is not None:
                    lock.release()

    # -- the write-ahead log -------------------------------------------------------------
    def _wal_bytes(self) -> int:
        try:
            return os.path.getsize(self.path + "-wal")
        except OSError:
            return 0  # no log right now

    def wal_trim(self) -> None:
        """Empty the write-ahead log once it has grown past WAL_TRIM_BYTES (a read
        transaction kept SQLite's own checkpoints from catching up), without waiting for
        any reader or writer: a PASSIVE checkpoint first (it copies what it can while
        writers go on), then, once everything is copied, a TRUNCATE with no busy wait (it
        takes the write lock only to copy the few pages written meanwhile, and gives up
        at once, as PASSIVE, while a reader still uses the log: the next call tries
        again). A log that a reader keeps large for WAL_WARN_AFTER seconds is a warning
        (every WAL_WARN_EVERY seconds)."""
        if self.memory or self._wal_bytes() <= WAL_TRIM_BYTES:
            self._wal_big_since = None
            return
        with self._read() as conn:
            conn.execute("PRAGMA busy_timeout = 0")
            try:
                busy, frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                if not busy and frames == copied:
                    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            finally:
                conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_ms)}")
        size, now = self._wal_bytes(), time.monotonic()
        if size <= WAL_TRIM_BYTES:
            self._wal_big_since = None
            return
        if self._wal_big_since is None:  # (a writer in the way: the next tick empties it)
            self._wal_big_since = now
        elif now - self._wal_big_since >= WAL_WARN_AFTER and (
            now >= self._wal_warned_at + WAL_WARN_EVERY
        ):
            self._wal_warned_at = now
            log.warning(
                "the write-ahead log of %r is %.0f MB and has not been emptied for %.0f s: "
                "a read transaction uses it. Is one open for long (a sqlite3 shell, a "
                "report, a caller's transaction)? It is emptied once that transaction ends",
                self.path,
                size / 1e6,
                now - self._wal_big_since,
            )

    # -- schema ----------------------------------------------------------------------
    def _applied_version(self, conn: sqlite3.Connection) -> int:
        exists = conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'errands_migrations'"
        ).fetchone()
        if not exists:
            return 0
        row = conn.execute("SELECT max(version) FROM errands_migrations").fetchone()
        return int(row[0] or 0)

    def migrate(self) -> list[str]:
        """Apply the migrations this file lacks. Read first: the write lock is taken only
        when one is due (an up-to-date store opened while a transaction held the lock
        waited for it, and raised DatabaseBusy after write_timeout)."""
        with self._read() as conn:
            if self._applied_version(conn) == SCHEMA_VERSION:
                return []
        applied: list[str] = []
        with self._write() as conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS errands_migrations ("
                "version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at REAL NOT NULL)"
            )
            current = self._applied_version(conn)
            if current > SCHEMA_VERSION:
                raise SchemaOutdated(
                    f"the database {self.path!r} has errands schema version {current}, newer "
                    f"than this errands ({SCHEMA_VERSION}); upgrade errands on this host"
                )
            for version, name, sql in MIGRATIONS:
                if version <= current:
                    continue
                for statement in _split_statements(sql):
                    try:
                        conn.execute(statement)
                    except sqlite3.OperationalError as exc:
                        # only tables that do not match their recorded version: a file
                        # this process may not write (or an I/O error) was reported as
                        # one, with "restore the file from a backup"
                        if not any(what in str(exc) for what in SCHEMA_MISMATCH):
                            raise
                        raise SchemaOutdated(
                            f"cannot apply errands migration {version:04d}_{name} to "
                            f"{self.path!r}: {exc}. errands_migrations records version "
                            f"{current}, but the tables do not match it (was that table edited, "
                            "or the file restored from a copy?); restore the file from a backup"
                        ) from None
                conn.execute(
                    "INSERT INTO errands_migrations (version, name, applied_at) "
                    "VALUES (?, ?, (julianday('now') - 2440587.5) * 86400.0)",
                    (version, name),
                )
                applied.append(f"{version:04d}_{name}")
        return applied

    def _migrate_on_open(self) -> None:
        """Migrate as the store opens, except a file newer than this errands (a newer
        release migrated it), which this process runs on as schema_check lets it: a
        worker of the previous release, restarted after a newer one had opened the
        file, could not even open it."""
        with self._read() as conn:
            current = self._applied_version(conn)
        if current > SCHEMA_VERSION:
            self._newer(current)
            return
        self.migrate()

    def schema_check(self) -> None:
        """Refuse a schema older than this errands needs. A newer one (a newer release
        migrated it, while this one still runs) is run on, with a warning: the
        migrations keep the code of the release before them working."""
        with self._read() as conn:
            current = self._applied_version(conn)
        if current < SCHEMA_VERSION:
            raise SchemaOutdated(
                f"the database {self.path!r} has errands schema version {current}, this errands "
                f"needs {SCHEMA_VERSION}; run: errands migrate --app <module:app>"
            )
        if current > SCHEMA_VERSION:
            self._newer(current)

    def _newer(self, current: int) -> None:
        """Warn, once per store, of a schema newer than this errands."""
        if self._newer_told:
            return
        self._newer_told = True
        warn_newer_schema(log, f"the database {self.path!r}", current, SCHEMA_VERSION)

    # -- enqueue ---------------------------------------------------------------------
    def _caller_program(self, conn: Any) -> Program[None]:
        """Check a caller's connection (sync or async) is on this store's file."""
        if self.memory:
            raise ConfigurationError(
                "enqueue(conn=...) needs a file database: an in-memory SQLite database is "
                "private to one connection"
            )
        rows = yield Stmt("PRAGMA database_list")
        # (os.fsdecode: a connection whose text_factory is bytes reads b"main" and a bytes
        # path, and was refused as "an in-memory database")
        main = next((os.fsdecode(r[2]) for r in rows if os.fsdecode(r[1]) == "main"), "")
        if not main or os.path.realpath(main) != os.path.realpath(self.path):
            raise ConfigurationError(
                f"enqueue(conn=...) got a connection to {main or 'an in-memory database'!r}, "
                f"but this app stores jobs in {self.path!r}; open the connection on the same file"
            )

    def _check_caller_connection(self, conn: Any) -> sqlite3.Connection:
        given, conn = conn, unwrap_connection(conn)  # a SQLAlchemy Session or Connection
        if not isinstance(conn, sqlite3.Connection):
            raise ConfigurationError(
                "enqueue(conn=...) on SQLite takes a sqlite3.Connection, or a SQLAlchemy "
                f"Connection/Session using sqlite3; got {type(given).__name__}"
            )
        try:
            conn.total_changes  # noqa: B018 - raises on a closed connection
        except sqlite3.ProgrammingError:
            raise ConfigurationError(
                "enqueue(conn=...): the connection is closed; pass an open one (the one "
                "whose transaction the jobs should commit with)"
            ) from None
        run(conn, self._caller_program(conn))
        return conn

    async def _acaller_connection(self, conn: Any) -> Any:
        raw = await async_driver_connection(conn)
        if not type(raw).__module__.startswith("aiosqlite"):
            raise ConfigurationError(
                "aenqueue(conn=...) on SQLite takes an aiosqlite Connection, or an SQLAlchemy "
                f"AsyncSession/AsyncConnection using aiosqlite; got {type(conn).__name__}"
            )
        await arun(raw, self._caller_program(raw))
        return raw

    @staticmethod
    def _insert_program(requests: Sequence[EnqueueRequest]) -> Program[list[InsertResult]]:
        results = []
        for req in requests:
            if req.key is not None:
                yield Stmt(Q["job_expire_key"], {"name": req.name, "key": req.key})
            rows = yield Stmt(Q["job_insert"], insert_params(req))
            if rows:
                results.append(InsertResult(id=rows[0][0], deduplicated=False))
                continue
            rows = yield Stmt(Q["job_id_by_key"], {"name": req.name, "key": req.key})
            results.append(InsertResult(id=rows[0][0], deduplicated=True))
        return results

    def _insert(self, conn: sqlite3.Connection, req: EnqueueRequest) -> InsertResult:
        return run(conn, self._insert_program([req]))[0]

    def job_insert_many(
        self, requests: Sequence[EnqueueRequest], conn: Any = None
    ) -> list[InsertResult]:
        if conn is not None:
            caller = self._check_caller_connection(conn)
            several = writes_several(requests)
            with (
                self._caller_errors(caller, _enqueue_of(requests)),
                _atomic(caller, several=several),
            ):
                return run(caller, self._insert_program(requests))
        with self._write() as own:
            return run(own, self._insert_program(requests))

    async def ajob_insert_many(
        self, requests: Sequence[EnqueueRequest], conn: Any = None
    ) -> list[InsertResult]:
        if conn is None:  # the store's own connection, in a thread: the loop never blocks
            return await offloop.run(self.job_insert_many, requests)
        caller = await self._acaller_connection(conn)
        with self._caller_errors(caller, _enqueue_of(requests)):
            async with _aatomic(caller, several=writes_several(requests)):
                return await arun(caller, self._insert_program(requests))

    @contextlib.contextmanager
    def _caller_errors(self, conn: Any, what: str) -> Iterator[None]:
        """A write on a caller's connection (sqlite3 or aiosqlite): SQLITE_FULL is
        StorageFull, as on errands' own (a workflow's insert let the driver's error
        through); a locked file is DatabaseBusy naming its two causes and what to do (the
        driver's bare "database is locked" came through). Around ``_atomic``: what the
        enqueue wrote is already undone when it is raised."""
        try:
            yield
        except sqlite3.Error as exc:
            if _is_full(exc):
                raise self._storage_full(exc) from exc
            if isinstance(exc, sqlite3.OperationalError) and _is_busy(exc):
                raise _caller_busy(conn, what, exc) from exc
            raise

    # -- workflows ---------------------------------------------------------------------
    def workflow_insert(self, spec: WorkflowSpec, conn: Any = None) -> WorkflowInserted:
        if conn is not None:
            caller = self._check_caller_connection(conn)
            what = f"enqueue of workflow {spec.name!r}"
            with self._caller_errors(caller, what), _atomic(caller, several=True):
                return run(caller, self.workflows.insert(spec))
        with self._write() as own:
            return run(own, self.workflows.insert(spec))

    async def aworkflow_insert(self, spec: WorkflowSpec, conn: Any = None) -> WorkflowInserted:
        if conn is None:  # the store's own connection, in a thread: the loop never blocks
            return await offloop.run(self.workflow_insert, spec)
        caller = await self._acaller_connection(conn)
        with self._caller_errors(caller, f"enqueue of workflow {spec.name!r}"):
            async with _aatomic(caller, several=True):
                return await arun(caller, self.workflows.insert(spec))

    def _read_program(self, factory: Callable[[], Program[T]]) -> T:
        with self._read() as conn:
            return run(conn, factory())

    # -- the hot path ------------------------------------------------------------------
    def job_claim(self, params: ClaimParams) -> list[JobRow]:
        if params.limit <= 0:
            return []
        # No claim here can lose its reply, as one on PostgreSQL can (whose jobs are then
        # given back: postgres/lost_claims.py): it runs in this process, and its COMMIT
        # either returns or raises with the transaction rolled back; a process that dies
        # after the COMMIT takes the claim loop with it, and the lease covers its jobs.
        token = secrets.token_hex(8)
        names = None if params.names is None else json.dumps(list(params.names))
        rows: list[JobRow] = []
        with self._write() as conn:
            for queue in params.queues:
                remaining = min(params.limit - len(rows), queue.limit)
                if params.limit - len(rows) <= 0:
                    break
                if remaining <= 0:
                    continue
                cur = conn.execute(
                    Q["job_claim_suspect" if params.suspects else "job_claim"],
                    {
                        "worker_id": params.worker_id,
                        "token": token,
                        "lease_default": params.lease_seconds_default,
                        "queue": queue.name,
                        "limit": remaining,
                        "names": names,
                    },
                )
                rows.extend(JobRow(*r) for r in cur.fetchall())
        return rows

    def job_finish_many(self, outcomes: Sequence[FinishParams]) -> list[bool]:
        if not outcomes:
            return []
        self.workflows.forget()
        # The attempts of fair keys folded in one statement (a suspension folds its own)
        fold: dict[tuple[int, str | None], float | None] = {}
        for o in outcomes:
            if o.fair is not False and o.state != "waiting":
                fold.setdefault((o.id, o.lease_token), handler_seconds(o.ran))
        with self._write() as conn:
            if fold:
                folded = [[i, token, ran] for (i, token), ran in fold.items()]
                params = {"outcomes": json.dumps(folded), "half_life": HALF_LIFE}
                conn.execute(Q["fair_fold_many"], params)
            answers = [self._finish(conn, o, folded=True) for o in outcomes]
        fault_point("after_finish_commit")
        if self.workflows.take_fanned():
            fault_point("after_fan_in_commit")
        return answers

    def _finish(self, conn: sqlite3.Connection, o: FinishParams, *, folded: bool = False) -> bool:
        """The fenced write of one outcome; its children are inserted only if it lands,
        and a workflow member's fan-in runs in the same transaction. ``folded``: its
        attempt's fold was written already (job_finish_many's fair_fold_many)."""
        if o.state == "waiting":  # under the write lock: a signal is either stored or not
            return run(conn, suspend_program(Q, o, self.workflows.fan_in))
        if o.fair is not False and not folded:  # under the fence; no fair key: nothing
            conn.execute(Q["fair_fold"], fold_params(o.id, o.lease_token, ran=o.ran))
        rows = conn.execute(
            Q["job_finish"],
            {
                "id": o.id,
                "token": o.lease_token,
                "state": o.state,
                "result": o.result_json,
                "error": None if o.error is None else json.dumps(o.error),
                "delay": o.delay,
            },
        ).fetchall()
        if not rows:
            return False
        if o.state == "completed":
            plain, adds = split_children(o)
            for child in plain:
                self._insert(conn, child)
            if adds and rows[0][0] is not None:
                run(conn, self.workflows.add(rows[0][0], adds))
        self._fan_in(conn, [(o.id, *rows[0])])
        return True

    def _fan_in(self, conn: sqlite3.Connection, ended: Sequence[tuple[int, Any, Any]]) -> None:
        """The fan-in of the ``(id, workflow_id, state)`` just written that ended members."""
        members = [i for i, workflow, state in ended if workflow is not None and state in ENDED]
        if members:
            run(conn, self.workflows.fan_in(members))

    # -- queues and limits ----------------------------------------------------------------
    def queue_settings(self) -> list[QueueSettings]:
        with self._read() as conn:
            rows = conn.execute(Q["queue_settings_list"]).fetchall()
        return [_settings(r) for r in rows]

    def queue_declare(self, settings: QueueSettings, actor: str) -> None:
        with self._write() as conn:
            conn.execute(
                Q["queue_declare"],
                {
                    "name": settings.name,
                    "max_running": settings.max_running,
                    "rate_limit": settings.rate_limit,
                    "rate_period": settings.rate_period,
                    "has_keys": int(settings.jobs_declare_limits),
                    "fair": int(settings.fair),
                    "aging": settings.aging,
                    "actor": actor,
                },
            )

    def queue_declare_keyed(self, name: str, actor: str) -> None:
        with self._write() as conn:
            conn.execute(Q["queue_declare_keyed"], {"name": name, "actor": actor})

    def queue_set_paused(self, name: str, paused: bool, actor: str) -> None:
        with self._write() as conn:
            conn.execute(
                Q["queue_set_paused"], {"name": name, "paused": int(paused), "actor": actor}
            )
            conn.execute(
                Q["audit_insert"],
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
        with self._write() as conn:
            conn.execute(
                Q["job_limit_declare"],
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
        with self._write() as conn:  # BEGIN IMMEDIATE: limited claims run one at a time
            store = _LimitedStore(conn)
            rows = claim_limited(
                store,
                queue.name,
                queue.limit,
                {
                    "worker_id": worker_id,
                    "token": secrets.token_hex(8),
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

    def queues_with_limits(self, queues: Sequence[str]) -> set[str]:
        if not queues:
            return set()
        with self._read() as conn:
            rows = conn.execute(Q["queues_with_limits"], {"queues": json.dumps(list(queues))})
            return {r[0] for r in rows.fetchall()}

    def dead_hooks_due(self, older_than: float, limit: int) -> list[int]:
        with self._write() as conn:
            conn.execute(Q["dead_hooks_forget"], {"older_than": older_than})
            if limit <= 0:
                return []
            rows = conn.execute(
                Q["dead_hooks_due"], {"older_than": older_than, "limit": limit}
            ).fetchall()
        return [int(r[0]) for r in rows]

    def dead_hooks_done(self, job_id: int, died_at: float) -> None:
        with self._write() as conn:
            conn.execute(Q["dead_hooks_done"], {"job_id": job_id, "died_at": died_at})

    def rate_log_prune(self, older_than: float) -> int:
        with self._write() as conn:
            return conn.execute(Q["rate_log_prune"], {"older_than": older_than}).rowcount

    # -- cron ------------------------------------------------------------------------------
    def cron_states(self) -> list[CronState]:
        with self._read() as conn:
            rows = conn.execute(Q["cron_states"]).fetchall()
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
        with self._write() as conn:
            conn.execute(
                Q["cron_save"],
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
    def configure_worker(self, concurrency: int, lease: float | None = None) -> None:
        """Nothing to size or refuse: each ctx.transaction() opens a connection of its own
        to the file, and SQLite has no connection limit."""

    def tx_begin(self) -> sqlite3.Connection:
        """A dedicated connection in an open write transaction, for one attempt."""
        if self.memory:
            raise ConfigurationError(
                "ctx.transaction() needs a file database: an in-memory SQLite database is "
                "private to one connection"
            )
        # No statement cached: each one is prepared, so errands' authorizer on it sees
        # every statement the handler runs, through ctx.transaction().raw too, including
        # one run again after SQLite rolled the transaction back itself (in autocommit
        # mode: committed on its own). See errands.worker.runtime.TransactionWatch.
        conn = self._connect(statement_cache=0)
        try:
            self._begin(conn)
        except BaseException:
            self._forget(conn)
            raise
        return conn

    def tx_finish(self, conn: sqlite3.Connection, outcome: FinishParams) -> bool:
        """Write the fenced outcome in the attempt's transaction and commit it all, or
        roll it all back when the lease is no longer ours."""
        try:
            # errands reads its rows by position, and text as str, whatever the handler set
            conn.row_factory, conn.text_factory = None, str
            self.workflows.forget()  # the caller reports what this fan-in did, once
            ok = self._finish(conn, outcome)
            fault_point("before_complete_commit")
            conn.execute("COMMIT" if ok else "ROLLBACK")
            fault_point("after_complete_commit")
            return ok
        except BaseException as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            # a full file, or one this process may not write, raises as on errands' own
            # writes (StorageFull, ConfigurationError): the worker then waits for the store
            # (errors.cannot_write_now) rather than charging the job for it
            if isinstance(exc, sqlite3.Error) and _is_full(exc):
                raise self._storage_full(exc) from exc
            if isinstance(exc, sqlite3.Error) and _not_writable(exc):
                raise self._not_writable(exc) from exc
            raise
        finally:
            self._forget(conn)

    def tx_rollback(self, conn: sqlite3.Connection) -> None:
        try:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
        finally:
            self._forget(conn)

    def tx_abandon(self, conn: sqlite3.Connection) -> None:
        """From a thread of its own (never waited for): make the connection read-only and
        roll its transaction back (it holds the store's write lock, which every writer
        waits for). The connection is not closed here: the handler's thread may still be
        in a call on it (closed under it, that call read a freed handle and could crash
        the process); it is closed once the handler lets go of it, when the last
        reference to it goes (:class:`_Connection`; close() leaves it alone too).
        Read-only, whatever the handler writes next fails: nothing of it commits (after
        the ROLLBACK it would be in autocommit mode)."""
        if isinstance(conn, _Connection):
            conn.close_when_dropped = True
        threading.Thread(
            target=self._end_abandoned, args=(conn,), name="errands-tx-abandon", daemon=True
        ).start()

    def _end_abandoned(self, conn: sqlite3.Connection) -> None:
        """ROLLBACK first, not an interrupt: it ends the transaction even under a cursor
        the handler left half-read, where an interrupt stays in effect and made the
        ROLLBACK fail. A statement still running holds the connection, so the ROLLBACK
        waits for it: that statement is interrupted after a moment (once: an interrupt
        that made the ROLLBACK fail is in effect until the handler's cursors end)."""
        ended = threading.Event()
        failed = threading.Event()

        def interrupt_while_waiting() -> None:
            while not ended.wait(ABANDON_INTERRUPT_AFTER) and not failed.is_set():
                with contextlib.suppress(sqlite3.Error):
                    conn.interrupt()

        threading.Thread(target=interrupt_while_waiting, daemon=True).start()
        last: Exception | None = None
        try:
            for _ in range(ABANDON_TRIES):
                try:
                    conn.execute("PRAGMA query_only = ON")
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    break
                except sqlite3.Error as exc:  # interrupted itself: a cursor still open
                    last = exc
                    failed.set()
                    time.sleep(ABANDON_INTERRUPT_AFTER)
            else:
                log.warning(
                    "could not roll back an abandoned handler's transaction (%s); it ends, "
                    "uncommitted, when the handler lets go of its connection (no statement "
                    "of the handler's runs on it any more)",
                    last,
                )
        finally:
            ended.set()

    @staticmethod
    def _forget(conn: sqlite3.Connection) -> None:
        with contextlib.suppress(sqlite3.Error):
            conn.close()

    # -- durable steps -----------------------------------------------------------------
    def step_list(self, job_id: int) -> list[Step]:
        with self._read() as conn:
            rows = conn.execute(Q["step_list"], {"job_id": job_id}).fetchall()
        return [
            Step(job_id=r[0], name=r[1], result=_loads_or_raw(r[2]), attempt=r[3],
                 created_at=to_datetime(r[4]))  # type: ignore[arg-type]
            for r in rows
        ]  # fmt: skip

    def step_store(
        self, job_id: int, name: str, result_json: str, attempt: int, conn: Any = None
    ) -> str:
        """Store a step's result unless one is stored; return the stored JSON (the winner)."""
        params = {"job_id": job_id, "name": name, "result": result_json, "attempt": attempt}
        if conn is not None:  # ctx.transaction()'s: rows as tuples, whatever it was set to
            cur = tuple_cursor(conn)
            cur.execute(Q["step_insert"], params)
            stored = cur.execute(Q["step_get"], params).fetchone()[0]
            # (text as the handler's text_factory gives it: bytes, say)
            return stored.decode() if isinstance(stored, bytes) else str(stored)
        with self._write() as own:
            own.execute(Q["step_insert"], params)
            return str(own.execute(Q["step_get"], params).fetchone()[0])

    def job_heartbeat_many(self, leases: Sequence[LeaseRef]) -> HeartbeatResult:
        extended: set[tuple[int, str]] = set()
        cancel: set[tuple[int, str]] = set()
        if leases:
            # Give up well before the shortest lease runs out: the caller self-fences.
            limit = min(lease.lease_seconds for lease in leases) / 3
            with self._write(timeout=limit) as conn:
                for lease in leases:
                    row = conn.execute(
                        Q["job_heartbeat"],
                        {
                            "id": lease.id,
                            "token": lease.lease_token,
                            "lease_seconds": lease.lease_seconds,
                            "progress": lease.progress,
                            "message": lease.progress_message,
                        },
                    ).fetchone()
                    if row is not None:
                        extended.add((row[0], row[1]))
                        if row[2]:
                            cancel.add((row[0], row[1]))
        return HeartbeatResult(frozenset(extended), frozenset(cancel))

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
        answers = []
        pauses = release_pauses(leases, delays)
        with self._write() as conn:
            for lease, delay in zip(leases, pauses, strict=True):
                if lease.fair is not False and not prefetched:  # (never ran: no time)
                    conn.execute(Q["fair_fold"], fold_params(lease.id, lease.lease_token))
                rows = conn.execute(
                    Q["job_release"],
                    {
                        "id": lease.id,
                        "token": lease.lease_token,
                        "message": message,
                        "unrun": unrun,
                        "prefetched": prefetched,
                        "delay": delay,
                    },
                ).fetchall()
                answers.append(bool(rows))
                if rows and prefetched:  # never begun: the starts counted for it go back
                    conn.execute(
                        Q["rate_log_unstart"], {"id": lease.id, "token": lease.lease_token}
                    )
                self._fan_in(conn, [(lease.id, *r) for r in rows])
        return answers

    # -- maintenance ---------------------------------------------------------------------
    def leader_attempt_elect(self, name: str, owner: str, ttl: float) -> bool:
        with self._write() as conn:
            row = conn.execute(
                Q["leader_attempt_elect"], {"name": name, "owner": owner, "ttl": ttl}
            ).fetchone()
        return row is not None and row[0] == owner

    def leader_resign(self, name: str, owner: str) -> None:
        with self._write() as conn:
            conn.execute(Q["leader_resign"], {"name": name, "owner": owner})

    def job_list_expired(self, limit: int) -> list[ExpiredLease]:
        with self._read() as conn:
            rows = conn.execute(Q["job_list_expired"], {"limit": limit}).fetchall()
        return [
            ExpiredLease(
                id=r[0],
                name=r[1],
                queue=r[2],
                lease_token=r[3],
                attempt=r[4],
                max_attempts=r[5],
                rescues=r[6],
                cancel_requested=bool(r[7]),
                lease_owner=r[8],
                fair=bool(r[9]),
            )
            for r in rows
        ]

    def job_rescue_many(self, rescues: Sequence[RescueParams]) -> list[bool]:
        if not rescues:
            return []
        answers = []
        with self._write() as conn:
            for r in rescues:
                if r.fair is not False:
                    conn.execute(Q["fair_fold"], fold_params(r.id, r.lease_token, rescue=r.state))
                rows = conn.execute(
                    Q["job_rescue"],
                    {
                        "id": r.id,
                        "token": r.lease_token,
                        "state": r.state,
                        "error": json.dumps(r.error),
                        "delay": r.delay,
                    },
                ).fetchall()
                answers.append(bool(rows))
                self._fan_in(conn, [(r.id, *row) for row in rows])
        return answers

    def job_promote_due(self, limit: int = PROMOTE_BATCH) -> int:
        with self._write() as conn:
            return conn.execute(Q["job_promote_due"], {"limit": limit}).rowcount

    def job_prune(self, older_than: float, limit: int) -> int:
        with self._write() as conn:
            ids = [
                r[0]
                for r in conn.execute(
                    Q["job_prunable"], {"older_than": older_than, "limit": limit}
                ).fetchall()
            ]
            for job_id in ids:
                conn.execute(Q["steps_delete"], {"job_id": job_id})
                conn.execute(Q["signals_delete"], {"job_id": job_id})
                conn.execute(Q["job_delete"], {"id": job_id})
        return len(ids)

    # -- wake-ups --------------------------------------------------------------------------
    def listener(self, on_queue: Callable[[str | None], None]) -> Any:
        if self.memory:
            return None
        from .watcher import DataVersionWatcher

        return DataVersionWatcher(self.path, on_queue)

    def result_listener(
        self,
        on_done: Callable[[list[int] | None], None],
        on_listen: Callable[[], None],
        on_lost: Callable[[], None] | None = None,
    ) -> Any:
        """Commits seen through PRAGMA data_version: the hub asks which watched jobs ended
        (every commit of the file counts, so ``on_done`` gets None). ``on_lost`` is never
        called: the watcher reads a local file it keeps open, and has no connection to
        lose."""
        if self.memory:
            return None
        from .watcher import DataVersionWatcher

        return DataVersionWatcher(self.path, lambda _: on_done(None), on_listen)


def _loads_or_raw(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return loads_stored(text)  # an int of more than 4,300 digits: read whole
    except ValueError:
        return text


def _settings(r: tuple[Any, ...]) -> QueueSettings:
    return QueueSettings(
        name=r[0],
        paused=bool(r[1]),
        max_running=r[2],
        rate_limit=r[3],
        rate_period=r[4],
        jobs_declare_limits=bool(r[5]),
        updated_at=r[6],
        updated_by=r[7],
        fair=bool(r[8]),
        aging=r[9],
    )


class _LimitedStore:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def start(self, queue: str) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
        """The queue's settings and its rate-limited types (the file's write lock, held
        already, serialises the claim)."""
        settings = self.rows("queue_settings_get", {"name": queue})
        return settings, self.rows("rate_limited_names", {"queue": queue})

    def lock(self, names: list[str]) -> None:
        """Nothing to lock: every claim runs under the file's write lock."""

    def rows(self, query: str, params: dict[str, object]) -> list[tuple[object, ...]]:
        if query == "rate_log_insert":
            for _ in range(int(params["n"])):  # type: ignore[call-overload]
                self.conn.execute(
                    Q[query],
                    {
                        "bucket": params["bucket"],
                        "period": params["period"],
                        "token": params["token"],
                    },
                )
            return []
        return self.conn.execute(Q[query], params).fetchall()

    def expect(self, query: str, params: dict[str, object]) -> bool:
        """Nothing to send ahead: every statement runs in this process."""
        return False

    def claim(self, params: dict[str, object], *, last: bool) -> list[tuple[object, ...]]:
        return self.rows("job_claim_ids", params)

    def id_list(self, values: list[object]) -> object:
        return json.dumps(values)


# -- a caller's connection in autocommit mode ---------------------------------------------
def _on_its_own(conn: Any) -> bool:
    """A caller's connection that commits each statement on its own (isolation_level None,
    or Python 3.12's autocommit=True) and has no transaction open (a BEGIN of the
    caller's opens one: the enqueue is then part of it)."""
    mode = getattr(conn, "autocommit", None)
    own = mode is True or (mode in (None, -1) and conn.isolation_level is None)
    return bool(own and not conn.in_transaction)


@contextlib.contextmanager
def _atomic(conn: sqlite3.Connection, *, several: bool) -> Iterator[None]:
    """An enqueue of several statements on a caller's connection is stored whole or not
    at all: in autocommit mode in a transaction of its own (each statement committed on
    its own: a failure midway kept part of a batch); in the caller's transaction in a
    savepoint, so a failure midway takes back what it wrote (a caller that caught the
    error and committed kept a workflow row with no members, running for ever)."""
    if not several:
        yield
        return
    if _on_its_own(conn):
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        return
    if not conn.in_transaction:  # the caller's transaction, begun as sqlite3 would begin it
        conn.execute(_begin_like(conn))
    with savepoint(conn, (sqlite3.Error,)):
        yield


@contextlib.asynccontextmanager
async def _aatomic(conn: Any, *, several: bool) -> AsyncIterator[None]:
    """:func:`_atomic` for an aiosqlite connection."""
    if not several:
        yield
        return
    if _on_its_own(conn):
        try:
            await conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error:
            raise  # it began nothing (a transaction there is someone else's: left alone)
        except BaseException:
            # Cancelled while the BEGIN waited for the write lock: it still runs on
            # aiosqlite's thread, and the caller's autocommit connection held the lock
            # for good. The ROLLBACK queues behind it.
            with contextlib.suppress(sqlite3.Error):
                await conn.execute("ROLLBACK")
            raise
        try:
            yield
        except BaseException:
            await conn.execute("ROLLBACK")
            raise
        await conn.execute("COMMIT")
        return
    if not conn.in_transaction:
        await conn.execute(_begin_like(conn))
    async with asavepoint(conn, (sqlite3.Error,)):
        yield


def _begin_like(conn: Any) -> str:
    """The BEGIN sqlite3 sends before a caller's first write in its legacy transaction
    mode (``isolation_level`` "", "DEFERRED", "IMMEDIATE" or "EXCLUSIVE"): a SAVEPOINT
    outside a transaction would start one that its RELEASE commits, behind the caller."""
    level = getattr(conn, "isolation_level", None)
    return f"BEGIN {level}" if level else "BEGIN"


def _enqueue_of(requests: Sequence[EnqueueRequest]) -> str:
    """'enqueue of job NAME' / 'enqueue of N jobs (NAMES)', for messages."""
    names = ", ".join(sorted({r.name for r in requests}))
    return (
        f"enqueue of job {names}"
        if len(requests) == 1
        else f"enqueue of {len(requests)} jobs ({names})"
    )


def _caller_busy(conn: Any, what: str, exc: sqlite3.OperationalError) -> DatabaseBusy:
    """DatabaseBusy for an enqueue on the caller's connection that found the file locked:
    which of the two causes it was when SQLite says so (its extended code), both when not,
    and what to do. Nothing of the enqueue was stored."""
    immediate = (
        'begin your transactions with BEGIN IMMEDIATE (isolation_level="IMMEDIATE" in '
        "sqlite3.connect), which waits for the write lock up front"
    )
    again = (
        "roll your transaction back and run it again" if conn.in_transaction else "call it again"
    )
    if getattr(exc, "sqlite_errorcode", None) == SQLITE_BUSY_SNAPSHOT:
        cause = (
            "your transaction read before it wrote (a deferred BEGIN, Python's default) and "
            "another connection has written since: SQLite cannot let it write on what it "
            f"read, and no wait helps. {again.capitalize()}; to avoid this, {immediate}"
        )
    else:
        cause = (
            "either another connection held the file's write lock longer than your "
            "connection waits for it (sqlite3.connect(timeout=...), 5 s by default: raise "
            "it, or keep the other writer's transactions short), or your transaction read "
            "before it wrote (a deferred BEGIN, Python's default) while another connection "
            f"wrote, which no wait fixes: {immediate}. {again.capitalize()}"
        )
    return busy_as(
        exc,
        f"{what} on your connection found the SQLite database locked ({exc}): nothing of "
        f"it was stored. {cause[0].upper()}{cause[1:]}",
    )
