"""Every error errands raises on purpose derives from one base.

::

    ErrandsError
    ├── InvalidPayload          arguments fail the handler's type hints, or are too large
    ├── ConfigurationError      a bad URL, option, app path or schema; says how to fix it
    │   └── SchemaOutdated      the database schema is older than this errands version
    ├── UnknownJob              no job is registered under a name
    ├── JobNotFound             no job row with that id
    ├── InvalidTransition       an admin action that the job's state does not allow
    ├── DatabaseBusy            the store stayed locked past every retry, or aborted an
    │                           enqueue on your connection for a lock or snapshot conflict
    ├── StorageFull             the store has no room left (disk full, size limit); nothing written
    ├── EnqueueUncertain        the connection was lost as an enqueue committed: it may exist
    ├── CancelIncomplete        a workflow's cancel was requested but not all applied: run it again
    ├── StepError               ctx.step misused: a name twice in one run, a result not JSON
    ├── JobFailed               ``JobHandle.result()`` on a dead job
    ├── JobCancelled            ``JobHandle.result()`` on a cancelled job
    └── ResultTimeout           ``JobHandle.result(timeout=)`` ran out (also a TimeoutError)

The outcomes a handler raises to steer its own fate (:class:`errands.Permanent`,
:class:`errands.Retry`) live in :mod:`errands.outcomes`; they are signals, not errors.
"""

from __future__ import annotations

import sqlite3


class ErrandsError(Exception):
    """Base class of every error errands raises on purpose."""


class InvalidPayload(ErrandsError, ValueError):
    """Job arguments do not satisfy the handler's type hints, or exceed the size limit.

    ``errors`` holds pydantic's structured error list when validation produced one.
    """

    def __init__(self, message: str, *, errors: list[dict[str, object]] | None = None) -> None:
        super().__init__(message)
        self.errors = errors or []


class ConfigurationError(ErrandsError):
    """The application, URL, option or database is set up wrong; the message says how to fix it."""


class SchemaOutdated(ConfigurationError):
    """The database schema is older than this errands needs (a worker refuses it), or
    newer than this errands (migrate refuses it; a worker runs on it, warning)."""


MAIN_MODULE_HINT = (
    "(A name starting with __main__. comes from a script run as `python file.py`: no "
    "worker can import it. Define jobs in a module that the script and the worker both "
    "import, or give them name=.)"
)


class UnknownJob(ErrandsError, LookupError):
    """No job is registered under the given name.

    A message naming a ``__main__.`` job says why no worker can know it."""

    def __init__(self, message: str = "", *args: object) -> None:
        if "'__main__." in message and MAIN_MODULE_HINT not in message:
            message = f"{message} {MAIN_MODULE_HINT}"
        super().__init__(message, *args)


class JobNotFound(ErrandsError, LookupError):
    """No job row has the given id."""


class InvalidTransition(ErrandsError):
    """An admin action was asked of a job whose state does not allow it."""


class DatabaseBusy(ErrandsError):
    """The database stayed locked by other writers past every retry; or, on the caller's
    connection (``conn=``), it aborted the enqueue for a conflict with another transaction
    that errands cannot run again for you (a deadlock; on PostgreSQL under REPEATABLE READ
    or SERIALIZABLE, a key taken by a transaction that committed after yours began; on
    SQLite, the file locked past your connection's timeout). The message says what was
    stored (nothing of the failed enqueue) and what to run again."""


def busy_as(cause: BaseException, message: str) -> DatabaseBusy:
    """``DatabaseBusy(message)`` that is also an instance of ``cause``'s class (a driver's
    error: psycopg's ``SerializationFailure``, sqlite3's ``OperationalError``), with
    ``cause`` to be chained by the caller. Code written to catch the driver's error still
    catches it (a SERIALIZABLE transaction's retry loop on SQLSTATE 40001 keeps running
    the transaction again; its ``sqlstate`` is the class's), and ``except DatabaseBusy``
    catches it too. A plain DatabaseBusy when the two classes cannot be combined."""
    kind = type(cause)
    try:
        made = _busy_class(kind)(message)
    except Exception:  # a driver class that cannot be made so
        return DatabaseBusy(message)
    for name in ("sqlite_errorcode", "sqlite_errorname"):  # sqlite3's, per error
        if hasattr(cause, name):
            setattr(made, name, getattr(cause, name))
    return made


_BUSY_CLASSES: dict[type[BaseException], type[DatabaseBusy]] = {}


def _busy_class(kind: type[BaseException]) -> type[DatabaseBusy]:
    made = _BUSY_CLASSES.get(kind)
    if made is None:
        if issubclass(kind, DatabaseBusy):
            made = kind
        else:
            made = type(
                f"DatabaseBusy[{kind.__name__}]",
                (DatabaseBusy, kind),
                {"__module__": __name__, "__reduce__": _reduce_busy},
            )
        _BUSY_CLASSES[kind] = made
    return made


def _reduce_busy(self: DatabaseBusy) -> tuple[object, ...]:
    """Pickled as what rebuilds it (a class made at run time has no importable name)."""
    return (_rebuild_busy, (type(self).__bases__[1], self.args))


def _rebuild_busy(kind: type[BaseException], args: tuple[object, ...]) -> DatabaseBusy:
    return _busy_class(kind)(*args)


class StorageFull(ErrandsError):
    """The database has no room left (a full disk or a size limit); nothing was written."""


class EnqueueUncertain(ErrandsError):
    """The connection to the store was lost while an enqueue was committing, so the job may
    or may not have been stored. An enqueue with ``key=`` can simply be retried (the key
    makes it happen once); without a key a retry may enqueue the job twice.

    A connection found broken *before* anything was sent, or lost before the enqueue's
    transaction reached its COMMIT, never raises this: errands retries those itself.
    """


class CancelIncomplete(ErrandsError):
    """A workflow's cancel was requested (and audited) and may be partly applied: a step
    after the request failed (a lost connection, say). The workflow settles ``cancelled``
    whatever happens; running the cancel again cancels the members still pending (it is
    safe to repeat). ``__cause__`` is the error that stopped it."""

    def __init__(self, message: str, *, workflow_id: int) -> None:
        super().__init__(message)
        self.workflow_id = workflow_id


class StepError(ErrandsError):
    """``ctx.step`` was misused (a step name twice in one run, a result that is not JSON).

    Failing a job with it is permanent: a retry would run the step's effect again.
    """


class TransactionEnded(ErrandsError):
    """A handler ended (or tried to end) the transaction ``ctx.transaction()`` gave it:
    ``COMMIT``, ``ROLLBACK``, ``executescript`` and the like. That transaction commits only
    with the job's completion; a job that ended it fails permanently (its retry would
    repeat writes already committed), so an operator looks at it."""


class JobFailed(ErrandsError):
    """The job ended in the dead-letter queue; ``last_error`` holds its final error."""

    def __init__(self, message: str, *, job_id: int, last_error: dict[str, object] | None) -> None:
        super().__init__(message)
        self.job_id = job_id
        self.last_error = last_error


class JobCancelled(ErrandsError):
    """The job was cancelled before it completed."""


class ResultTimeout(ErrandsError, TimeoutError):
    """The job did not finish within the time given to ``JobHandle.result``."""


# Exception class names (anywhere in the MRO) that say a connection was lost or refused:
# the builtin ConnectionError family, requests' ConnectionError, httpx's ConnectError, DB-API
# drivers' OperationalError and InterfaceError (psycopg's on a lost session, sqlite3's on a
# locked file).
CONNECTION_LOST = frozenset(
    {"ConnectionError", "ConnectError", "OperationalError", "InterfaceError"}
)


def connection_lost(exc: BaseException) -> bool:
    """Whether user code (an on_dead hook) failed on a lost or refused connection, by its
    exception's class names: a call made again may get through. Narrower than
    :func:`is_transient`: an HTTP 4xx or a read timeout (both OSErrors in requests) is not."""
    return bool(_class_names(exc) & CONNECTION_LOST)


def _class_names(exc: BaseException) -> set[str]:
    """The names of ``exc``'s class and its bases: drivers are matched by name, not
    imported."""
    return {cls.__name__ for cls in type(exc).__mro__}


def is_transient(exc: BaseException) -> bool:
    """Connectivity or locking trouble that a retry as-is can outlast (a killed session, a
    restart, a busy SQLite file), as opposed to content the store refuses. Shared by the
    completer's outcome writes and the worker's startup steps.

    PostgreSQL's class 54 (program_limit_exceeded: a value past jsonb's size limit, a
    statement too complex) is an OperationalError to its driver but content the store
    refuses: the same write fails every time (the completer retried such an outcome's
    batch for ever, every outcome in it held back)."""
    if _sqlstate(exc).startswith("54"):
        return False
    return bool(
        _class_names(exc)
        & {
            "OperationalError",
            "InterfaceError",
            "PoolTimeout",
            "DatabaseBusy",
            # PostgreSQL ended a transaction left idle past its limit (SQLSTATE 25P03):
            # its client went silent, and the session is gone (errands' tx_guard)
            "IdleInTransactionSessionTimeout",
        }
    ) or (isinstance(exc, OSError | TimeoutError))


def _sqlstate(exc: BaseException) -> str:
    """A PostgreSQL driver error's SQLSTATE (psycopg's ``sqlstate``), or ''."""
    state = getattr(exc, "sqlstate", None)
    return state if isinstance(state, str) else ""


def cannot_write_now(exc: BaseException) -> bool:
    """The store takes no write now, whatever the write holds: a full disk or a size limit
    (:class:`StorageFull`), PostgreSQL's class 53 (insufficient_resources: disk_full,
    out_of_memory, too_many_connections), or an SQLite file this process may not write (a
    :class:`ConfigurationError` from SQLITE_READONLY, SQLITE_CANTOPEN or SQLITE_PERM: a
    permission taken away, a file system remounted read-only). Nothing was written, and
    the same write goes through once an operator makes room or gives the permission back:
    the completer waits for that, the leases keeping its jobs (it recorded a job that had
    succeeded as dead, UnstorableOutcome, when the disk was full for a moment).

    sqlite3's own error for a file full or read-only (SQLITE_FULL, SQLITE_READONLY), as a
    handler's statement in ``ctx.transaction()`` raises it (errands' own calls raise the
    errands errors above), is one too; not SQLITE_CANTOPEN nor SQLITE_PERM, which a
    statement on an open connection raises for a path of the statement's own (an
    ``ATTACH`` of a file that is not there). Whose error it is, the store's or another
    database's of the handler's own, this does not tell: see
    :meth:`errands.worker.runtime.AttemptRuntime.met_unwritable`."""
    if isinstance(exc, StorageFull) or _sqlstate(exc).startswith("53"):
        return True
    if isinstance(exc, sqlite3.Error) and _sqlite_unwritable(exc):
        return True
    cause = exc.__cause__
    code = getattr(cause, "sqlite_errorcode", None)
    return (
        isinstance(exc, ConfigurationError)
        and isinstance(cause, sqlite3.Error)
        and isinstance(code, int)
        and code & 0xFF in (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PERM)
    )


def disk_full(exc: BaseException) -> bool:
    """A full disk or a size limit: errands' StorageFull, PostgreSQL's disk_full (53100),
    sqlite3's SQLITE_FULL. No fault of a job's, wherever it is met, and it passes once
    room is made."""
    if isinstance(exc, StorageFull) or _sqlstate(exc) == "53100":
        return True
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        if isinstance(code, int):
            return code & 0xFF == sqlite3.SQLITE_FULL
        return "database or disk is full" in str(exc)
    return False


def _sqlite_unwritable(exc: sqlite3.Error) -> bool:
    """sqlite3's error for a file that cannot be written now, full or read-only (by its
    primary result code, or its text where the driver gave none)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_READONLY)
    text = str(exc)
    return "database or disk is full" in text or "attempt to write a readonly database" in text
