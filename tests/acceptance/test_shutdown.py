"""Graceful shutdown of a real worker process (DESIGN §7, RELIABILITY F4).

SIGTERM: stop claiming, let in-flight jobs finish within ``--grace``, release what is
left (back to available, the attempt not charged), exit 0. A second signal during the
grace period exits at once with a non-zero code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import acc_basic
import pytest

from .harness import Cluster, descendants, pid_running, wait_until

pytestmark = pytest.mark.acceptance


def test_sigterm_lets_the_inflight_job_finish_claims_nothing_new_and_exits_0(
    cluster: Cluster,
) -> None:
    app = cluster.app()
    inflight = acc_basic.sleepy.enqueue(seconds=1.5)
    worker = cluster.start_worker("-c", "1", "--grace", "20", label="worker")
    wait_until(lambda: cluster.effects(inflight.id), 15, "the first job to start")
    # Queued while the only slot is busy: they must still be waiting after the signal.
    waiting = app.enqueue_many([acc_basic.noop.bind(n=i) for i in range(3)])

    worker.signal(signal.SIGTERM)
    assert worker.wait_exit(15) == 0

    job = app.get_job(inflight.id)
    assert job.state.value == "completed"
    assert job.attempt == 1 and not job.errors
    for handle in waiting:
        job = app.get_job(handle.id)
        assert (job.state.value, job.attempt, job.lease_owner) == ("available", 0, None)
    assert [row[0] for row in cluster.effects()] == [inflight.id]  # nothing else ran
    assert "Traceback" not in worker.stderr()


def test_sigterm_with_short_grace_releases_a_long_job_uncharged_and_exits_0_promptly(
    cluster: Cluster,
) -> None:
    app = cluster.app()
    long_job = acc_basic.sleepy.enqueue(seconds=60)  # a blocking call that ignores cancel
    worker = cluster.start_worker("--grace", "1", label="worker")
    wait_until(lambda: cluster.effects(long_job.id), 15, "the long job to start")
    assert cluster.state_of(long_job.id) == "running"

    signalled = time.monotonic()
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit(15) == 0
    took = time.monotonic() - signalled
    assert took < 40, f"exit took {took:.1f} s with --grace 1 (the job would run 60 s)"

    job = app.get_job(long_job.id)
    assert job.state.value == "available"
    assert job.attempt == 0, "a released attempt must not be charged"
    # ...but recorded, so the run that follows is explained (I4)
    assert [(e.kind, e.attempt, e.worker) for e in job.errors] == [
        ("released", 1, worker.worker_id)
    ]
    assert job.lease_owner is None and job.lease_expires_at is None

    # Released, not lost: the next worker runs it from the start (attempt 1 again).
    runner = cluster.start_worker(label="next")
    wait_until(
        lambda: len(cluster.effects(long_job.id)) == 2,
        15,
        "the released job to start on the next worker",
    )
    assert [attempt for _, attempt, _, _ in cluster.effects(long_job.id)] == [1, 1]
    runner.kill()


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_second_signal_during_grace_exits_at_once_with_nonzero_code(
    cluster: Cluster, second: signal.Signals
) -> None:
    app = cluster.app()
    long_job = acc_basic.sleepy.enqueue(seconds=60)
    worker = cluster.start_worker("--grace", "30", label="worker")
    wait_until(lambda: cluster.effects(long_job.id), 15, "the long job to start")

    worker.signal(signal.SIGTERM)
    worker.wait_log(r"SIGTERM", 10)  # handled: a second signal now is a second signal
    assert worker.alive, "the first signal must wait for the in-flight job"

    signalled = time.monotonic()
    worker.signal(second)
    code = worker.wait_exit(5)
    assert code != 0
    assert time.monotonic() - signalled < 3
    # Not released: the lease stays until it expires and the job is rescued.
    job = app.get_job(long_job.id)
    assert job.state.value == "running" and job.attempt == 1


# A worker whose claim loop holds its wake-up event's lock when SIGTERM's Python handler
# runs (the handler runs in the main thread, between two bytecodes, wherever that thread
# is): the event's first clear() after the start sends the signal with the lock held.
SIGNALLED_WHILE_LOCKED = """
import logging, os, signal, sys, threading, time
import errands

logging.basicConfig(level=logging.INFO)

app = errands.App(url=sys.argv[1])


@app.job()
def noop() -> None: ...


worker = app.worker(concurrency=1, poll_interval=0.05)


class SignalledWhileLocked(threading.Event):
    fired = False

    def clear(self):
        with self._cond:
            if not SignalledWhileLocked.fired and worker.started_at:
                SignalledWhileLocked.fired = True
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(20):  # the handler runs in here, the lock held
                    time.sleep(0.01)
                print("signalled with the lock held", file=sys.stderr, flush=True)
            self._flag = False


worker._wake = SignalledWhileLocked()
sys.exit(worker.run())
"""


def test_a_hangup_stops_a_lone_worker_gracefully_once(cluster: Cluster) -> None:
    """A SIGHUP (the terminal a worker runs in closed), even twice, stops a worker that
    runs alone gracefully, as it stops a supervisor's workers: its running job finishes
    and it exits 0. Its default action killed it at once, the job left running until its
    lease ran out, then rescued (a loss counted toward its poison limit)."""
    app = cluster.app()
    inflight = acc_basic.sleepy.enqueue(seconds=1.5)
    worker = cluster.start_worker("-c", "1", "--grace", "30", label="worker")
    wait_until(lambda: cluster.effects(inflight.id), 15, "the job to start")
    worker.signal(signal.SIGHUP)
    worker.signal(signal.SIGHUP)  # a hangup can come twice: no second signal's exit
    assert worker.wait_exit(30) == 0, worker.stderr()[-3000:]
    job = app.get_job(inflight.id)
    assert (job.state.value, job.attempt, job.errors) == ("completed", 1, [])


def test_sigterm_arriving_while_the_claim_loop_holds_a_lock_still_stops_the_worker(
    tmp_path: Path,
) -> None:
    """A signal handler that woke the claim loop itself (``Event.set``) waited for ever
    for the lock its own thread held: the worker never stopped (a CI-sized chaos soak's
    worker did not exit within 60 s of its SIGTERM). The handler only hands the signal to
    a thread of its own, which stops the worker once the lock is free."""
    script = tmp_path / "signalled.py"
    script.write_text(SIGNALLED_WHILE_LOCKED)
    proc = subprocess.Popen(
        [sys.executable, str(script), f"sqlite:///{tmp_path}/store.db"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate()
        pytest.fail(f"the worker did not stop within 60 s of its SIGTERM; it logged:\n{stderr}")
    assert "signalled with the lock held" in stderr
    assert "SIGTERM received" in stderr
    assert proc.returncode == 0, stderr


def test_a_sigterm_to_a_process_a_handler_forked_stops_that_process_not_the_worker(
    cluster: Cluster,
) -> None:
    """A process forked by a handler (``multiprocessing.Pool`` under the fork start
    method) inherits the worker's signal handler, not its signal thread: a SIGTERM sent
    to it (``Pool.__exit__`` terminates its workers) ends it as by default, and the
    worker, which did not receive one, runs on."""
    app = cluster.app("acc_forks")
    worker = cluster.start_worker(app="acc_forks:app", label="worker")
    handle = app.registry["fork_and_terminate"].enqueue()
    assert handle.result(timeout=60) == -signal.SIGTERM
    time.sleep(0.5)  # a stop begun by the child's signal would show by now
    assert worker.alive, worker.stderr()[-3000:]
    assert "received" not in worker.stderr()
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit(15) == 0


START_FAILS = """
import signal, sys
import errands

app = errands.App(url=sys.argv[1])
worker = app.worker(concurrency=1)


def declare():
    raise RuntimeError("declaring failed")


worker._declare = declare
try:
    worker.run()
except RuntimeError as exc:
    print(exc, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, app.backend.worker_list())
"""


def test_a_worker_whose_start_fails_puts_the_signal_handlers_back(tmp_path: Path) -> None:
    """A worker that raises while starting leaves no handler of its own behind (one left
    installed would only ask the dead worker to stop, and the process would run on), and
    no entry in the workers' registry."""
    script = tmp_path / "start_fails.py"
    script.write_text(START_FAILS)
    done = subprocess.run(
        [sys.executable, str(script), f"sqlite:///{tmp_path}/store.db"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.strip() == "declaring failed True []", done.stderr


def test_sigterm_while_the_worker_waits_for_the_store_at_start_exits_0(tmp_path: Path) -> None:
    """A worker (re)started while the store is slow to answer waits in its start-up
    steps; its signal handlers were installed only after them, so a SIGTERM then killed
    it with Python's default (exit -15, seen in the chaos soak's final stop)."""
    script = tmp_path / "slow_start.py"
    script.write_text(
        f"""
import sys, time
import errands
app = errands.App("sqlite:///{tmp_path / "slow.db"}")
app.migrate()
real = app.backend.schema_check
def slow():
    print("starting", flush=True)
    time.sleep(3)  # a store slow to answer
    real()
app.backend.schema_check = slow
sys.exit(app.worker(poll_interval=0.05).run())
"""
    )
    code, err = _sigterm_once_it_says([sys.executable, str(script)], "starting", wait=30)
    assert code == 0, err


def test_sigterm_while_errands_worker_imports_the_app_exits_0(tmp_path: Path) -> None:
    """`errands worker` imports the app before the worker installs its handlers; a
    SIGTERM then (an orchestrator stopping a worker it just started) killed it with
    Python's default (exit -15). It is kept: the worker stops gracefully once started."""
    (tmp_path / "slow_import.py").write_text(
        f"""
import time
import errands
print("importing", flush=True)
time.sleep(3)  # an app slow to import
app = errands.App("sqlite:///{tmp_path / "slow.db"}")
"""
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    command = [sys.executable, "-m", "errands", "worker", "slow_import:app"]
    code, err = _sigterm_once_it_says(command, "importing", wait=60, env=env)
    assert code == 0, err


def test_a_second_sigterm_while_errands_worker_imports_the_app_exits_at_once_with_1(
    tmp_path: Path,
) -> None:
    """As once the worker runs, a second SIGTERM while `errands worker` still imports the
    app exits at once, status 1, saying so. Each was remembered: the import ran on to its
    end (here two minutes), the worker started and stopped gracefully, exit 0."""
    (tmp_path / "slower_import.py").write_text(
        f"""
import time
import errands
print("importing", flush=True)
time.sleep(120)  # an app very slow to import
app = errands.App("sqlite:///{tmp_path / "slow.db"}")
"""
    )
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    command = [sys.executable, "-m", "errands", "worker", "slower_import:app"]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "importing"
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 1, err
    assert "second signal (SIGTERM): exiting now" in err


def test_a_sigterm_to_every_process_of_a_process_pool_worker_lets_its_job_finish(
    cluster: Cluster,
) -> None:
    """systemd's default KillMode=control-group (and `kill -- -PGID`) sends SIGTERM to
    the worker's child processes too. A child is the worker's to stop: the running job
    finishes within the grace and the worker exits 0. The child died at once, and the
    job was recorded as a crash (WorkerProcessDied), charged toward its poison limit."""
    app = cluster.app()
    worker = cluster.start_worker("--pool", "process", "-c", "1", "--grace", "30")
    handle = acc_basic.sleepy.enqueue(seconds=2.0)
    wait_until(lambda: cluster.effects(handle.id), 60, "the job running in a child")
    family = [worker.pid, *descendants(worker.pid)]
    assert len(family) > 1, "no child process"
    for pid in family:
        os.kill(pid, signal.SIGTERM)
    assert worker.wait_exit(60) == 0
    job = app.get_job(handle.id)
    assert (job.state.value, job.attempt, job.errors) == ("completed", 1, [])


def _sigterm_once_it_says(
    command: list[str], line: str, *, wait: float, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """Start ``command``, SIGTERM it once its first line of output is ``line``; its exit
    code and stderr (killed after ``wait`` seconds)."""
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == line
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=wait)
        finally:
            proc.kill()
    return proc.returncode, err


@pytest.mark.parametrize("pool", ["thread", "process"])
def test_a_fork_that_returns_from_its_handler_exits_and_leaves_the_worker_alone(
    cluster: Cluster, tmp_path: Path, pool: str
) -> None:
    """A handler forks and its child returns from the handler too (no os._exit): that copy
    of the worker exits at once, saying so, and the worker runs on, its job completed
    once, and exits alone. The copy (the handler's thread alone) waited for a next job for
    ever, and outlived the worker; in a process-pool child it answered on the child's
    pipe, and the child was taken for dead."""
    app = cluster.app("acc_forks")
    worker = cluster.start_worker("--pool", pool, "-c", "1", app="acc_forks:app")
    pidfile = tmp_path / "fork.pid"
    handle = app.registry["forks_and_returns"].enqueue(pidfile=str(pidfile))
    ran_in = handle.result(timeout=60)
    wait_until(lambda: pidfile.exists() and pidfile.read_text(), 30, "the fork's pid")
    fork = int(pidfile.read_text())
    assert fork != ran_in
    wait_until(lambda: not pid_running(fork), 30, f"the fork {fork} to exit")
    assert "the fork returned from the handler" in worker.stderr()
    second = app.registry["forks_and_returns"].enqueue(pidfile=str(tmp_path / "second.pid"))
    assert second.result(timeout=60) == ran_in  # the same child (process pool) or worker
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit(30) == 0
    assert "died while idle" not in worker.stderr()
