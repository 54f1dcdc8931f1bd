"""Durable signals with real worker processes: a job run by the process pool (a child
process of the worker) suspends, holding no slot, and resumes when `errands jobs signal`
sends its signal."""

from __future__ import annotations

import json

import acc_basic
import pytest

from .harness import Cluster, wait_until

pytestmark = pytest.mark.acceptance


def test_a_process_pool_job_suspends_and_resumes_on_a_signal_from_the_cli(
    cluster: Cluster,
) -> None:
    app = cluster.app()
    cluster.start_worker("--pool", "process", "-c", "1")
    handle = acc_basic.approval.enqueue(order=5)
    wait_until(lambda: handle.status().value == "waiting", 30, "the job to suspend")
    assert handle.job().lease_owner is None
    # its one slot is free: another job runs while it waits
    assert acc_basic.noop.enqueue(n=7).result(timeout=30) == 7
    done = cluster.cli(
        "jobs", "signal", str(handle.id), "approved", "--payload", json.dumps({"by": "ops"}),
        "--url", app.url,
    )  # fmt: skip
    assert done.code == 0, done.stderr
    result = handle.result(timeout=30)
    assert result["order"] == 5 and result["decision"] == {"by": "ops"}
