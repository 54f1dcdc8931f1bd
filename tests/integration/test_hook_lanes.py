"""The hook lanes' threads end: at ``App.close()`` and at the stop of the App's last worker.

The on_dead hooks and event subscribers a worker reaches run on lanes (errands.hooks), each
a thread of its own, timed by a watchdog thread. Nothing ever ended them: a process that
made an App, ran a worker, stopped it and closed the App kept three threads per cycle for
good (an embedded worker per test, a test suite's Apps), and a thread stuck in a hook was
replaced and never accounted for. Now a close lets the calls queued before it run within
its bound, then the threads leave; a call still queued at the bound is dropped, one still
running is abandoned (logged by name, its thread left as a daemon), and the next call
starts the lane again. One backend suffices: the lanes are the same on both.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import errands
from errands import hooks
from errands.hooks import HookRunner, protect_current_thread
from errands.retry import as_backoff, retry_delay
from tests.conftest import running_worker
from tests.integration.helpers import wait_until

HOOK_THREADS = ("errands-dead-", "errands-events-", "errands-hooks-watchdog")


def hook_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(HOOK_THREADS)}


@pytest.fixture
def released() -> Iterator[threading.Event]:
    """Set at the end of the test: what a hanging hook waits for, so its thread ends."""
    gate = threading.Event()
    yield gate
    gate.set()


def dying_app(url: str, **options: Any) -> tuple[errands.App, list[int], list[str]]:
    """An App whose job ``lanes.dies`` dies at once, with an on_dead hook and an event
    subscriber that record what reached them."""
    app = errands.App(url, **options)
    deaths: list[int] = []
    events: list[str] = []

    @app.job(name="lanes.dies", retries=0)
    def dies() -> None:
        raise ValueError("dies")

    @app.on_dead
    def record_death(job: errands.Job) -> None:
        deaths.append(job.id)

    @app.events.subscribe
    def record_event(event: Any) -> None:
        events.append(event.name)

    return app, deaths, events


def run_one_death(app: errands.App, deaths: list[int]) -> None:
    """A worker of ``app`` runs one job to its death, its on_dead hook runs, the worker
    stops."""
    handle = app.registry["lanes.dies"].enqueue()
    with running_worker(app, concurrency=1):
        wait_until(lambda: handle.id in deaths, timeout=30, what="the on_dead hook")


def test_starting_and_stopping_workers_of_apps_leaves_no_hook_thread(tmp_path: Path) -> None:
    """Given five cycles of a new App whose worker runs a job to its death (an on_dead
    hook, an event subscriber), then stops, then the App closes: no hook lane thread and
    no watchdog is left after any cycle. Each cycle left three, for good."""
    before = hook_threads()
    for n in range(5):
        app, deaths, events = dying_app(f"sqlite:///{tmp_path / f'store{n}.db'}")
        run_one_death(app, deaths)
        app.close()
        assert "errands.job.dead" in events  # the subscriber ran on the events lane
        wait_until(
            lambda: not hook_threads() - before,
            timeout=10,
            what=f"no hook thread left after cycle {n}",
        )


def test_the_last_worker_stopping_ends_the_hook_threads_and_the_next_use_starts_them(
    tmp_path: Path,
) -> None:
    """Given one App never closed, whose worker is started and stopped three times, each
    running a job to its death: after each stop no hook thread is left (the worker was
    the App's last), and each later death's hooks and events still run (the lanes start
    again). The App kept its lanes' threads for as long as the process lived."""
    app, deaths, events = dying_app(f"sqlite:///{tmp_path / 'store.db'}")
    before = hook_threads()
    try:
        for n in range(3):
            run_one_death(app, deaths)
            assert len(deaths) == n + 1
            assert events.count("errands.job.dead") == n + 1
            wait_until(
                lambda: not hook_threads() - before,
                timeout=10,
                what=f"no hook thread left after stop {n}",
            )
    finally:
        app.close()


def test_closing_an_app_ends_the_lanes_its_own_threads_started(tmp_path: Path) -> None:
    """Given an App with no worker whose events went to the events lane (a dashboard
    action: the thread is marked errands' own), App.close() ends the lane's thread and
    the watchdog, and a later action's event is delivered (the lane starts again)."""
    app = errands.App(f"sqlite:///{tmp_path / 'store.db'}")
    seen: list[str] = []
    app.events.subscribe(lambda event: seen.append(event.name))

    @app.job(name="lanes.waits")
    def waits() -> None: ...

    before = hook_threads()
    try:
        for n in range(2):
            handle = waits.enqueue()
            protect_current_thread(True)  # as the dashboard runs an operator's action
            try:
                app.cancel(handle.id)
            finally:
                protect_current_thread(False)
            wait_until(
                lambda n=n: seen.count("errands.job.cancel_requested") == n + 1,
                timeout=10,
                what="the cancel's event, on the events lane",
            )
            assert hook_threads() - before  # the lane's thread and the watchdog
            app.close()
            wait_until(
                lambda: not hook_threads() - before,
                timeout=10,
                what=f"no hook thread left after close {n}",
            )
    finally:
        app.close()


def backoff_threads() -> set[threading.Thread]:
    """The process's backoff lane's threads (errands.hooks.shared_runner) and its
    watchdog (named as an App's: told apart by the runner's own record, as an App an
    earlier test of this process left open keeps its watchdog)."""
    threads = {t for t in threading.enumerate() if t.name.startswith("errands-backoff-")}
    watchdog = hooks.shared_runner()._watchdog
    if watchdog is not None and watchdog[0].is_alive():
        threads.add(watchdog[0])
    return threads


def test_the_backoff_lane_ends_with_the_last_worker_and_at_close_and_starts_again(
    tmp_path: Path,
) -> None:
    """Given a job type whose backoff is a callable (user code: run on the process's
    backoff lane, with a time limit), each failed attempt calls it there. After the App's
    last worker stops, and again after App.close() (the App used again in between),
    no thread of that lane and no watchdog is left: the thread count is back to where it
    was before. Nothing ever closed that lane: its thread and its watchdog stayed for
    the process's life. Each later use starts it again (its delay is the callable's)."""
    app = errands.App(f"sqlite:///{tmp_path / 'store.db'}")
    asked: list[int] = []

    def backoff(attempt: int) -> float:
        asked.append(attempt)
        return 0.01

    @app.job(name="lanes.retried", retries=1, backoff=backoff)
    def retried(ctx: errands.Context) -> int:
        if ctx.attempt == 1:
            raise ValueError("first attempt fails")
        return ctx.attempt

    hooks.shared_runner().close(5.0)  # (a lane an earlier test of this process started)
    # (a thread an earlier test of this process left inside a call of the lane, given up
    # when it was closed, may still run: it is not this App's)
    time.sleep(0.2)
    left = backoff_threads()

    def ours() -> set[threading.Thread]:
        return backoff_threads() - left

    baseline = set(threading.enumerate())
    try:
        for n in range(2):
            handle = retried.enqueue()
            with running_worker(app, concurrency=1, maintenance=False):
                assert handle.result(timeout=30) == 2
                assert {t.name for t in ours()} >= {"errands-hooks-watchdog"}
                assert any(t.name.startswith("errands-backoff-") for t in ours())
            assert asked == [1] * (n + 1)  # the callable's delay, on the lane (each start)
            wait_until(
                lambda: not ours(),
                timeout=10,
                what=f"no backoff thread after the worker's stop {n}",
            )
        retry_delay(as_backoff(backoff), 3, job="lanes.retried")
        assert asked[-1] == 3 and ours()  # used without a worker: started
        app.close()
        wait_until(lambda: not ours(), timeout=10, what="no backoff thread after close")
        wait_until(
            lambda: not set(threading.enumerate()) - baseline,
            timeout=10,
            what="the thread count back to its baseline",
        )
    finally:
        app.close()


@pytest.mark.skipif(sys.platform == "win32", reason="no os.fork on Windows")
def test_a_child_forked_while_a_lane_is_busy_runs_its_hooks_on_lanes_of_its_own(
    tmp_path: Path,
) -> None:
    """The parent forks while its App's events lane (and the process's backoff lane) runs
    a hook blocked on an event, and while another thread holds the lanes' and the
    runner's locks (as a lane's thread or the watchdog does, for a moment, at every
    call). The child copied those locks held, by threads it does not have, and the
    busy lanes' crews, whose threads it does not have either: its first hook call hung
    for good. In the child the lanes start afresh (new locks, a new thread at the first
    call, the watchdog again): its hooks run, on the busy lanes and on a new one. The
    parent's lanes go on. Real os.fork, in a process of its own (the test process forks
    nothing); a child still hung after 60 s is ended by its alarm."""
    script = """
        import os, signal, sys, threading
        import errands
        from errands import hooks

        app = errands.App("sqlite:///" + sys.argv[1])
        events, backoff = app.hooks.lane("events"), hooks.shared_runner().lane("backoff")
        gate, busy = threading.Event(), threading.Semaphore(0)

        def blocked(n: int) -> str:  # a hook running at the fork
            busy.release()
            gate.wait(60)
            return f"parent hook {n}"

        busy_events, busy_backoff = events.submit(blocked, 1), backoff.submit(blocked, 2)
        assert busy.acquire(timeout=30) and busy.acquire(timeout=30)
        held, forked = threading.Event(), threading.Event()
        locks = [events._lock, backoff._lock, app.hooks._lock, hooks.shared_runner()._lock]

        def hold() -> None:  # the lanes' and runners' locks held across the fork
            for lock in locks:
                lock.acquire()
            held.set()
            forked.wait(60)
            for lock in locks:
                lock.release()

        holder = threading.Thread(target=hold)
        holder.start()
        assert held.wait(30)
        pid = os.fork()
        if pid == 0:
            signal.alarm(60)  # hung: killed by SIGALRM, the test fails
            try:
                for lane in (events, app.hooks.lane("dead"), backoff):
                    print("child", lane.call(lambda n: n, lane.name, timeout=20), flush=True)
                print("child closed", app.hooks.close(5) and hooks.close_shared(5), flush=True)
            except BaseException as exc:
                print("child:", type(exc).__name__, exc, flush=True)
                os._exit(1)
            os._exit(0)
        forked.set()
        holder.join(30)
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status), flush=True)
        gate.set()
        print(busy_events.result(30), "/", busy_backoff.result(30), flush=True)
        print("parent", events.call(lambda: "events", timeout=20), flush=True)
        app.close()
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
    lines = done.stdout.splitlines()
    assert lines == [
        "child events",
        "child dead",
        "child backoff",
        "child closed True",
        "child exit 0",
        "parent hook 1 / parent hook 2",
        "parent events",
    ], (done.stdout, done.stderr[-3000:])


def test_calls_queued_before_a_close_still_run_in_order() -> None:
    """Given a lane with one slow call running and three queued behind it, a close with
    room enough lets all four run, in order, before the lane's thread leaves."""
    before = hook_threads()
    runner = HookRunner(hook_timeout=30)
    lane = runner.lane("events")
    ran: list[object] = []
    gate = threading.Event()

    def slow() -> None:
        gate.wait(30)
        ran.append(0)

    futures = [lane.submit(slow)] + [lane.submit(ran.append, n) for n in (1, 2, 3)]
    assert all(f is not None for f in futures)
    threads = hook_threads() - before  # the lane's thread and the watchdog
    assert threads
    closing = threading.Thread(target=lambda: ran.append(runner.close(60)))
    closing.start()
    wait_until(lambda: lane._crew is None, timeout=10, what="the close to begin")
    gate.set()  # the slow call ends within the close's bound
    closing.join(60)
    assert not closing.is_alive()
    assert ran == [0, 1, 2, 3, True]  # every queued call ran, then close() said so
    wait_until(lambda: not any(t.is_alive() for t in threads), timeout=10, what="the threads gone")


def test_a_hook_hanging_at_a_close_is_abandoned_not_waited_for_and_what_is_behind_it_dropped(
    caplog: pytest.LogCaptureFixture, released: threading.Event
) -> None:
    """Given a lane whose call hangs where no interrupt reaches it (well within its
    limit) with two calls queued behind it, a close with a short bound returns with the
    hang still on: the hanging call is logged once by name as abandoned, its thread left
    alive (a daemon); the calls behind it are dropped (their futures raise LaneClosed,
    logged). The thread ends by itself once the hang does, serving nothing more, and the
    lane's next call runs on a new thread."""
    before = hook_threads()
    runner = HookRunner(hook_timeout=60)
    lane = runner.lane("dead")
    started = threading.Event()
    ran: list[str] = []

    def pager_that_hangs() -> None:
        started.set()
        released.wait()  # blocked in C: no interrupt lands before it returns
        ran.append("hung one")

    first = lane.submit(pager_that_hangs)
    behind = [lane.submit(ran.append, "behind") for _ in range(2)]
    assert first is not None and all(f is not None for f in behind)
    assert started.wait(10)
    [hanging] = [t for t in hook_threads() - before if t.name.startswith("errands-dead-")]
    with caplog.at_level(logging.WARNING, logger="errands.hooks"):
        assert runner.close(0.2) is False  # returns, the hook still hanging
    assert hanging.is_alive() and hanging.daemon
    abandoned = [r for r in caplog.records if "abandoned" in r.getMessage()]
    assert len(abandoned) == 1
    assert "pager_that_hangs" in abandoned[0].getMessage()
    assert any("dropped" in r.getMessage() for r in caplog.records)
    for future in behind:
        assert future is not None
        assert isinstance(future.exception(timeout=10), hooks.LaneClosed)
    assert lane.call(lambda: "served", timeout=30) == "served"  # started again
    released.set()
    hanging.join(30)
    assert not hanging.is_alive()  # it ended once back, serving nothing behind it
    assert ran == ["hung one"]
    assert runner.close(10) is True
    wait_until(lambda: not hook_threads() - before, timeout=10, what="no hook thread left")


def test_a_worker_stop_is_not_held_by_a_hook_stuck_past_its_limit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, released: threading.Event
) -> None:
    """Given hook_timeout=0.5 and an on_dead hook stuck where its interrupt cannot land
    (it is replaced at its limit), the worker's stop and App.close() return while the
    hook is still stuck: the stuck thread is accounted for (logged as abandoned, by the
    hook's name) and no other hook thread is left. The stuck thread was never reported
    and its lane's threads never ended."""
    app = errands.App(f"sqlite:///{tmp_path / 'store.db'}", hook_timeout=0.5)
    stuck = threading.Event()

    @app.job(name="lanes.dies", retries=0)
    def dies() -> None:
        raise ValueError("dies")

    @app.on_dead
    def pager_stuck_in_c(job: errands.Job) -> None:
        stuck.set()
        released.wait()

    before = hook_threads()
    handle = dies.enqueue()
    with caplog.at_level(logging.WARNING, logger="errands.hooks"):
        stopping = threading.Thread(target=_run_until_stuck, args=(app, stuck))
        stopping.start()
        stopping.join(120)  # (a close that waited for the hook would never return)
        assert not stopping.is_alive(), "the stop and close waited for the stuck hook"
    assert handle.status() is errands.JobState.DEAD
    assert not released.is_set()  # the hook is still stuck: nothing waited for it
    abandoned = [r.getMessage() for r in caplog.records if "abandoned" in r.getMessage()]
    assert len(abandoned) == 1
    assert "pager_stuck_in_c" in abandoned[0]
    wait_until(  # the stuck one alone, a daemon
        lambda: len(hook_threads() - before) == 1, timeout=10, what="one hook thread left"
    )
    left = hook_threads() - before
    assert all(t.daemon and t.name.startswith("errands-dead-") for t in left)
    released.set()
    wait_until(lambda: not hook_threads() - before, timeout=30, what="the stuck thread ends")
    app.close()  # (the hook's thread marked the death done once back: the store opened)


def _run_until_stuck(app: errands.App, stuck: threading.Event) -> None:
    with running_worker(app, concurrency=1):
        assert stuck.wait(30)
    app.close()


def test_on_dead_hooks_dropped_at_a_close_can_be_queued_again(
    tmp_path: Path, released: threading.Event
) -> None:
    """Given a death's on_dead hooks queued behind a hook that hangs when the App's lanes
    close, the dropped death is no longer counted as queued: queued again (as the leader
    does after dead_hooks_grace) on the App used after the close, its hooks run. Counted
    as queued for good, they were skipped as a duplicate ever after in that App."""
    app, deaths, _events = dying_app(f"sqlite:///{tmp_path / 'store.db'}")
    handles = [app.registry["lanes.dies"].enqueue() for _ in range(2)]
    hooks = list(app.dead_hooks)
    app.dead_hooks.clear()  # none while the worker runs: the deaths' records stay
    with running_worker(app, concurrency=1):
        wait_until(
            lambda: all(h.status() is errands.JobState.DEAD for h in handles),
            timeout=30,
            what="two deaths",
        )
    hanging = threading.Event()

    def hangs(job: errands.Job) -> None:
        if job.id == handles[0].id:
            hanging.set()
            released.wait()

    app.dead_hooks.extend([hangs, *hooks])
    first, second = (h.id for h in handles)
    app.dead_hooks_later(first)
    assert hanging.wait(10)
    app.dead_hooks_later(second)  # queued behind the hanging one
    assert app.hooks.close(0.2) is False  # the first abandoned, the second dropped
    assert second not in app._dead_hooks_queued
    app.dead_hooks_later(second)
    wait_until(lambda: second in deaths, timeout=10, what="the second death's hooks")
    released.set()  # the abandoned thread goes on with the first death's hooks
    wait_until(
        lambda: first in deaths and first not in app._dead_hooks_queued,
        timeout=10,
        what="the first death's hooks run and marked done",
    )
    app.close()
