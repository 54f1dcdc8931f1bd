"""The workers' registry: each worker is judged by the heartbeat it registered, not by
the lease of the App that reads the registry."""

from __future__ import annotations

from errands.backends import Backend
from errands.backends.base import WorkerInfo
from errands.fleet import presumed_dead

from .conftest import Harness

FORGET_AFTER = 300.0  # the leader's patience (maintenance.WORKER_FORGET_AFTER)


def register(backend: Backend, worker_id: str, beat_seconds: float | None) -> None:
    backend.worker_register(
        WorkerInfo(
            id=worker_id, host="h", pid=1, queues="default", concurrency=4, version="x",
            beat_seconds=beat_seconds,
        )
    )  # fmt: skip


def test_a_worker_is_judged_by_its_own_heartbeat_not_the_readers_lease(
    backend: Backend, harness: Harness
) -> None:
    register(backend, "w-long-lease", beat_seconds=100.0)  # its app's lease: 300 s
    register(backend, "w-old", beat_seconds=None)  # a worker before schema 18
    for worker_id in ("w-long-lease", "w-old"):
        harness.backdate_heartbeat(backend, worker_id, 60.0)
    workers = {w.id: w for w in backend.worker_list()}
    assert workers["w-long-lease"].beat_seconds == 100.0
    reader_lease = 30.0  # a dashboard on the default lease: 10 s beats, dead after 32 s
    assert not presumed_dead(workers["w-long-lease"], reader_lease)  # 60 s < 3 x 100 s
    assert presumed_dead(workers["w-old"], reader_lease)
    harness.backdate_heartbeat(backend, "w-long-lease", 310.0)
    assert presumed_dead(
        next(w for w in backend.worker_list() if w.id == "w-long-lease"), reader_lease
    )


def test_the_registry_forgets_a_silent_worker_after_ten_of_its_beats_at_least(
    backend: Backend, harness: Harness
) -> None:
    """A worker with a 15-minute lease beats every 5 minutes: forgotten after 300 s of
    silence, it was dropped between two beats (and, its beats only updating its row,
    never listed again)."""
    register(backend, "w-slow", beat_seconds=300.0)
    register(backend, "w-fast", beat_seconds=1.0)
    register(backend, "w-old", beat_seconds=None)
    for worker_id in ("w-slow", "w-fast", "w-old"):
        harness.backdate_heartbeat(backend, worker_id, 400.0)
    assert backend.worker_prune(FORGET_AFTER) == 2
    assert [w.id for w in backend.worker_list()] == ["w-slow"]
    harness.backdate_heartbeat(backend, "w-slow", 3001.0)
    assert backend.worker_prune(FORGET_AFTER) == 1


def test_a_heartbeat_says_whether_the_worker_is_listed(backend: Backend) -> None:
    register(backend, "w-listed", beat_seconds=1.0)
    assert backend.worker_heartbeat("w-listed", 1, 2) is True
    assert backend.worker_heartbeat("w-forgotten", 1, 2) is False
