"""The lifecycle log lines (DESIGN §9), written by a subscriber of the event bus.

At the default level (INFO) a job writes **one line when it finishes** (completed,
cancelled, retrying, dead), not two: the ``started`` line, with the job's arguments
(sensitive ones masked), is DEBUG. A line costs a worker several microseconds of CPU,
about a third of everything else it spends on a no-op job, so two lines per job halved
the throughput of a default worker (docs/benchmarks.md). A job that runs long is named
while it runs: the lease keeper writes ``still running after N s`` at INFO."""

from __future__ import annotations

import logging
import time
from typing import Any

from ..errortext import LOG_LIMIT, clip, clip_lines
from .events import CATALOGUE, Event
from .logcontext import direct_writer, record_factory

worker_log = logging.getLogger("errands.worker")
maintenance_log = logging.getLogger("errands.maintenance")
app_log = logging.getLogger("errands")


# The level each job event logs at: an event whose line is disabled costs one check.
_JOB_EVENT_LEVELS = {
    "errands.job.enqueued": (app_log, logging.DEBUG),
    "errands.job.started": (worker_log, logging.DEBUG),
    "errands.job.completed": (worker_log, logging.INFO),
    "errands.job.cancelled": (worker_log, logging.INFO),
    "errands.job.progress": (worker_log, logging.DEBUG),
}


def _wants(name: str) -> bool:
    quiet = _JOB_EVENT_LEVELS.get(name)
    return quiet is None or quiet[0].isEnabledFor(quiet[1])


def log_event(event: Event) -> None:
    name = event.name
    f = event.fields
    quiet = _JOB_EVENT_LEVELS.get(name)
    if quiet is not None and not quiet[0].isEnabledFor(quiet[1]):
        return
    if "job_name" in f and f.get("job_id") is not None:
        _log_job_event(name, f)
    else:
        _log_other(name, f)


def _emit(
    logger: logging.Logger,
    level: int,
    attrs: dict[str, Any],
    msg: str,
    *args: object,
    exc_text: str | None = None,
) -> None:
    """``logger.log(level, msg, *args, extra=attrs)``, for errands' own lines: without
    logging's walk up the stack for the caller (a third of a line's cost), and with the
    job fields set on the record directly (no context variable set and reset per line,
    and the record factory errands installs skipped: it would only add them). When only
    errands' background writer would see the record, it gets the line's fields instead
    (:func:`~errands.observability.logcontext.direct_writer`): the same text, without
    making a LogRecord. ``exc_text``: a traceback already rendered (and scrubbed)."""
    if not logger.isEnabledFor(level):
        return
    if exc_text:
        exc_text = exc_text.rstrip("\n")
    writer = direct_writer(logger, level)
    if writer is not None:  # nothing but errands' writer would see the record: skip it
        writer.emit_line((time.time(), level, logger.name, msg, args, attrs, exc_text or None))
        return
    record = record_factory()(logger.name, level, "", 0, msg, args, None, None, None)
    record.__dict__.update(attrs)
    if exc_text:
        record.exc_text = exc_text
    logger.handle(record)


def _clipped(message: object) -> object:
    """An error's message as a log line quotes it: its head (errands.errortext)."""
    return clip(message, LOG_LIMIT) if isinstance(message, str) else message


def _clipped_trace(trace: object) -> str | None:
    """An error's traceback as a log line carries it: each line clipped (the stored
    one keeps more; the dashboard and ``errands jobs show`` show it)."""
    return clip_lines(trace, LOG_LIMIT) if isinstance(trace, str) else None


def _log_job_event(name: str, f: dict) -> None:  # type: ignore[type-arg]
    a = _attrs(name, f)
    a["job_id"] = f["job_id"]
    a["job_name"] = f.get("job_name", "?")
    a["queue"] = f.get("queue", "?")
    a["attempt"] = f.get("attempt", 0)
    if name == "errands.job.completed":
        _emit(worker_log, logging.INFO, a, "completed in %.3f s", f.get("duration", 0.0))
    elif name == "errands.job.enqueued":
        dedup = " (deduplicated)" if f.get("deduplicated") else ""
        _emit(app_log, logging.DEBUG, a, "enqueued%s", dedup)
    elif name == "errands.job.started":
        if worker_log.isEnabledFor(logging.DEBUG):
            args = _short_args(f.get("args"))
            _emit(worker_log, logging.DEBUG, a, "started %s(%s)", f["job_name"], args)
    elif name == "errands.job.progress":
        _emit(
            worker_log,
            logging.DEBUG,
            a,
            "progress %.0f%%: %s",
            100 * f.get("progress", 0.0),
            f.get("message", ""),
        )
    elif name == "errands.job.retrying":
        _emit(
            worker_log,
            logging.WARNING,
            a,
            "failed, retrying in %.1f s (attempt %d of %d): %s: %s",
            f.get("delay", 0.0),
            f.get("attempt", 0),
            f.get("max_attempts", 0),
            f.get("error_type"),
            _clipped(f.get("error_message")),
            exc_text=_clipped_trace(f.get("traceback")),
        )
    elif name == "errands.job.dead":
        rescued = f.get("reason") in ("worker_lost", "poison")
        _emit(
            maintenance_log if rescued else worker_log,
            logging.ERROR,
            a,
            "dead after %d attempt(s), moved to the dead-letter queue: %s: %s",
            f.get("attempt", 0),
            f.get("error_type"),
            _clipped(f.get("error_message")),
            exc_text=_clipped_trace(f.get("traceback")),
        )
    elif name == "errands.job.cancelled":
        _emit(worker_log, logging.INFO, a, "cancelled")
    elif name == "errands.job.stale_write_rejected":
        _emit(
            worker_log,
            logging.WARNING,
            a,
            "stale write rejected: job %s is no longer held by this attempt (lease lost or job "
            "cancelled); the %s outcome was not recorded",
            f.get("job_id"),
            f.get("outcome"),
        )
    elif name == "errands.job.write_failed":
        _emit(
            worker_log,
            logging.WARNING,
            a,
            "the %s outcome of job %s could not be stored; its lease runs out and the "
            "maintenance leader rescues it",
            f.get("outcome"),
            f.get("job_id"),
        )
    elif name == "errands.job.rescued":
        _emit(
            maintenance_log, logging.WARNING, a, "rescued (%s): %s", f.get("state"), f.get("reason")
        )
    elif name == "errands.job.released":
        _emit(worker_log, logging.WARNING, a, "released back to the queue (attempt not charged)")
    elif name == "errands.job.waiting":
        timeout = f.get("timeout")
        _emit(
            worker_log,
            logging.INFO,
            a,
            "suspended: waiting for signal %r%s (holds no slot)",
            f.get("signal"),
            "" if timeout is None else f" for up to {timeout:g} s",
        )
    elif name == "errands.job.wait_timed_out":
        _emit(
            maintenance_log,
            logging.WARNING,
            a,
            "no signal %r in time: the wait failed (now %s)",
            f.get("signal"),
            f.get("state"),
        )


def _log_other(name: str, f: dict) -> None:  # type: ignore[type-arg]
    extra = _attrs(name, f)
    if name == "errands.job.replayed":
        app_log.warning(
            "job %s replayed from the dead-letter queue by %s", f["job_id"], f["actor"], extra=extra
        )
    elif name == "errands.job.discarded":
        app_log.warning(
            "job %s discarded by %s: %s", f["job_id"], f["actor"], f.get("reason"), extra=extra
        )
    elif name == "errands.job.edited":
        app_log.warning(
            "job %s edited by %s: %s", f["job_id"], f["actor"], ", ".join(f.get("changes", ())),
            extra=extra,
        )  # fmt: skip
    elif name == "errands.job.signalled":
        app_log.info(
            "job %s sent signal %r by %s%s",
            f["job_id"],
            f.get("signal"),
            f["actor"],
            " (resumed it)" if f.get("resumed") else "",
            extra=extra,
        )
    elif name == "errands.job.cancel_requested":
        app_log.info(
            "job %s cancel requested by %s (was %s)",
            f["job_id"],
            f["actor"],
            f.get("previous_state"),
            extra=extra,
        )
    elif name == "errands.worker.started":
        worker_log.info(
            "worker %s started: queues %s, concurrency %d, store %s",
            f["worker_id"],
            f.get("queues"),
            f.get("concurrency", 0),
            f.get("store"),
            extra=extra,
        )
    elif name == "errands.worker.stopped":
        worker_log.info(
            "worker %s stopped after %d job(s)", f["worker_id"], f.get("processed", 0), extra=extra
        )
    elif name == "errands.leader.elected":
        maintenance_log.info("worker %s is now the maintenance leader", f["worker_id"], extra=extra)
    elif name == "errands.leader.resigned":
        maintenance_log.info(
            "worker %s is no longer the maintenance leader", f["worker_id"], extra=extra
        )
    elif name == "errands.maintenance.pruned":
        maintenance_log.info(
            "pruned %d finished job(s) older than the retention period", f["count"], extra=extra
        )


# Event fields copied onto log records (JSON output shows them). Never ``args`` or ``meta``;
# error messages are already scrubbed of sensitive argument values.
RECORD_FIELDS = (
    "duration",
    "delay",
    "queue_wait",
    "max_attempts",
    "deduplicated",
    "error_type",
    "reason",
    "state",
    "outcome",
    "actor",
    "previous_state",
    "worker",
    "worker_id",
    "count",
)


# Per event: the RECORD_FIELDS it can carry (found once, not by trying all 14 each time).
_FIELDS_OF = {
    name: tuple(k for k in RECORD_FIELDS if k in fields) for name, fields in CATALOGUE.items()
}


def _attrs(name: str, f: dict) -> dict[str, Any]:  # type: ignore[type-arg]
    attrs: dict[str, Any] = {"event": name}
    for key in _FIELDS_OF.get(name, RECORD_FIELDS):
        value = f.get(key)
        if value is not None:
            attrs[key] = value
    return attrs


def _short_args(args: object, limit: int = 200) -> str:
    if not isinstance(args, dict):
        return ""
    text = ", ".join(f"{k}={v!r}" for k, v in args.items())
    return text if len(text) <= limit else text[: limit - 3] + "..."


log_event.wants = _wants  # type: ignore[attr-defined]
