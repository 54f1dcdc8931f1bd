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
import time
from pathlib import Path
from typing import Any

import acc_basic
import acc_plain
import pytest

from errands.backends.base import ClaimParams, QueueClaim
from errands.maintenance.service import Maintenance
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


def test_an_async_workers_isolated_suspects_take_loop_slots_so_no_more_than_c_jobs_run(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Given a worker (-c 3) whose jobs are all async, so that it prefetches, and two
    rescued jobs it runs isolated in child processes, when its handlers prove quick and it
    claims a backlog beyond its slots, then no more than 3 jobs ever run at once: each
    suspect holds one of the loop's slots. (The suspects' threads and the loop's 3 slots
    ran up to 5.)"""
    app = cluster.app("acc_async")
    folder = tmp_path / "holds"
    folder.mkdir()
    hold = importlib.import_module("acc_async").async_hold
    quick = importlib.import_module("acc_async").async_quick
    suspects = [hold.enqueue(folder=str(folder)) for _ in range(2)]
    _strand_as_suspects(cluster, [h.id for h in suspects])
    quicks = [quick.enqueue(n=i) for i in range(6)]  # learnt quick: the worker prefetches
    fresh = [hold.enqueue(folder=str(folder)) for _ in range(4)]

    worker = cluster.start_worker("-c", "3", app="acc_async:app", label="worker")
    peak = 0
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        peak = max(peak, sum(1 for p in folder.iterdir() if p.name.startswith("running-")))
        time.sleep(0.005)
    (folder / "release").touch()
    wait_until(
        lambda: all(cluster.state_of(h.id) == "completed" for h in suspects + quicks + fresh),
        60,
        "every job completed",
        describe=lambda: str(dict(cluster.states())),
    )
    assert peak == 3, f"{peak} jobs ran at once on a worker of -c 3"
    pids = {app.get_job(h.id).result for h in suspects}
    assert worker.pid not in pids  # the suspects ran isolated, in children
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

        running = runner.submit(row)  # (returns at once: a thread of the runner's takes the spare)
        wait_until(
            lambda: runner.idle() == 1 and len(runner.pids()) == 2,
            60,
            "a new spare, started in the background",
        )
        assert spare in runner.pids()
        go.touch()
        assert json.loads(running.result(60).result_json) == spare  # ran in the spare

        wait_until(lambda: len(runner.pids()) == 1, 60, "the idle child beyond the spare stopped")
        assert (runner.idle(), runner.retired) == (1, 1)
    finally:
        runner.shutdown()
        app.close()


def test_an_idle_worker_starts_its_suspects_spare_child_with_itself(cluster: Cluster) -> None:
    """A worker restarted after a crash is often the one its rescued jobs come back to a
    lease later: it starts its suspects' forkserver and spare child as it starts, with no
    rescued job in sight (after a warm-up delay, rescued jobs waited for the start-up)."""
    app = cluster.app("acc_plain")
    worker = app.worker(concurrency=2, app_path="acc_plain:app", poll_interval=0.05)
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        wait_until(
            lambda: worker.suspect_processes is not None and worker.suspect_processes.idle() == 1,
            120,
            "the suspects' spare child, started with the worker",
        )
    finally:
        worker.stop()
        thread.join(30)
    assert worker.suspect_processes.started == 1 and worker.processed == 0


def test_a_worker_runs_a_rescued_job_due_at_its_start_in_a_child_process(
    cluster: Cluster,
) -> None:
    """A rescued job due when a worker starts runs isolated, in a child process."""
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
    assert result["n"] == 7
    assert result["pid"] != os.getpid()  # isolated: in a child process
    assert app.get_job(handle.id).rescues == 1


DYING = """
import os

import errands

app = errands.App()


@app.job(name="dies")
def dies() -> None:
    os._exit(1)


@app.job(name="fine")
def fine() -> int:
    return os.getpid()
"""


def test_a_submit_starts_a_child_itself_when_a_dead_ones_replacement_could_not_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a runner of one child, whose child dies running a job and whose replacement
    fails to start, when the next job is submitted, then it starts a child itself (or
    fails visibly), never waits: it waited for a free child for ever (-c 1: the whole
    worker wedged)."""
    name = f"dying_app_{secrets.token_hex(4)}"
    (tmp_path / f"{name}.py").write_text(DYING)
    monkeypatch.syspath_prepend(str(tmp_path))
    app = importlib.import_module(name).app
    app.url = f"sqlite:///{tmp_path}/store.db"
    app.registry["dies"].enqueue()
    app.registry["fine"].enqueue()
    rows = app.backend.job_claim(ClaimParams([QueueClaim("default", 2)], 2, "test", 30.0))
    dying, fine = sorted(rows, key=lambda r: r.id)
    runner = ProcessRunner(f"{name}:app", app.url, 1, start=False)
    real_spawn = runner._spawn
    replacements: list[str] = []
    submitted = threading.Event()

    def spawn_once(replacing: Any = None) -> Any:
        if runner.started:  # the replacement of the dead child: it cannot start
            submitted.wait(30)  # the next job waits for a child meanwhile
            time.sleep(0.3)
            replacements.append("refused")
            runner._spawn = real_spawn  # type: ignore[method-assign]
            raise OSError("injected: cannot fork")
        return real_spawn()

    runner._spawn = spawn_once  # type: ignore[method-assign]
    try:
        with pytest.raises(Exception, match="died"):
            runner.submit(dying).result(60)
        done: list[Any] = []

        def submit_next() -> None:
            submitted.set()
            done.append(runner.submit(fine))

        threading.Thread(target=submit_next, daemon=True).start()
        wait_until(lambda: replacements == ["refused"], 60, "the refused replacement")
        wait_until(lambda: done, 30, "the next submit to get a child")
        assert json.loads(done[0].result(60).result_json) in runner.pids()
    finally:
        runner.shutdown()
        app.close()
