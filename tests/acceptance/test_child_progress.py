"""A handler in a child process (``--pool process``) reports progress like one in a
thread: the child sends its reports to the worker (throttled, the latest kept), and the
worker stores them with its next heartbeat (issue 20)."""

from __future__ import annotations

import signal
from pathlib import Path

import acc_basic
import pytest

import errands

from .harness import Cluster, wait_until

pytestmark = pytest.mark.acceptance


def test_a_handler_in_a_child_process_reports_progress_that_the_worker_stores(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Given a worker with --pool process, when its handler calls ctx.progress a thousand
    times and then waits, the last report reaches handle.progress() while the job runs,
    and the job completes in the child."""
    release = tmp_path / "release"
    cluster.app()  # acc_basic.app on the cluster's store
    worker = cluster.start_worker("--pool", "process", "-c", "1", label="worker")
    handle = acc_basic.reporting.enqueue(until=str(release))
    wait_until(
        lambda: handle.progress() == errands.Progress(1.0, "rendered 1000 of 1000 pages"),
        60,
        "the child's last progress report stored",
        describe=lambda: f"{cluster.state_of(handle.id)}: {handle.progress()}",
    )
    assert cluster.state_of(handle.id) == "running"
    release.touch()
    assert handle.result(timeout=60) != worker.pid  # it ran in a child, not the worker
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit(15) == 0
