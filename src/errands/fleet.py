"""What the workers' registry says: which workers are alive, which queues they serve, and
which periodic jobs wait in a queue that no live worker serves.

Each worker writes a registry heartbeat every third of its shortest lease (the lease
keeper's beat) and registers that interval; one that missed :data:`MISSED_HEARTBEATS` of
its own beats in a row is presumed dead, whatever the reader's lease (a worker of a
release before schema 18 registers none: the reader's lease stands in). It stays listed
(as dead) until the maintenance leader forgets it, 5 minutes or ten of its beats later;
a worker still running lists itself again at its next beat.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from .backends.base import WorkerInfo

if TYPE_CHECKING:
    from .app import App

log = logging.getLogger("errands.worker")

MISSED_HEARTBEATS = 3
BEAT_SLACK = 2.0  # seconds: a heartbeat's write may take a moment to land


def heartbeat_interval(lease: float) -> float:
    """How often a worker of an app with this lease beats, at the longest."""
    return max(lease / 3, 0.2)


def presumed_dead_after(lease: float, beat: float | None = None) -> float:
    """Seconds without a heartbeat after which a worker is presumed dead: ``beat``, the
    interval the worker registered, or else the interval of an app with this lease."""
    return MISSED_HEARTBEATS * (beat or heartbeat_interval(lease)) + BEAT_SLACK


def presumed_dead(worker: WorkerInfo, lease: float) -> bool:
    """Judged by the worker's own registered beat; ``lease`` (the reader's) only for a
    worker that registered none (before schema 18)."""
    return worker.heartbeat_age > presumed_dead_after(lease, worker.beat_seconds)


def queue_names(spec: str) -> list[str]:
    """The queue names of a worker's registry entry (``"emails=10,payments"``)."""
    return [part.split("=", 1)[0].strip() for part in spec.split(",") if part.strip()]


def served_queues(workers: Iterable[WorkerInfo], lease: float) -> set[str]:
    """Every queue some live worker serves."""
    return {q for w in workers if not presumed_dead(w, lease) for q in queue_names(w.queues)}


def live_served_queues(app: App) -> set[str]:
    """:func:`served_queues` of the app's store."""
    return served_queues(app.backend.worker_list(), app.lease)


def unserved_periodic(app: App, served: set[str]) -> dict[str, list[str]]:
    """The periodic jobs whose queue is not in ``served``, by queue."""
    waiting: dict[str, list[str]] = {}
    for periodic in app.schedules.values():
        queue = periodic.bound.request.queue
        if queue not in served:
            waiting.setdefault(queue, []).append(periodic.name)
    return waiting


def warn_unserved_periodic(app: App, queues: list[str]) -> None:
    """Log a warning for each queue of periodic jobs that neither a worker serving
    ``queues`` (starting now) nor another live worker serves: their runs would wait
    unseen. Every worker says it at start-up, from the CLI or embedded. Best effort: a
    store error skips the warning (the worker's own start-up reports the store)."""
    if not app.schedules:
        return
    try:
        others = live_served_queues(app)
    except Exception:
        return
    for queue, names in sorted(unserved_periodic(app, set(queues) | others).items()):
        log.warning(
            "periodic job(s) %s run in queue %s, which this worker (-q %s) and no other "
            "live worker serves: their runs wait there; add %s to -q or start a worker for it",
            ", ".join(names),
            queue,
            ",".join(queues),
            queue,
        )
