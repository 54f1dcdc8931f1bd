"""The first async calls open the store once, on a thread of their own (App.abackend):
the event loop never waits for it, and neither does the loop's default executor. A child
forked while a thread opens the store opens its own."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import errands
import errands.app as app_module

CALLS: dict[str, Callable[[errands.App, Any, int], Awaitable[Any]]] = {
    "aenqueue": lambda app, job, n: job.aenqueue(n=n),
    "aget_job": lambda app, job, n: app.aget_job(n + 1),
    "asignal": lambda app, job, n: app.asignal(n + 1, "go"),
    "acancel": lambda app, job, n: app.acancel(n + 1),
    "aresult": lambda app, job, n: errands.JobHandle(app, n + 1, "open.first").aresult(timeout=0.1),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_many_first_async_calls_leave_the_loops_executor_free_while_the_store_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    """Given a store slow to open and 40 first async calls at once, the loop's default
    executor still runs other work: each call took an executor thread that then waited
    behind the first one's opening, and with min(32, cores + 4) threads none was left
    (for the loop's getaddrinfo, aget_job, asyncio.to_thread). The store opens once."""
    gate = threading.Event()
    opens: list[str] = []
    real_open = app_module.open_backend

    def slow_open(url: str, **options: Any) -> Any:
        opens.append(url)
        gate.wait(30)  # a database that accepts connections and answers late
        return real_open(url, **options)

    monkeypatch.setattr(app_module, "open_backend", slow_open)
    app = errands.App(f"sqlite:///{tmp_path / 'slow.db'}")

    @app.job(name="open.first")
    def first(n: int) -> None: ...

    async def main() -> list[Any]:
        loop = asyncio.get_running_loop()
        tasks = [asyncio.create_task(CALLS[call](app, first, n)) for n in range(40)]
        await asyncio.sleep(0.2)  # every call has started and waits for the store
        try:
            free = await asyncio.wait_for(loop.run_in_executor(None, lambda: "free"), 10)
        finally:
            gate.set()
        assert free == "free"
        return await asyncio.gather(*tasks, return_exceptions=True)

    try:
        answers = asyncio.run(main())
        assert len(opens) == 1  # opened once for all of them
        if call == "aenqueue":
            assert sorted(h.job().args["n"] for h in answers) == list(range(40))
        else:  # no such jobs: each call answered, none stuck
            assert len(answers) == 40
            assert not [
                a
                for a in answers
                if isinstance(a, BaseException) and not isinstance(a, errands.ErrandsError)
            ]
    finally:
        gate.set()
        app.close()


@pytest.mark.skipif(sys.platform == "win32", reason="no os.fork on Windows")
@pytest.mark.parametrize("opener", ["backend", "abackend"])
def test_a_child_forked_while_a_thread_opens_the_store_opens_its_own_and_enqueues(
    tmp_path: Path, opener: str
) -> None:
    """Given a thread of the parent opening the store (App.backend, or the thread that
    App.abackend opens it on) at the fork, the child opens the store itself and enqueues
    (sync, or async: a first aenqueue). The App's lock guarding the opening was copied
    into the child held, by a thread that does not exist there: the child's first use of
    the store hung for good (and an async one waited for that thread's opening). Real
    os.fork, in a process of its own (the test process forks nothing); a child still
    hung after 60 s is ended by its alarm, and the test fails."""
    script = """
        import asyncio, os, signal, sys, threading
        import errands
        import errands.app as app_module

        real_open = app_module.open_backend
        parent = os.getpid()
        opening, done_forking = threading.Event(), threading.Event()

        def slow_open(url, **options):
            if os.getpid() == parent:  # the parent's opening: held across the fork
                opening.set()
                done_forking.wait(60)
            return real_open(url, **options)

        app_module.open_backend = slow_open
        app = errands.App("sqlite:///" + sys.argv[1])

        @app.job(name="forked.job")
        def job(n: int) -> None: ...

        if sys.argv[2] == "backend":
            thread = threading.Thread(target=lambda: app.backend)
        else:
            thread = threading.Thread(target=lambda: asyncio.run(app.abackend()))
        thread.start()
        assert opening.wait(30)
        pid = os.fork()
        if pid == 0:
            signal.alarm(60)  # hung: killed by SIGALRM, the test fails
            try:
                if sys.argv[2] == "backend":
                    handle = job.enqueue(n=1)
                else:
                    handle = asyncio.run(job.aenqueue(n=1))
                print("child enqueued", handle.id, flush=True)
            except BaseException as exc:
                print("child:", type(exc).__name__, exc, flush=True)
                os._exit(1)
            os._exit(0)
        done_forking.set()
        thread.join(30)
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status), flush=True)
        print("stored", [j.args["n"] for j in app.jobs()], flush=True)
        app.close()
        """
    done = subprocess.run(
        [
            sys.executable,
            "-X",
            "faulthandler",
            "-c",
            textwrap.dedent(script),
            str(tmp_path / "store.db"),
            opener,
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "child exit 0" in done.stdout, (done.stdout, done.stderr[-3000:])
    assert "stored [1]" in done.stdout, done.stdout


def test_an_app_dropped_is_collected_though_its_forks_are_watched(tmp_path: Path) -> None:
    """The App's fork hook keeps no App alive: one used, closed and dropped is collected
    (the process's list of Apps to tell of a fork holds them weakly)."""
    import gc
    import weakref

    app = errands.App(f"sqlite:///{tmp_path / 'store.db'}")

    @app.job(name="dropped.job")
    def job(n: int) -> None: ...

    job.enqueue(n=1)
    app.close()
    dropped = weakref.ref(app)
    del app, job
    gc.collect()
    assert dropped() is None


@pytest.mark.skipif(sys.platform == "win32", reason="no os.fork on Windows")
def test_a_fork_while_another_thread_holds_the_openings_future_does_not_hang_the_child(
    tmp_path: Path,
) -> None:
    """The App's at-fork hook forgets an async opening under way without asking the
    future (Future.done() takes its lock: held by another thread at the fork, as
    set_result() holds it, the child hung for good inside the hook, before its own code)."""
    script = """
        import concurrent.futures, os, signal, sys, threading, time
        import errands

        app = errands.App("sqlite:///" + sys.argv[1])
        opening = concurrent.futures.Future()
        opening.set_running_or_notify_cancel()
        app._opening = opening  # an async opening under way, as abackend() sets it
        held = threading.Event()

        def opener():  # as set_result() does: with the future's condition held
            with opening._condition:
                held.set()
                time.sleep(2)
            opening.set_result(None)

        threading.Thread(target=opener, daemon=True).start()
        held.wait()
        pid = os.fork()
        if pid == 0:
            os._exit(0)  # past the at-fork hooks
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                print("child exit", os.waitstatus_to_exitcode(status), flush=True)
                break
            time.sleep(0.1)
        else:  # hung in the at-fork hook (an alarm set there would come too late)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            print("child hung in the at-fork hook", flush=True)
        """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), str(tmp_path / "store.db")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert "child exit 0" in done.stdout, (done.stdout, done.stderr[-3000:])
