"""Job context for every log record emitted while a handler runs.

The worker sets a context variable around each handler call (in the thread or the
asyncio task that runs it). A log-record factory copies it onto every record as
``job_id``, ``job_name``, ``queue`` and ``attempt`` — the user's own loggers included —
so a formatter or a JSON handler can show which job wrote the line.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

JOB_FIELDS = ("job_id", "job_name", "queue", "attempt")


@dataclass(frozen=True)
class JobLogContext:
    job_id: int
    job_name: str
    queue: str
    attempt: int


current_job: contextvars.ContextVar[JobLogContext | None] = contextvars.ContextVar(
    "errands_current_job", default=None
)

_installed = False


def install_record_factory() -> None:
    """Make every LogRecord carry the current job's fields (idempotent)."""
    global _installed
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
    _installed = True


class job_context:
    """Make ``ctx`` the current job for log records (a class: it runs once per job)."""

    __slots__ = ("_ctx", "_token")

    def __init__(self, ctx: JobLogContext) -> None:
        self._ctx = ctx

    def __enter__(self) -> None:
        self._token = current_job.set(self._ctx)

    def __exit__(self, *exc: object) -> None:
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
        second = int(record.created)
        if second != self._second:  # a racy cache of one string: a miss only costs time
            self._second_text = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
            self._second = second
        return f"{self._second_text},{int(record.msecs):03d}"

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        job_id = getattr(record, "job_id", None)
        if job_id is not None:
            message = (
                f"[job {job_id} {getattr(record, 'job_name', '?')}@"
                f"{getattr(record, 'queue', '?')} #{getattr(record, 'attempt', '?')}] {message}"
            )
        text = f"{self.formatTime(record)} {record.levelname:<7} {record.name} {message}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            text += "\n" + self.formatStack(record.stack_info)
        return text


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
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in self._skip and not key.startswith("_"):
                data[key] = value
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)


def configure_logging(fmt: str = "text", level: str | int = "INFO") -> None:
    """Set up the root logger for a worker process: text or JSON lines on stderr."""
    if fmt not in ("text", "json"):
        raise ValueError(f"log format {fmt!r}: choose text or json")
    install_record_factory()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
