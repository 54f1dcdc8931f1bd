"""Rescued jobs (suspects) run several at once, each isolated in a child process of the
worker (issue 16, A15): a burst of them drains at the pace they run, and one that kills
its process takes none of the others along (real ``errands worker`` processes on SQLite).
"""

from __future__ import annotations

import importlib
import json
import os
import secrets
import signal
import threading
from pathlib import Path

import acc_basic
import acc_plain
import pytest

from errands.backends.base import ClaimParams, QueueClaim
from errands.maintenance.service import Maintenance
from errands.worker import worker as worker_module
from errands.worker.process_pool import ProcessRunner

from .harness import Cluster, wait_until

pytestmark = pytest.mark.acceptance

MEETING = 7  # with the crasher, as many suspects as the worker's 8 slots (4 lanes before)


def _strand_as_suspects(cluster: Cluster, ids: list[int]) -> None:
    """Claim the jobs as a worker that then dies, and rescue them: each is a suspect."""
    app = cluster.app()
    claimed = app.backend.job_claim(ClaimParams([QueueClaim("default", 10)], 10, "dead", 30.0))
    assert sorted(r.id for r in claimed) == sorted(ids)
    cluster.execute(
        "UPDATE errands_jobs SET lease_expires_at = (julianday('now') - 2440587.5) * 86400.0 "
        "- 60 WHERE state = 'running'"
    )
    assert Maintenance(app, "test-rescuer").rescue() == len(ids)


def test_a_burst_of_suspects_runs_at_once_each_in_its_own_child_and_a_crasher_takes_none_along(
    cluster: Cluster,
) -> None:
    """Given seven jobs that each wait until all seven have begun, and one that kills its
    process, all rescued at once, when one worker (-c 8) takes them, then the seven run
    at the same time (none waits for a lane: each suspect has a child of its own, up to
    the worker's slots), in distinct child processes, and complete with one rescue each
    and nothing else charged; the crasher kills only its children, is recorded at once
    as crashes, and goes dead as poison after its third death; the worker never dies."""
    app = cluster.app()
    meeting = [acc_basic.rendezvous.enqueue(expected=MEETING) for _ in range(MEETING)]
    crash = acc_basic.crash.enqueue()
    _strand_as_suspects(cluster, [h.id for h in meeting] + [crash.id])

    worker = cluster.start_worker("-c", "8", label="worker")
    wait_until(
        lambda: (
            all(cluster.state_of(h.id) == "completed" for h in meeting)
            and cluster.state_of(crash.id) == "dead"
        ),
        90,
        "the meeting jobs completed and the crasher dead",
        describe=lambda: str(dict(cluster.states())),
    )
    assert worker.alive, "a suspect took the worker down"

    jobs = [app.get_job(h.id) for h in meeting]
    assert [j.result["met"] for j in jobs] == [True] * MEETING, "they did not all run at once"
    pids = {j.result["pid"] for j in jobs}
    assert len(pids) == MEETING  # one child process each
    assert worker.pid not in pids  # never in the worker itself
    for job in jobs:
        assert (job.rescues, [e.type for e in job.errors]) == (1, ["WorkerLost"])

    job = app.get_job(crash.id)
    assert [e.type for e in job.errors] == ["WorkerLost", "WorkerProcessDied", "WorkerProcessDied"]
    assert [e.kind for e in job.errors] == ["worker_lost", "crash", "poison"]
    assert job.errors[-1].message.startswith("poison: worker died 3 times")
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit(15) == 0


WAITER = """
import os
import time

import errands

app = errands.App()


@app.job(name="waiter")
def waiter(path: str) -> int:
    while not os.path.exists(path):
        time.sleep(0.01)
    return os.getpid()
"""


def test_a_warm_runner_keeps_a_spare_child_ahead_of_need_and_retires_idle_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given the suspects' child runner, warmed (one spare), when a job takes the spare,
    then the job runs in that child, started before the job came; another spare is
    started in the background at once; and once both are idle past ``idle_retire``, the
    one beyond the spare is stopped."""
    name = f"spare_app_{secrets.token_hex(4)}"  # children import it afresh, whatever ran before
    (tmp_path / f"{name}.py").write_text(WAITER)
    monkeypatch.syspath_prepend(str(tmp_path))
    app = importlib.import_module(name).app
    app.url = f"sqlite:///{tmp_path}/store.db"
    go = tmp_path / "go"
    app.registry["waiter"].enqueue(path=str(go))
    (row,) = app.backend.job_claim(ClaimParams([QueueClaim("default", 1)], 1, "test", 30.0))
    runner = ProcessRunner(f"{name}:app", app.url, 3, start=False, spare=1, idle_retire=0.5)
    try:
        runner.warm()
        wait_until(runner.idle, 60, "the spare child")
        (spare,) = runner.pids()

        running = runner.submit(row)
        wait_until(lambda: runner.idle() == 1, 60, "a new spare, started in the background")
        assert len(runner.pids()) == 2 and spare in runner.pids()
        go.touch()
        assert json.loads(running.result(60).result_json) == spare  # ran in the spare

        wait_until(lambda: len(runner.pids()) == 1, 60, "the idle child beyond the spare stopped")
        assert (runner.idle(), runner.retired) == (1, 1)
    finally:
        runner.shutdown()
        app.close()


def test_a_worker_that_finds_a_rescued_job_due_starts_its_children_at_once(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker runs suspects in child processes it starts SUSPECT_WARM_AFTER seconds
    after its own start (here 10 minutes), and claims none before: a worker restarted
    after a crash, often the one whose jobs were rescued, would leave them waiting. It
    asks the store whether a rescued job is due and, if so, starts its children now."""
    monkeypatch.setattr(worker_module, "SUSPECT_WARM_AFTER", 600.0)
    app = cluster.app("acc_plain")
    handle = acc_plain.plain_pid.enqueue(n=7)
    _strand_as_suspects(cluster, [handle.id])
    worker = app.worker(concurrency=2, app_path="acc_plain:app", poll_interval=0.05)
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        result = handle.result(timeout=60)
    finally:
        worker.stop()
        thread.join(30)
    assert result["n"] == 7, "the suspect waited for the warm-up delay"
    assert result["pid"] != os.getpid()  # isolated: in a child process
    assert app.get_job(handle.id).rescues == 1


def test_a_worker_that_sees_a_running_jobs_lease_go_silent_starts_its_children_before_the_rescue(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job whose worker died stays ``running`` until its lease runs out and the leader
    rescues it; a worker whose suspects' children are not started yet then took their
    start-up (seconds on a loaded machine) after the rescue. A lease with less than half
    its length left belongs to a worker that stopped renewing it (renewals come every
    third): seeing one, the worker starts its children while the lease runs out. No
    maintenance here, so no rescue ever comes: only the silent lease can start them."""
    monkeypatch.setattr(worker_module, "SUSPECT_WARM_AFTER", 600.0)
    app = cluster.app("acc_plain")
    handle = acc_plain.plain_pid.enqueue(n=8)
    # Claimed by a worker that then died, for 14 s: less than half of the app's 30 s.
    claimed = app.backend.job_claim(ClaimParams([QueueClaim("default", 1)], 1, "dead", 14.0))
    assert [r.id for r in claimed] == [handle.id]
    worker = app.worker(
        concurrency=2, app_path="acc_plain:app", poll_interval=0.05, maintenance=False
    )
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: worker.suspect_processes is not None, 60, "the children asked for")
        row = app.get_job(handle.id)
        assert (row.state, row.rescues, row.lease_owner) == ("running", 0, "dead")
        assert row.lease_expires_at is not None
        assert app.backend.db_now() < row.lease_expires_at.timestamp(), "only once it ran out"
        wait_until(lambda: worker.suspect_processes.ready, 120, "the suspects' child started")
    finally:
        worker.stop()
        thread.join(30)
