"""A worker runs on under a trace function (coverage, a debugger, a profiler).

errands stops hooks and handlers past their limits with an exception raised inside their
thread, and drops one aimed too late. It dropped it with
``PyThreadState_SetAsyncExc(ident, NULL)`` (after every hook call, too): on CPython 3.11
that leaves the interpreter flagged as having an exception pending when none is, and every
thread with a trace function then loops for ever at its next call. A test suite measuring
coverage hung at its first worker with an event subscriber. Each case runs in a child
process with a limit, so a hang fails the test instead of the suite.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TRACED = """
import sys
import threading

def tracer(frame, event, arg):
    return None

sys.settrace(tracer)
threading.settrace(tracer)
"""

LIMIT = 60  # seconds a child may take; each finishes in a few


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    code = TRACED + textwrap.dedent(script)
    try:
        return subprocess.run(
            [sys.executable, "-c", code, *args],
            capture_output=True,
            text=True,
            timeout=LIMIT,
        )
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"the traced process hung (killed after {LIMIT} s): {hung.stderr!r}")


def test_dropping_no_interrupt_leaves_traced_threads_running() -> None:
    """Given a traced process, when a thread drops an interrupt that is not there (as a
    hook lane did after every hook), then it and other threads go on calling functions
    (on 3.11 they hung at their next call)."""
    done = _run(
        """
        import threading
        from errands.interrupts import drop_pending

        def calls():
            return sum(len(str(i)) for i in range(1000))

        drop_pending()
        calls()
        other = threading.Thread(target=calls)
        other.start()
        other.join(10)
        print("alive" if not other.is_alive() else "other thread stuck")
        """
    )
    assert done.stdout.strip() == "alive", done.stderr


def test_a_traced_worker_runs_its_jobs_and_event_subscribers_to_the_end(tmp_path: Path) -> None:
    """Given a process with a trace function on every thread, when an embedded worker runs
    jobs whose events reach a subscriber (a hook lane), then every job completes and the
    worker stops."""
    done = _run(
        """
        import sys
        import threading

        import errands

        app = errands.App(f"sqlite:///{sys.argv[1]}/errands.db")
        seen = []
        app.events.subscribe(lambda event: seen.append(event))

        @app.job(name="ok")
        def ok(n: int) -> int:
            return n

        handles = [ok.enqueue(n) for n in range(20)]
        worker = app.worker(concurrency=2, poll_interval=0.05, maintenance=False)
        thread = threading.Thread(target=worker.run, kwargs={"install_signals": False})
        thread.start()
        try:
            results = [h.result(timeout=30) for h in handles]
        finally:
            worker.stop()
            thread.join(30)
        app.close()
        print(sum(results), "stopped" if not thread.is_alive() else "running", bool(seen))
        """,
        str(tmp_path),
    )
    assert done.stdout.strip() == "190 stopped True", done.stderr[-3000:]
