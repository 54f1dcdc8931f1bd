"""A running worker in the registry, on both stores: listed with its own beat, and listed
again when the registry forgot it (the conformance suite covers the statements)."""

from __future__ import annotations

import errands

from ..integration.helpers import wait_until
from .helpers import workers


def test_a_worker_forgotten_by_the_registry_lists_itself_again(store: errands.App) -> None:
    """Its heartbeats only updated its row: a worker dropped from the registry (unlisted
    at start while the store was away, or forgotten by the leader after a long silence)
    ran unlisted for good, shown nowhere, its queues reported unserved."""
    store.lease = 1.5  # beats every 0.5 s
    with workers([store], maintenance=False) as (worker,):
        wait_until(lambda: [w.id for w in store.backend.worker_list()] == [worker.id])
        (listed,) = store.backend.worker_list()
        assert listed.beat_seconds == worker.leases.interval == 0.5
        store.backend.worker_deregister(worker.id)  # what the leader's prune does
        wait_until(lambda: [w.id for w in store.backend.worker_list()] == [worker.id])
    assert store.backend.worker_list() == []  # a stopped worker deregisters for good
    worker._stopping.clear()  # as after a shutdown that began with an error, not stop()
    worker.registry_beat()  # a beat still in flight as it left
    assert store.backend.worker_list() == []
