"""A hook's time limit never lands inside errands' own store call (errands.interrupts): a
SQLite hook interrupted while it held the write lock left it held for good (a soak hung)."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from errands.hooks import HookTimeout, Lane
from errands.interrupts import aim, in_locking_code, shielded
from errands.worker.runners import HandlerInterrupt
from tests.integration.helpers import run_script


def test_a_hook_past_its_limit_is_interrupted_only_once_out_of_a_shielded_store_call() -> None:
    """Given a hook that overruns its limit inside a shielded region, when the watchdog
    looks, then it waits; once the region ends the hook is interrupted (after it)."""
    lane = Lane("test", time_limit=0.05)
    inside_done = threading.Event()
    seen: list[str] = []

    def hook() -> None:
        with shielded():
            time.sleep(0.3)  # errands' own store call, past the limit
            inside_done.set()
        try:
            for _ in range(500):  # user code after it: interrupted here
                time.sleep(0.01)
        except HookTimeout:
            seen.append("interrupted after the shield")
            raise

    future = lane.submit(hook)
    assert future is not None
    deadline = time.monotonic() + 10
    while not future.done() and time.monotonic() < deadline:
        if not inside_done.is_set():
            lane.watch(time.monotonic())
            assert lane.timed_out == 0  # never while inside the shield
        else:
            lane.watch(time.monotonic())
        time.sleep(0.01)
    assert inside_done.is_set()
    assert seen == ["interrupted after the shield"]
    assert lane.timed_out == 1


def test_a_hook_interrupted_as_its_thread_closes_the_call_leaves_the_lanes_books_clean() -> None:
    """Given a hook that returned past its limit while the watchdog held the lane's lock,
    when the watchdog's interrupt lands as the hook's thread takes that lock to close the
    call, then the thread leaves with the lane's books clean (not counted as stuck) and
    the lane serves the next call. The thread left with its id counted as stuck for good:
    after four, no hook of the lane was ever stopped again."""
    lane = Lane("test", time_limit=0.05)
    started, gate = threading.Event(), threading.Event()
    idents: list[int] = []

    def hook() -> None:
        idents.append(threading.get_ident())
        started.set()
        gate.wait(5)  # past its limit

    assert lane.submit(hook) is not None
    assert started.wait(5)
    [ident] = idents
    with lane._lock:  # the watchdog, in the middle of a look at the lane
        gate.set()
        deadline = time.monotonic() + 5
        while (frame := sys._current_frames().get(ident)) is not None and (
            frame.f_code.co_name != "_call_ended"
        ):  # until the thread waits for the lock to close the call
            assert time.monotonic() < deadline, "the lane's thread never came to close the call"
            time.sleep(0.005)
        # what the watchdog does for a call past its limit (Lane.watch), under this lock
        aim(ident, HookTimeout)
        lane._retired.add(ident)
    lane._spawn()  # its replacement (Lane.watch starts it after the lock)
    deadline = time.monotonic() + 5
    while ident in lane._retired or ident in lane._current:
        assert time.monotonic() < deadline, f"left in the books: {lane._retired, lane._current}"
        time.sleep(0.01)
    assert lane.call(lambda: "served", timeout=5) == "served"


class _Held(logging.Handler):
    """A logging handler whose lock the test holds, as another thread writing would."""

    def emit(self, record: logging.LogRecord) -> None:
        pass


def test_a_hook_past_its_limit_taking_a_lock_is_replaced_at_once_and_stopped_after() -> None:
    """Given a hook past its limit blocked taking a logging handler's lock (another thread
    writes), the lane replaces its thread at once (the lane goes on) but interrupts it
    only once the lock is taken and the hook is back in its own code. Landing as the
    blocked acquire returned, the interrupt left the handler's lock held for good."""
    lane = Lane("test", time_limit=0.05)
    held = _Held()
    logger = logging.getLogger(f"errands.tests.lane.{id(held)}")
    logger.addHandler(held)
    logger.propagate = False
    seen: list[str] = []

    def hook() -> None:
        logger.warning("blocked until the test lets go of the handler's lock")
        try:
            for _ in range(500):  # its own code: interrupted here
                time.sleep(0.01)
        except HookTimeout:
            seen.append("interrupted in its own code")
            raise

    held.acquire()
    try:
        future = lane.submit(hook)
        assert future is not None
        deadline = time.monotonic() + 5
        while lane.timed_out == 0:
            assert time.monotonic() < deadline, "the stuck hook was never replaced"
            lane.watch(time.monotonic())
            time.sleep(0.01)
        assert lane.call(lambda: "served", timeout=5) == "served"  # the replacement serves
        for _ in range(20):  # looks while it is still blocked: nothing is aimed at it
            lane.watch(time.monotonic())
            time.sleep(0.01)
    finally:
        held.release()
    deadline = time.monotonic() + 5
    while not future.done():
        assert time.monotonic() < deadline, "the hook was never interrupted once out"
        lane.watch(time.monotonic())
        time.sleep(0.01)
    logger.removeHandler(held)
    assert seen == ["interrupted in its own code"]
    assert held.lock is not None and held.lock.acquire(timeout=1)  # free
    held.lock.release()


def test_a_thread_blocked_on_loggings_module_lock_is_in_locking_code_on_every_python() -> None:
    """logging takes its module lock in ``_acquireLock()`` up to Python 3.12, and from 3.13
    in a ``with _lock:`` of the function itself (no Python frame of the lock's): a thread
    blocked there is held back on both (on 3.13 it was read as in getLogger's own code,
    and interrupted inside logging). One blocked entering a ``with`` of its own code is
    not: a lock of the caller's is the caller's to give back."""
    own = threading.Lock()
    blocked: list[bool] = []

    def in_logging() -> None:
        logging.getLogger(f"errands.tests.module_lock.{id(own)}")

    def in_own_code() -> None:
        with own:
            pass

    own.acquire()
    logging._lock.acquire()  # type: ignore[attr-defined]
    try:
        threads = [threading.Thread(target=fn, daemon=True) for fn in (in_logging, in_own_code)]
        for thread in threads:
            thread.start()
        time.sleep(0.2)  # both blocked taking their lock
        blocked = [in_locking_code(thread.ident or 0) for thread in threads]
    finally:
        logging._lock.release()  # type: ignore[attr-defined]
        own.release()
    for thread in threads:
        thread.join(5)
    assert blocked == [True, False]


class _RaisingOnce:
    """A stand-in for the shields' module lock whose first release raises, as an interrupt
    pending when a shield begins lands as the lock around its bookkeeping is let go."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.raised = False

    def __enter__(self) -> None:
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()
        if not self.raised:
            self.raised = True
            raise HandlerInterrupt()


def test_an_interrupt_landing_as_a_shield_begins_leaves_the_thread_unshielded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Given an interrupt that lands just after a shield counted itself in, before the
    block that uncounts it began, then the thread is not left shielded: it was for good,
    and every later interrupt of its jobs (and of a thread given its ident) was held back
    for ever (a handler never stopped; seen as a process-pool job running on past its
    interrupt, 1 run in 30 under load)."""
    from errands import interrupts

    monkeypatch.setattr(interrupts, "_lock", _RaisingOnce())
    with pytest.raises(HandlerInterrupt), interrupts.shielded():
        pass  # never reached
    assert not interrupts.is_shielded(threading.get_ident())


def test_a_dead_threads_shield_does_not_shield_the_thread_given_its_ident() -> None:
    """Given a thread that ended inside a shield (its generator never closed), then its
    ident, which a later thread may get, is not shielded."""
    from errands import interrupts

    idents: list[int] = []
    shields: list[Any] = []

    def leaves_a_shield_open() -> None:
        shield = interrupts.shielded()
        shield.__enter__()
        shields.append(shield)  # kept: never exited
        idents.append(threading.get_ident())

    thread = threading.Thread(target=leaves_a_shield_open)
    thread.start()
    thread.join(10)
    assert idents and not interrupts.is_shielded(idents[0])


@pytest.mark.skipif(sys.platform == "win32", reason="no os.fork on Windows")
def test_a_child_forked_while_the_shield_lock_is_held_opens_its_store_and_keeps_its_own_shield(
    tmp_path: Path,
) -> None:
    """The parent forks from inside a shield, while another thread is inside one and a
    third holds the shields' lock (as the hook watchdog does while it looks at a hook past
    its limit). The child had the lock copied held, by a thread it does not have: its
    first shielded call (App.backend's opening of the store, every store transaction)
    hung for good. In the child the lock is new and the shields are the forking
    thread's alone: it is still inside its own (and leaves it), the other thread's is
    gone, and the store opens and takes jobs. Real os.fork, in a process of its own; a
    child still hung after 60 s is ended by its alarm."""
    script = """
        import os, signal, sys, threading
        import errands
        from errands import interrupts

        app = errands.App("sqlite:///" + sys.argv[1])

        @app.job(name="forked.job")
        def job() -> None: ...

        inside, held, forked = threading.Event(), threading.Event(), threading.Event()

        def shielded_thread() -> None:  # inside a shield at the fork
            with errands.shielded():
                inside.set()
                forked.wait(60)

        def watchdog() -> None:  # the shields' lock held across the fork
            with interrupts._lock:
                held.set()
                forked.wait(60)

        threading.Thread(target=shielded_thread, daemon=True).start()
        assert inside.wait(30)
        me = threading.get_ident()
        with errands.shielded():
            threading.Thread(target=watchdog, daemon=True).start()
            assert held.wait(30)
            pid = os.fork()
            if pid != 0:
                forked.set()  # (the parent's shield ends: it takes the lock)
            else:
                signal.alarm(60)  # hung: killed by SIGALRM, the test fails
                try:
                    print("child shielded", interrupts.is_shielded(me), flush=True)
                    print("child shields", list(interrupts._shields) == [me], flush=True)
                except BaseException as exc:
                    print("child:", type(exc).__name__, exc, flush=True)
                    os._exit(1)
        if pid == 0:
            try:
                print("child left", not interrupts.is_shielded(me), flush=True)
                print("child enqueued", job.enqueue().id > 0, flush=True)
                app.close()
                print("child left shields", interrupts._shields == {}, flush=True)
            except BaseException as exc:
                print("child:", type(exc).__name__, exc, flush=True)
                os._exit(1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status), flush=True)
        print("parent enqueued", job.enqueue().id > 0, flush=True)
        app.close()
        """
    done = run_script(script, str(tmp_path / "store.db"))
    assert done.returncode == 0, (done.stdout, done.stderr[-3000:])
    for said in (
        "child shielded True",
        "child shields True",
        "child left True",
        "child enqueued True",
        "child left shields True",
        "child exit 0",
        "parent enqueued True",
    ):
        assert said in done.stdout, (done.stdout, done.stderr[-3000:])


def test_reading_a_threads_frame_while_a_thread_local_is_collected_never_hangs() -> None:
    """in_locking_code reads the thread's frame through sys._current_frames(), which on
    Python 3.11 holds the runtime's lock of thread states while it makes frame objects:
    a garbage collection one of them starts, freeing a cycle that holds a
    threading.local, took that lock again, and the whole process stood still for good (a
    CI run hung so: CPython gh-106883, fixed in 3.12). Collection is paused around the
    read there. Here, collections are made frequent and the read is repeated for 1.5 s
    beside threads making new frames: it hung within the 1.5 s in each of 5 runs of the
    old code; it must finish."""
    script = """
        import gc, sys, threading, time
        from errands import interrupts
        gc.set_threshold(3, 10, 10)
        stop = False
        def churn():
            def f(n):
                return n if n < 1 else f(n - 1)
            while not stop:
                f(3)
        others = [threading.Thread(target=churn, daemon=True) for _ in range(3)]
        for t in others:
            t.start()
        started, reads = time.monotonic(), 0
        while time.monotonic() - started < 1.5:
            garbage = []
            garbage.append(garbage)
            garbage.append(threading.local())
            del garbage
            interrupts.in_locking_code(others[0].ident)
            reads += 1
        stop = True
        print("read", reads, "collection", "on" if gc.isenabled() else "off")
    """
    try:
        done = run_script(script, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the process stood still reading a thread's frame (CPython gh-106883)")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("read ") and done.stdout.rstrip().endswith("collection on")


def test_a_child_forked_while_collection_is_paused_for_a_frame_read_collects_again() -> None:
    """On Python 3.11 a frame read pauses garbage collection (above); a child forked by
    another thread in that instant is a copy with the pause and without the thread that
    resumes it: the fork hook resumes it there, or the child never collected a cycle."""
    script = """
        import gc, os, sys
        from errands import interrupts
        # the state a fork copies mid-read: collection off, paused by the frame read
        gc.disable()
        interrupts._gc_paused = True
        pid = os.fork()
        if pid == 0:
            os._exit(0 if gc.isenabled() and not interrupts._gc_paused else 1)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        print("child collects", code == 0, "parent still paused", not gc.isenabled())
    """
    done = run_script(script, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "child collects True parent still paused True", done.stdout
