"""A child process (``--pool process``, or a suspect's) leaves as soon as its worker dies:
the worker's jobs are rescued when their leases run out, and a child running on would
race the rescued run (two runs of one job at once; a per-key limit broken)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import acc_basic
import pytest

from .harness import Cluster, descendants, pid_running, wait_until

pytestmark = pytest.mark.acceptance


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
    assert attempt == 1 and child != worker.pid and pid_running(child)

    worker.signal(signal.SIGKILL)
    worker.wait_exit(10)
    wait_until(lambda: not pid_running(child), 30, f"the worker's child {child} to leave")

    cluster.start_worker("--pool", "process", "-c", "1", label="next")
    assert handle.result(timeout=60)["attempt"] == 2
    assert [a for _, a, *_ in cluster.effects(handle.id)] == [1, 2]


def _family(token: str) -> dict[int, int]:
    """The live processes whose environment holds ``token``: pid -> parent pid."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                pid = int(entry.name)
                if token.encode() in (entry / "environ").read_bytes() and pid_running(pid):
                    status = (entry / "status").read_text()
                    found[pid] = int(status.split("\nPPid:\t")[1].split()[0])
            except (OSError, IndexError, ValueError):  # gone meanwhile, or not ours to read
                continue
    return found


def _json_lines(text: str) -> list[dict[str, object]]:
    """Every line of ``text`` as JSON (a line that is not JSON fails the test here)."""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_a_child_cut_off_in_its_job_says_so_in_the_worker_log_format(cluster: Cluster) -> None:
    """Given a worker logging JSON whose job runs in a child process, when the worker is
    SIGKILLed, then the child leaves with one line saying its worker is gone, as a JSON
    record like the worker's own (it was plain text in a JSON log)."""
    cluster.app()
    worker = cluster.start_worker("--pool", "process", "-c", "1", "--log-format", "json")
    handle = acc_basic.sleepy.enqueue(seconds=120.0, first_only=True)
    wait_until(lambda: cluster.effects(handle.id), 60, "the job running in a child")
    [(_, _, child, _)] = cluster.effects(handle.id)
    worker.signal(signal.SIGKILL)
    worker.wait_exit(10)
    wait_until(lambda: not pid_running(child), 30, f"the worker's child {child} to leave")
    time.sleep(0.2)  # its last line is in the file by now
    gone = [r for r in _json_lines(worker.stderr()) if "is gone" in str(r["message"])]
    assert [(r["level"], r["logger"]) for r in gone] == [("warning", "errands.worker")], gone


def test_a_worker_stopped_while_its_spare_child_starts_exits_cleanly_and_the_child_leaves_quietly(
    cluster: Cluster,
) -> None:
    """Given a worker logging JSON whose suspects' spare child (started as the worker
    starts) takes 2 s to start, when the worker is stopped gracefully while that child
    starts, then the worker exits 0, the child and its forkserver leave within seconds,
    and every line of the worker's log is JSON, its warning of a new database file
    included (tests/unit/test_child_leaves_quietly.py proves an idle child's silence
    deterministically; here the worker's exit usually terminates the child first)."""
    token = f"acc-{uuid.uuid4().hex}"
    loading = cluster.folder / "child-loading"
    worker = cluster.start_worker(
        "--log-format",
        "json",
        "--url",
        cluster.url,  # a SQLite file not made yet: the worker's warning is JSON too
        app="acc_slow_child:app",
        env={
            "ACC_SLOW_CHILD_START": "2",
            "ACC_CHILD_LOADING": str(loading),
            "ACC_TOKEN": token,
        },
    )
    wait_until(loading.exists, 20, "the worker's spare child to be loading the app")
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit(20) == 0, worker.stderr()[-4000:]
    wait_until(lambda: not _family(token), 30, "the forkserver and the child to leave")
    time.sleep(0.2)  # anything they wrote on their way out is in the file by now
    records = _json_lines(worker.stderr())
    assert "errands.worker.stopped" in [r.get("event") for r in records], records
    assert [r["level"] for r in records if "no database" in str(r["message"])] == ["warning"]
    assert not [r for r in records if "is gone" in str(r["message"])], records


def test_a_child_that_dies_while_a_process_it_forked_lives_on_fails_its_job_at_once(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A handler in a worker child forks (a multiprocessing pool, a shell) and the child
    dies (a segfault, the OOM killer): its exit is noticed, not only its pipe's end,
    which the forked process holds open. The job stayed running, heart-beaten, until
    that process ended (here a minute; a daemon: for ever)."""
    app = cluster.app()
    cluster.start_worker("--pool", "process", "-c", "1", label="worker")
    pidfile = tmp_path / "grandchild.pid"
    handle = acc_basic.fork_then_die.enqueue(pidfile=str(pidfile), seconds=60.0)
    try:
        wait_until(lambda: app.get_job(handle.id).state.value == "dead", 30, "the job to fail")
        [error] = app.get_job(handle.id).errors
        assert error.type == "WorkerProcessDied" and "exit code 7" in error.message
    finally:
        if pidfile.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pidfile.read_text()), signal.SIGKILL)


def test_a_child_that_died_while_idle_is_replaced_before_it_is_handed_a_job(
    cluster: Cluster,
) -> None:
    """A worker child killed while it waits for work (the OOM killer picks the idle one
    holding the most memory): the next job starts in a fresh child and completes on its
    first attempt. Handed the dead child, it failed as a crash (WorkerProcessDied),
    charged toward its poison limit."""
    app = cluster.app()
    cluster.start_worker("--pool", "process", "-c", "1", label="worker")
    first = acc_basic.sleepy.enqueue(seconds=0.0)
    assert first.result(timeout=60)["attempt"] == 1
    child = first.result(timeout=1)["pid"]
    os.kill(child, signal.SIGKILL)
    wait_until(lambda: not pid_running(child), 30, f"the idle child {child} to die")
    time.sleep(1.0)  # idle a while after its death (its exit status reaches the worker)
    second = acc_basic.sleepy.enqueue(seconds=0.0)
    done = second.result(timeout=60)
    assert done["attempt"] == 1 and done["pid"] != child
    assert app.get_job(second.id).errors == []


def test_a_program_a_process_pool_handler_starts_stops_on_sigterm(cluster: Cluster) -> None:
    """The worker's children outlive SIGTERM with a handler, not by ignoring it: an
    ignored signal stays ignored across exec, and the program a handler started, told
    to stop with `terminate()`, ran on (the handler's wait hung)."""
    cluster.app()
    cluster.start_worker("--pool", "process", "-c", "1", label="worker")
    handle = acc_basic.terminates_its_subprocess.enqueue()
    assert handle.result(timeout=60) == -signal.SIGTERM


def test_a_forkserver_that_dies_leaves_the_jobs_its_children_run_to_them(
    cluster: Cluster,
) -> None:
    """The children's exit is watched through their sentinel, which for a forkserver
    child is the server's socket: a server killed (the OOM killer) closes it while the
    children run on. The running job completes on its first attempt; it was failed as a
    crash (exit code 255) and run again beside the first run."""
    app = cluster.app()
    worker = cluster.start_worker("--pool", "process", "-c", "1", label="worker")
    handle = acc_basic.sleepy.enqueue(seconds=2.0)
    wait_until(lambda: cluster.effects(handle.id), 60, "the job running in a child")
    servers = [
        pid
        for pid in descendants(worker.pid)
        if b"forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert servers, "no forkserver among the worker's processes"
    os.kill(servers[0], signal.SIGKILL)
    assert handle.result(timeout=60)["attempt"] == 1
    assert app.get_job(handle.id).errors == []


def _effects(cluster: Cluster, job_id: int, kind: str) -> list[tuple[int, int]]:
    """(attempt, pid) of the job's effects of ``kind``, in order."""
    with contextlib.closing(sqlite3.connect(cluster.effects_path, timeout=30)) as conn:
        return conn.execute(
            "SELECT attempt, pid FROM effects WHERE job_id = ? AND kind = ? ORDER BY id",
            (job_id, kind),
        ).fetchall()


def test_a_child_that_closes_its_pipe_and_runs_on_is_killed_before_its_job_runs_again(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A handler closes every inherited descriptor (as daemonising code does), the pipe
    to its worker too, and sleeps on. Its child is killed before the job is retried, so
    no two runs of the job overlap; the failures are not crashes (the child did not die
    on its own), so the job ends dead by its retries, not as poison; and no child runs
    on after the worker. It was taken for dead and left running: the job ran in three
    processes at once, was charged three crashes (poison), and the children outlived
    the worker."""
    app = cluster.app()
    worker = cluster.start_worker("--pool", "process", "-c", "2", label="worker")
    ends = tmp_path / "ends"
    handle = acc_basic.closes_its_descriptors.enqueue(seconds=90.0, ends=str(ends))
    wait_until(lambda: app.get_job(handle.id).state.value == "dead", 120, "the job to end")

    runs = _effects(cluster, handle.id, "run")
    assert [attempt for attempt, _ in runs] == [1, 2, 3]
    assert _effects(cluster, handle.id, "overlap") == [], "two runs of the job at once"
    errors = app.get_job(handle.id).errors
    assert [(e.type, e.kind) for e in errors] == [("WorkerProcessLost", "transient")] * 3
    assert "closed its pipe" in errors[0].message
    for _, pid in runs:
        wait_until(lambda pid=pid: not pid_running(pid), 30, f"the job's child {pid} to end")

    worker.signal(signal.SIGTERM)
    assert worker.wait_exit(60) == 0, worker.stderr()[-4000:]
    assert not ends.exists(), "a run of the job was left to reach its end"


_CLOSES_ITS_SENTINEL = """
import multiprocessing, os, sys, threading, time

from errands.worker.process_child import _leave_with_the_worker


def child(pidfile):
    _leave_with_the_worker(threading.Event())  # as child_main does before any job
    time.sleep(0.3)  # its watch waits on the sentinel by now
    os.closerange(3, 1024)  # a handler daemonising itself: the sentinel goes too
    taken = [os.pipe() for _ in range(8)]  # whatever it opens next takes its number
    with open(pidfile, "w") as out:
        out.write(str(os.getpid()))
    time.sleep(120)


if __name__ == "__main__":
    context = multiprocessing.get_context("forkserver")
    context.Process(target=child, args=(sys.argv[1],), daemon=True).start()
    time.sleep(120)
"""


def test_a_child_whose_handler_closed_its_sentinel_still_leaves_when_its_worker_dies(
    tmp_path: Path,
) -> None:
    """A child watches its worker through a sentinel descriptor, which a handler closing
    every inherited descriptor closes, its number then taken by a pipe it opens: when
    the worker (here a stand-in process) is SIGKILLed, the child still leaves. It
    watched the pipe that took the number, and ran on for ever."""
    script = tmp_path / "closes_its_sentinel.py"
    script.write_text(_CLOSES_ITS_SENTINEL)
    pidfile = tmp_path / "child.pid"
    worker = subprocess.Popen([sys.executable, str(script), str(pidfile)])
    try:
        wait_until(lambda: pidfile.exists() and pidfile.read_text(), 60, "the child's pid")
        child = int(pidfile.read_text())
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)
        try:
            wait_until(lambda: not pid_running(child), 30, f"the child {child} to leave")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
    finally:
        worker.kill()
        worker.wait(10)
