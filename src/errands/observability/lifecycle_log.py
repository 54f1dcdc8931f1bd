"""The lifecycle log lines (DESIGN §9), written by a subscriber of the event bus.

At the default level (INFO) a job writes **one line when it finishes** (completed,
cancelled, retrying, dead), not two: the ``started`` line, with the job's arguments
(sensitive ones masked), is DEBUG. A line costs a worker several microseconds of CPU,
about a third of everything else it spends on a no-op job, so two lines per job halved
the throughput of a default worker (docs/benchmarks.md). A job that runs long is named
while it runs: the lease keeper writes ``still running after N s`` at INFO."""

from __future__ import annotations

import logging

from .events import Event
from .logcontext import JobLogContext, job_context

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
    job_id = f.get("job_id")
    if job_id is not None and "job_name" in f:
        with job_context(
            JobLogContext(job_id, f.get("job_name", "?"), f.get("queue", "?"), f.get("attempt", 0))
        ):
            _log_job_event(name, f)
    else:
        _log_other(name, f)


def _emit(logger: logging.Logger, level: int, msg: str, *args: object, extra: dict) -> None:  # type: ignore[type-arg]
    """``logger.log(level, msg, *args, extra=extra)`` without looking up the caller's frame
    (these lines are errands' own, written once per job: the frame walk alone was a third
    of a line's cost)."""
    if logger.isEnabledFor(level):
        logger.handle(logger.makeRecord(logger.name, level, "", 0, msg, args, None, extra=extra))


def _log_job_event(name: str, f: dict) -> None:  # type: ignore[type-arg]
    extra = _extra(name, f)
    if name == "errands.job.enqueued":
        if app_log.isEnabledFor(logging.DEBUG):
            dedup = " (deduplicated)" if f.get("deduplicated") else ""
            _emit(app_log, logging.DEBUG, "enqueued%s", dedup, extra=extra)
    elif name == "errands.job.started":
        if worker_log.isEnabledFor(logging.DEBUG):
            args = _short_args(f.get("args"))
            _emit(worker_log, logging.DEBUG, "started %s(%s)", f["job_name"], args, extra=extra)
    elif name == "errands.job.completed":
        _emit(worker_log, logging.INFO, "completed in %.3f s", f.get("duration", 0.0), extra=extra)
    elif name == "errands.job.progress":
        _emit(
            worker_log,
            logging.DEBUG,
            "progress %.0f%%: %s",
            100 * f.get("progress", 0.0),
            f.get("message", ""),
            extra=extra,
        )
    elif name == "errands.job.retrying":
        worker_log.warning(
            "failed, retrying in %.1f s (attempt %d of %d): %s: %s",
            f.get("delay", 0.0),
            f.get("attempt", 0),
            f.get("max_attempts", 0),
            f.get("error_type"),
            f.get("error_message"),
            extra=extra,
        )
    elif name == "errands.job.dead":
        rescued = f.get("reason") in ("worker_lost", "poison")
        where = maintenance_log if rescued else worker_log
        where.error(
            "dead after %d attempt(s), moved to the dead-letter queue: %s: %s",
            f.get("attempt", 0),
            f.get("error_type"),
            f.get("error_message"),
            extra=extra,
        )
    elif name == "errands.job.cancelled":
        _emit(worker_log, logging.INFO, "cancelled", extra=extra)
    elif name == "errands.job.stale_write_rejected":
        worker_log.warning(
            "stale write rejected: job %s is no longer held by this attempt (lease lost or job "
            "cancelled); the %s outcome was not recorded",
            f.get("job_id"),
            f.get("outcome"),
            extra=extra,
        )
    elif name == "errands.job.rescued":
        maintenance_log.warning("rescued (%s): %s", f.get("state"), f.get("reason"), extra=extra)
    elif name == "errands.job.released":
        worker_log.warning("released at shutdown (attempt not charged)", extra=extra)
    elif name == "errands.job.waiting":
        timeout = f.get("timeout")
        worker_log.info(
            "suspended: waiting for signal %r%s (holds no slot)",
            f.get("signal"),
            "" if timeout is None else f" for up to {timeout:g} s",
            extra=extra,
        )
    elif name == "errands.job.wait_timed_out":
        maintenance_log.warning(
            "no signal %r in time: the wait failed (now %s)",
            f.get("signal"),
            f.get("state"),
            extra=extra,
        )


def _log_other(name: str, f: dict) -> None:  # type: ignore[type-arg]
    extra = _extra(name, f)
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


def _extra(name: str, f: dict) -> dict:  # type: ignore[type-arg]
    extra = {"event": name}
    for key in RECORD_FIELDS:
        value = f.get(key)
        if value is not None:
            extra[key] = value
    return extra


def _short_args(args: object, limit: int = 200) -> str:
    if not isinstance(args, dict):
        return ""
    text = ", ".join(f"{k}={v!r}" for k, v in args.items())
    return text if len(text) <= limit else text[: limit - 3] + "..."


log_event.wants = _wants  # type: ignore[attr-defined]
