"""``App.close()``: what the App started stops, and nothing opens the store behind it.

An embedded worker still running when its App was closed went on: its threads (the
completer, the lease keeper, the maintenance leader) reached ``app.backend``, which
opened the store again (a migration, connections; on PostgreSQL a new pool) that nothing
closed. A result waiter asleep until its recheck learnt of the close 30 s later, and a
fair weight callable stopped answering for good on an App used after close().
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import errands
from errands.backends.fair import CallableWeights
from tests.guarantees.helpers import wait_until


def test_closing_an_app_stops_its_running_worker_and_the_store_stays_closed(
    tmp_path: Path,
) -> None:
    app = errands.App(f"sqlite:///{tmp_path / 'store.db'}")

    @app.job(name="close.slow")
    def slow(seconds: float) -> None:
        time.sleep(seconds)

    handles = [slow.enqueue(seconds=0.3) for _ in range(4)]
    worker = app.worker(concurrency=2, grace=5.0)
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    thread.start()
    wait_until(
        lambda: any(h.status() is errands.JobState.RUNNING for h in handles),
        timeout=30,
        what="a start",
    )
    app.close()
    assert worker.ended.is_set()  # stopped and waited for, within its grace period
    thread.join(5)
    assert not thread.is_alive()
    time.sleep(0.3)  # nothing of the worker's is left to open the store again
    assert app._backend is None
    statuses = {h.status() for h in handles}  # (opens it again: the App may be used)
    assert errands.JobState.RUNNING not in statuses  # finished or given back, none held
    app.close()


@pytest.mark.skipif(sys.platform == "win32", reason="no os.fork on Windows")
def test_a_forked_child_closes_its_app_at_once_and_leaves_the_parents_running_worker_be(
    tmp_path: Path,
) -> None:
    """An embedded worker (grace 30 s) runs in the parent, which forks; the child closes
    the App. The worker's threads are not in the child, yet the App still listed it:
    the child's close() stopped it and waited its grace period and 10 s more, for a
    thread that never ends there (40 s). The child forgets the parent's workers: its
    close() is prompt, stops, deregisters and resigns nothing, and the parent's worker
    goes on (registered, working). Real os.fork, in a process of its own (the test
    process forks nothing); a child still hung after 90 s is ended by its alarm."""
    script = """
        import os, signal, sys, threading, time
        import errands

        app = errands.App("sqlite:///" + sys.argv[1])

        @app.job(name="forked.work")
        def work(n: int) -> int:
            return n

        worker = app.worker(concurrency=1, grace=30.0, poll_interval=0.05)
        thread = threading.Thread(
            target=worker.run, kwargs={"install_signals": False}, daemon=True
        )
        thread.start()
        assert work.enqueue(n=1).result(timeout=30) == 1  # it works
        pid = os.fork()
        if pid == 0:
            signal.alarm(90)  # hung: killed by SIGALRM, the test fails
            started = time.monotonic()
            try:
                app.close()
            except BaseException as exc:
                print("child:", type(exc).__name__, exc, flush=True)
                os._exit(1)
            print(f"child closed in {time.monotonic() - started:.3f} s", flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status), flush=True)
        print("parent worker ran", work.enqueue(n=2).result(timeout=30), flush=True)
        print("registered", [w.id for w in app.backend.worker_list()] == [worker.id])
        print("running", thread.is_alive() and not worker.ended.is_set(), flush=True)
        app.close()
        print("parent closed", worker.ended.is_set(), flush=True)
        """
    store = str(tmp_path / "store.db")
    done = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(script), store],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "child exit 0" in done.stdout, (done.stdout, done.stderr[-3000:])
    [line] = [x for x in done.stdout.splitlines() if x.startswith("child closed in")]
    assert float(line.split()[3]) < 5.0, line  # a generous bound: it waited 40 s
    for said in ("parent worker ran 2", "registered True", "running True", "parent closed True"):
        assert said in done.stdout, (done.stdout, done.stderr[-3000:])


def test_closing_an_app_wakes_its_result_waiters_at_once(tmp_path: Path) -> None:
    app = errands.App(f"sqlite:///{tmp_path / 'store.db'}")

    @app.job(name="close.wait")
    def waited() -> None: ...

    handle = waited.enqueue()
    outcome: list[object] = []

    def wait() -> None:
        try:
            outcome.append(handle.result(timeout=60))
        except Exception as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.5)  # asleep until the watcher's word or its 30 s recheck
    # the job ends behind the App's back (another process), and the App closes
    worker_app = errands.App(app.url)
    worker_app.job(name="close.wait")(lambda: None)
    worker = worker_app.worker(concurrency=1)
    runner = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    runner.start()
    started = time.monotonic()
    app.close()
    waiter.join(20)
    worker.stop()
    runner.join(30)
    worker_app.close()
    assert outcome == [None]
    assert time.monotonic() - started < 20  # not the 30 s recheck


def test_a_fair_weight_callable_answers_again_after_close() -> None:
    weights = CallableWeights(lambda key: 5.0)
    assert weights(["a"], budget=5.0) == {"a": 5.0}
    weights.close()
    assert weights(["b"], budget=5.0) == {"b": 5.0}  # it waited 5 s and answered nothing
    weights.close()
