"""``errands worker --processes N``: one supervisor, N real worker processes (DESIGN §7).

A child killed with SIGKILL is restarted, so capacity comes back; SIGTERM to the
supervisor stops every child gracefully and the supervisor exits 0.
"""

from __future__ import annotations

import os
import re
import signal
import sys

import acc_basic
import pytest

from .harness import WORKER_FLAGS, Cluster, children_of, pid_alive, wait_until

pytestmark = [
    pytest.mark.acceptance,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds children in /proc"),
]

STARTED = r"worker (w-[0-9a-f]+) started"


def test_processes_supervisor_restarts_a_killed_child_and_stops_all_children_on_sigterm(
    cluster: Cluster,
) -> None:
    app = cluster.app()
    supervisor = cluster.spawn(
        ["worker", "acc_basic:app", *WORKER_FLAGS, "--processes", "2"], "supervisor"
    )
    # The children inherit the supervisor's stderr: both workers log there.
    supervisor.wait_log(STARTED, 20, count=2)
    # its own children: each worker has children too (a forkserver, a spare)
    children = children_of(supervisor.pid)
    assert len(children) == 2, children
    assert len(set(re.findall(STARTED, supervisor.stderr()))) == 2  # two distinct workers

    first = app.enqueue_many([acc_basic.noop.bind(n=i) for i in range(200)])
    wait_until(
        lambda: all(cluster.state_of(h.id) == "completed" for h in first),
        30,
        "the first batch to complete",
    )

    victim, survivor = children
    os.kill(victim, signal.SIGKILL)
    replacement = wait_until(
        lambda: [p for p in children_of(supervisor.pid) if p not in children],
        15,
        "the supervisor to start a replacement child",
        describe=lambda: supervisor.stderr()[-3000:],
    )[0]
    assert not pid_alive(victim)
    assert sorted(children_of(supervisor.pid)) == sorted([survivor, replacement])
    supervisor.wait_log(STARTED, 20, count=3)

    second = app.enqueue_many([acc_basic.noop.bind(n=i) for i in range(200)])
    wait_until(
        lambda: all(cluster.state_of(h.id) == "completed" for h in second),
        30,
        "the second batch to complete after the restart",
    )

    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait_exit(20) == 0
    for pid in (survivor, replacement):
        wait_until(lambda pid=pid: not pid_alive(pid), 5, f"child {pid} to exit")
    assert "Traceback" not in supervisor.stderr()
