"""A worker process hands the GIL between its threads every 20 ms (Python's default is
5 ms; docs/concurrency.md), or as ``--switch-interval`` says, in each process of a
supervised worker too. Read where the handler runs: a job returns it."""

from __future__ import annotations

import signal

import acc_basic

from .harness import Cluster


def test_a_worker_process_switches_threads_every_20_ms_unless_told_otherwise(
    cluster: Cluster,
) -> None:
    cluster.app()
    lone = cluster.start_worker()
    assert acc_basic.switch_interval.enqueue().result(timeout=30) == 0.02
    lone.signal(signal.SIGTERM)
    assert lone.wait_exit(30) == 0

    supervised = cluster.start_worker("--processes", "2", "--switch-interval", "0.005")
    handles = [acc_basic.switch_interval.enqueue() for _ in range(4)]
    assert [h.result(timeout=30) for h in handles] == [0.005] * 4
    supervised.signal(signal.SIGTERM)
    assert supervised.wait_exit(30) == 0
