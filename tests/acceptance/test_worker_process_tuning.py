"""A worker process hands the GIL between its threads every 20 ms (Python's default is
5 ms; docs/concurrency.md), or as ``--switch-interval`` says, in each process of a
supervised worker too; its garbage collector has frozen the app's objects and starts a
young collection after 10,000 new objects (src/errands/worker/collector.py). Read where
the handler runs: a job returns it."""

from __future__ import annotations

import signal

import acc_basic

from .harness import Cluster


def test_a_worker_process_switches_threads_every_20_ms_and_collects_garbage_less_often(
    cluster: Cluster,
) -> None:
    cluster.app()
    lone = cluster.start_worker()
    _, interval, young, frozen = acc_basic.switch_interval.enqueue().result(timeout=30)
    assert interval == 0.02
    assert young == 10_000
    assert frozen > 1_000  # errands, its libraries and the app, imported before the run
    lone.signal(signal.SIGTERM)
    assert lone.wait_exit(30) == 0

    # one slot each, nothing prefetched: two jobs that wait for each other run one in
    # each process of the supervised worker
    options = ("--processes", "2", "-c", "1", "--prefetch", "0", "--switch-interval", "0.005")
    supervised = cluster.start_worker(*options)
    handles = [acc_basic.switch_interval.enqueue(meet=2) for _ in range(2)]
    results = [h.result(timeout=60) for h in handles]
    assert [interval for _, interval, _, _ in results] == [0.005, 0.005]
    assert [young for _, _, young, _ in results] == [10_000, 10_000]
    assert len({pid for pid, _, _, _ in results}) == 2, results  # both processes
    supervised.signal(signal.SIGTERM)
    assert supervised.wait_exit(30) == 0
