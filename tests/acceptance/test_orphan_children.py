"""A child process (``--pool process``, or a suspect's) leaves as soon as its worker dies:
the worker's jobs are rescued when their leases run out, and a child running on would
race the rescued run (two runs of one job at once; a per-key limit broken)."""

from __future__ import annotations

import signal
from pathlib import Path

import acc_basic
import pytest

from .harness import Cluster, wait_until

pytestmark = pytest.mark.acceptance


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (an exited one not yet reaped is not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def test_a_child_whose_worker_is_killed_leaves_at_once_and_does_not_race_the_rescued_run(
    cluster: Cluster,
) -> None:
    """Given a job sleeping two minutes in a worker's child process, when the worker is
    SIGKILLed, then the child is gone within seconds (it was left sleeping through its
    job, beside the rescued run), and the job's rescued run completes in a new worker."""
    cluster.app()
    worker = cluster.start_worker("--pool", "process", "-c", "1", label="worker")
    handle = acc_basic.sleepy.enqueue(seconds=120.0, first_only=True)
    wait_until(lambda: cluster.effects(handle.id), 60, "the job running in a child")
    [(_, attempt, child, _)] = cluster.effects(handle.id)
    assert attempt == 1 and child != worker.pid and _running(child)

    worker.signal(signal.SIGKILL)
    worker.wait_exit(10)
    wait_until(lambda: not _running(child), 30, f"the worker's child {child} to leave")

    cluster.start_worker("--pool", "process", "-c", "1", label="next")
    assert handle.result(timeout=60)["attempt"] == 2
    assert [a for _, a, *_ in cluster.effects(handle.id)] == [1, 2]
