"""Job context for every log record emitted while a handler runs.

The worker sets a context variable around each handler call (in the thread or the
asyncio task that runs it). A log-record factory copies it onto every record as
``job_id``, ``job_name``, ``queue`` and ``attempt`` — the user's own loggers included —
so a formatter or a JSON handler can show which job wrote the line.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import json
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import IO, Any

JOB_FIELDS = ("job_id", "job_name", "queue", "attempt")


@dataclass(slots=True)  # not frozen: one per attempt, built 3x faster (treat as immutable)
class JobLogContext:
    job_id: int
    job_name: str
    queue: str
    attempt: int


current_job: contextvars.ContextVar[JobLogContext | None] = contextvars.ContextVar(
    "errands_current_job", default=None
)

_installed = False
# (our factory, the one it wraps): a record whose job fields are set by its maker (the
# lifecycle lines) skips our layer and asks the wrapped factory directly
_layer: tuple[Any, Any] = (None, None)


def record_factory() -> Any:
    """The record factory to call for a record that sets its own job fields."""
    factory = logging.getLogRecordFactory()
    ours, wrapped = _layer
    return wrapped if factory is ours else factory


def install_record_factory() -> None:
    """Make every LogRecord carry the current job's fields (idempotent)."""
    global _installed, _layer
    if _installed:
        return
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        job = current_job.get()
        if job is not None:
            for name in JOB_FIELDS:
                if not hasattr(record, name):
                    setattr(record, name, getattr(job, name))
        return record

    logging.setLogRecordFactory(factory)
    _layer = (factory, previous)
    _allow_job_fields_in_extra()
    _installed = True


def _allow_job_fields_in_extra() -> None:
    """A record made in a job already carries the job's fields (the factory above), and
    logging refuses an ``extra`` that names a field the record has: a handler's own
    ``log.warning("retry", extra={"attempt": 3})`` raised KeyError ("Attempt to overwrite
    'attempt' in LogRecord") and failed the job. Such a key is set after the record is
    made instead: the caller's value wins on its own line."""
    original = logging.Logger.makeRecord

    def make_record(
        self: logging.Logger,
        name: str,
        level: int,
        fn: str,
        lno: int,
        msg: object,
        args: Any,
        exc_info: Any,
        func: str | None = None,
        extra: Mapping[str, object] | None = None,
        sinfo: str | None = None,
    ) -> logging.LogRecord:
        clashing = {k: v for k, v in extra.items() if k in JOB_FIELDS} if extra else None
        if not clashing:
            return original(self, name, level, fn, lno, msg, args, exc_info, func, extra, sinfo)
        rest = {k: v for k, v in extra.items() if k not in clashing}  # type: ignore[union-attr]
        record = original(self, name, level, fn, lno, msg, args, exc_info, func, rest, sinfo)
        record.__dict__.update(clashing)
        return record

    logging.Logger.makeRecord = make_record  # type: ignore[method-assign]


def job_extra(row: Any) -> dict[str, Any]:
    """The job fields of ``row`` (a JobRow) as a log call's ``extra=``: for a line errands
    writes about a job outside its handler's context (its lease keeper, its recorder), so
    the line carries them as the handler's own lines do (DESIGN §9)."""
    return {"job_id": row.id, "job_name": row.name, "queue": row.queue, "attempt": row.attempt}


class job_context:
    """Make ``ctx`` the current job for log records (a class: it runs once per job)."""

    __slots__ = ("_ctx", "_token")

    def __init__(self, ctx: JobLogContext) -> None:
        self._ctx = ctx

    def __enter__(self) -> None:
        self._token = current_job.set(self._ctx)

    def __exit__(self, *exc: object) -> None:
        # ValueError: an abandoned async handler's coroutine, closed by the garbage
        # collector outside its task's context (that context is gone anyway)
        with contextlib.suppress(ValueError):
            current_job.reset(self._token)


class TextFormatter(logging.Formatter):
    """``time level logger [job 12 send_email@emails #1] message``.

    Built in one pass, with the time text made once per second: a worker writes a line
    per finished job, so the formatter is on every job's path (stdlib's formatTime calls
    strftime for each record)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s %(message)s")
        self._second = -1
        self._second_text = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return self._stamp(record.created, record.msecs)

    def _stamp(self, created: float, msecs: float) -> str:
        second = int(created)
        if second != self._second:  # a racy cache of one string: a miss only costs time
            self._second_text = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
            self._second = second
        return f"{self._second_text},{int(msecs):03d}"

    def format_line(self, line: Line) -> str:
        """The text :meth:`format` makes of the record ``line`` stands for."""
        created, levelno, name, msg, args, attrs, exc_text = line
        message = msg % args if args else msg
        job_id = attrs.get("job_id")
        if job_id is not None:
            message = (
                f"[job {job_id} {attrs.get('job_name', '?')}@"
                f"{attrs.get('queue', '?')} #{attrs.get('attempt', '?')}] {message}"
            )
        stamp = self._stamp(created, _msecs(created))
        text = f"{stamp} {logging.getLevelName(levelno):<7} {name} {message}"
        if exc_text:
            text += "\n" + exc_text
        return text

    def format(self, record: logging.LogRecord) -> str:
        message = _message(record)
        job_id = getattr(record, "job_id", None)
        if job_id is not None:
            message = (
                f"[job {job_id} {getattr(record, 'job_name', '?')}@"
                f"{getattr(record, 'queue', '?')} #{getattr(record, 'attempt', '?')}] {message}"
            )
        text = f"{self.formatTime(record)} {record.levelname:<7} {record.name} {message}"
        exception = _exception(self, record)
        if exception:
            text += "\n" + exception
        if record.stack_info:
            text += "\n" + self.formatStack(record.stack_info)
        return text


def _message(record: logging.LogRecord) -> str:
    """The record's message: the text :class:`BackgroundHandler` made when it was logged
    (its arguments may have changed since), else made now."""
    made = record.__dict__.get(_MADE)
    return made if made is not None else record.getMessage()


def _exception(formatter: logging.Formatter, record: logging.LogRecord) -> str | None:
    """The traceback text, made once per record (``exc_text``, as logging.Formatter does)."""
    if record.exc_info and not record.exc_text:
        record.exc_text = formatter.formatException(record.exc_info)
    return record.exc_text or None


class JsonFormatter(logging.Formatter):
    """One JSON object per line, with the job fields and any ``extra=`` fields."""

    _skip = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
        "message",
        "asctime",
    }

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": _message(record),
        }
        for key, value in vars(record).items():
            if key not in self._skip and not key.startswith("_"):
                data[key] = value
        exception = _exception(self, record)
        if exception:
            data["exception"] = exception
        return json.dumps(data, default=str)

    def format_line(self, line: Line) -> str:
        """The JSON :meth:`format` makes of the record ``line`` stands for."""
        created, levelno, name, msg, args, attrs, exc_text = line
        data: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created))
            + f".{int(_msecs(created)):03d}Z",
            "level": logging.getLevelName(levelno).lower(),
            "logger": name,
            "message": msg % args if args else msg,
        }
        for key, value in attrs.items():
            if key not in self._skip and not key.startswith("_"):
                data[key] = value
        if exc_text:
            data["exception"] = exc_text
        return json.dumps(data, default=str)


def _msecs(created: float) -> float:
    return int((created - int(created)) * 1000) + 0.0  # as LogRecord computes it


_MADE = "_errands_message"  # the message text BackgroundHandler made when it was logged

# A record errands' own lines hand to the writer without making a LogRecord, when nothing
# but that writer would see it (see direct_writer): (created, levelno, logger name, msg,
# args, attributes, traceback text or None). The writer formats it as it would the record.
Line = tuple[float, int, str, str, tuple[Any, ...], dict[str, Any], str | None]


def direct_writer(logger: logging.Logger, level: int) -> BackgroundHandler | None:
    """The :class:`BackgroundHandler` that alone would handle a ``level`` record of
    ``logger``, with one of errands' formatters, no filter and the standard record
    factory, else None.

    Then a line of errands' own can skip the record (its making is most of a line's cost
    on the logging thread) and give the writer its fields: the output is the same. Any
    other handler, filter, formatter or record factory (a test's capture, Sentry, an
    OpenTelemetry factory) gets real records, as before. Looked up on every call, so a
    handler added later is seen at once.
    """
    if logger.filters or record_factory() is not logging.LogRecord:
        return None
    current: logging.Logger | None = logger
    while current is not None:
        handlers = current.handlers
        if current.parent is None:  # the root
            if len(handlers) != 1:
                return None
            handler = handlers[0]
            if (
                type(handler) is BackgroundHandler
                and level >= handler.level
                and not handler.filters
                and not handler._closed
                and type(handler.formatter) in _LINE_FORMATTERS
            ):
                return handler
            return None
        if not current.propagate:
            return None
        for other in handlers:  # the NullHandler a library puts on its logger is no one
            if type(other) is not logging.NullHandler:
                return None
        current = current.parent
    return None


class BackgroundHandler(logging.Handler):
    """A stream handler that formats and writes on a thread of its own.

    ``emit`` does on the logging thread (a worker's completer, a handler's thread) only
    what cannot wait: the message text (its arguments may change once the call returns)
    and the traceback text; the record goes on a list. A writer thread formats what
    gathered and writes it with one ``write()``, then waits ``linger`` seconds for more
    (a line is written at once after a quiet spell, and a steady stream in batches).

    Nothing is lost on a graceful stop: ``flush()`` and ``close()`` (``logging.shutdown()``
    calls both at exit) write everything queued from the calling thread. A writer that
    falls ``capacity`` records behind (a stream that blocks) makes ``emit`` write the
    backlog itself, as a plain StreamHandler would, rather than hold more. What a process
    killed outright (SIGKILL, ``os._exit`` without ``logging.shutdown()``) had queued,
    at most ``linger`` seconds of lines, is lost, as with any buffered stream.
    """

    def __init__(
        self, stream: IO[str] | None = None, *, linger: float = 0.01, capacity: int = 10_000
    ) -> None:
        super().__init__()
        self.stream: IO[str] = stream if stream is not None else sys.stderr
        self.linger = linger
        self.capacity = capacity
        self._records: collections.deque[logging.LogRecord | Line] = collections.deque()
        self._writing = threading.RLock()  # reentrant: a signal handler may flush
        self._wake = threading.Event()
        self._sleeping = False
        self._closed = False
        self._thread: threading.Thread | None = None
        this = weakref.ref(self)

        def before_fork() -> None:  # the child gets no half-written line to write again
            handler = this()
            if handler is not None and not handler._closed:
                handler.flush()

        def after_fork() -> None:
            handler = this()
            if handler is not None:
                handler._after_fork()

        os.register_at_fork(before=before_fork, after_in_child=after_fork)

    def handle(self, record: logging.LogRecord) -> bool | logging.LogRecord:  # type: ignore[override]
        """Filter and emit, without the handler lock (``emit`` is safe from any thread)."""
        passed = self.filter(record)
        if isinstance(passed, logging.LogRecord):  # Python 3.12+: a filter may replace it
            record = passed
        if passed:
            self.emit(record)
        return passed

    def emit(self, record: logging.LogRecord) -> None:
        try:
            record.__dict__[_MADE] = record.getMessage()
            if record.exc_info and not record.exc_text:
                record.exc_text = (self.formatter or _PLAIN).formatException(record.exc_info)
            self._records.append(record)
            self._queued()
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)

    def emit_line(self, line: Line) -> None:
        """Queue one of errands' own lines (see :func:`direct_writer`); its arguments
        are numbers and strings, so its text can be made later."""
        self._records.append(line)
        self._queued()

    def _queued(self) -> None:
        if self._sleeping:
            self._sleeping = False
            self._wake.set()
        elif self._thread is None or self._closed:
            if self._closed or not self._start():
                self._write_queued()
        elif len(self._records) >= self.capacity:
            self._write_queued()  # the writer fell behind: wait as a stream would

    def flush(self) -> None:
        """Write every line queued so far, from this thread."""
        self._write_queued()

    def close(self) -> None:
        self._closed = True
        try:
            self._write_queued()
        finally:
            self._wake.set()  # the writer sees the handler closed and ends
            super().close()

    def _start(self) -> bool:
        thread = threading.Thread(target=self._run, name="errands-log-writer", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # interpreter shutdown: write from the logging thread instead
            return False
        self._thread = thread
        return True

    def _run(self) -> None:
        records, wake = self._records, self._wake
        while True:
            if not records:
                self._sleeping = True
                if not records:  # a record appended after this check wakes the wait
                    wake.wait(1.0)
                wake.clear()
                self._sleeping = False
            self._write_queued()
            if self._closed:
                return
            time.sleep(self.linger)  # let lines gather: one write() for many of them

    def _write_queued(self) -> None:
        records = self._records
        with self._writing:
            while records:
                texts = []
                last: logging.LogRecord | Line | None = None
                for _ in range(1000):
                    try:
                        last = records.popleft()
                    except IndexError:
                        break
                    try:
                        if type(last) is tuple:
                            texts.append(self.formatter.format_line(last))  # type: ignore[union-attr]
                        else:
                            texts.append(self.format(last))  # type: ignore[arg-type]
                    except Exception:
                        self.handleError(_as_record(last))
                if not texts or last is None:
                    continue
                try:
                    texts.append("")
                    self.stream.write("\n".join(texts))
                    self.stream.flush()
                except Exception:
                    self.handleError(_as_record(last))

    def _after_fork(self) -> None:
        """In a forked child: what the parent had queued is the parent's; start afresh."""
        self._records.clear()
        self._writing = threading.RLock()
        self._wake = threading.Event()
        self._sleeping = False
        self._thread = None

    def __repr__(self) -> str:
        name = getattr(self.stream, "name", "")
        return f"<{type(self).__name__} {name} ({logging.getLevelName(self.level)})>"


_PLAIN = logging.Formatter()
_LINE_FORMATTERS = (TextFormatter, JsonFormatter)


def _as_record(item: logging.LogRecord | Line) -> logging.LogRecord:
    if not isinstance(item, tuple):
        return item
    created, levelno, name, msg, args, attrs, exc_text = item
    record = logging.LogRecord(name, levelno, "", 0, msg, args, None)
    record.__dict__.update(attrs, created=created, exc_text=exc_text)
    return record


def current_format() -> str | None:
    """The format of errands' log handler on the root logger now ("json" or "text"; None
    when configure_logging did not set one up): the CLI's own warnings and errors, and a
    worker's child processes, follow it, so a worker logging JSON writes only JSON lines."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler.formatter, JsonFormatter):
            return "json"
        if isinstance(handler.formatter, TextFormatter):
            return "text"
    return None


def lockless_line(text: str, logger: str = "errands.worker", level: int = logging.WARNING) -> bytes:
    """``text`` as one line of this process's log format (a record of ``logger`` in JSON),
    made without taking the logging module's locks, for ``os.write(2, ...)``: written just
    before an ``os._exit``, from a signal handler or a thread that must not wait on
    another (the handlers' lines queued meanwhile are not flushed)."""
    if current_format() == "json":
        record = logging.LogRecord(logger, level, __file__, 0, text, None, None)
        return (JsonFormatter().format(record) + "\n").encode()
    return f"errands: {text}\n".encode()


def configure_logging(
    fmt: str = "text", level: str | int = "INFO", *, background: bool = True
) -> None:
    """Set up the root logger for a worker process: text or JSON lines on stderr, written
    by a :class:`BackgroundHandler` (formatted and written off the worker's threads), or
    with ``background=False`` by a plain ``logging.StreamHandler`` (in the logging thread)."""
    if fmt not in ("text", "json"):
        raise ValueError(f"log format {fmt!r}: choose text or json")
    install_record_factory()
    handler = BackgroundHandler(sys.stderr) if background else logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
        if isinstance(existing, BackgroundHandler):
            existing.close()  # its writer thread ends, its lines written
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
