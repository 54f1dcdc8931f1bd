"""A child process (``--pool process``, or a suspect's) leaves as soon as its worker dies:
the worker's jobs are rescued when their leases run out, and a child running on would
race the rescued run (two runs of one job at once; a per-key limit broken)."""

from __future__ import annotations

import json
import signal
import time
import uuid
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


def _with_token(token: str) -> list[int]:
    """The live processes whose environment holds ``token``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if token.encode() in (entry / "environ").read_bytes() and _running(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:  # gone meanwhile, or not ours to read
                continue
    return found


def test_a_worker_stopped_while_its_spare_child_starts_exits_cleanly_and_the_child_leaves_quietly(
    cluster: Cluster,
) -> None:
    """Given a worker logging JSON whose suspects' spare child (started as the worker
    starts) takes 2 s to import the app, when the worker is stopped gracefully while that
    child starts, then the worker exits 0, the child and its forkserver leave within
    seconds, and the child writes nothing: every line of the worker's log is JSON (it
    used to print that its worker was gone, as if the worker had died)."""
    cluster.app()
    token = f"acc-{uuid.uuid4().hex}"
    worker = cluster.start_worker(
        "--log-format",
        "json",
        app="acc_slow_child:app",
        env={"ACC_SLOW_CHILD_IMPORT": "2", "ACC_TOKEN": token},
    )
    wait_until(lambda: len(_with_token(token)) >= 2, 20, "the worker's forkserver to start")
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit(20) == 0, worker.stderr()[-4000:]
    wait_until(lambda: not _with_token(token), 30, "the forkserver and the child to leave")
    time.sleep(0.2)  # anything they wrote on their way out is in the file by now
    lines = [line for line in worker.stderr().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # a line that is not JSON fails here
    assert "errands.worker.stopped" in [r.get("event") for r in records], lines
