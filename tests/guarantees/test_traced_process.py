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

import os
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


GC_HEAVY = """
import gc
import importlib.util
import sys
import threading

spec = importlib.util.spec_from_file_location("errands_interrupts", sys.argv[1])
interrupts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(interrupts)


class Cyclic:  # garbage only a collection frees, whose finalizer runs Python code
    def __init__(self):
        self.me = self

    def __del__(self):
        sum(range(10))


gc.set_threshold(5)
failures = []


def lane():
    for _ in range(300):  # a lane drops after hooks that make garbage
        for _ in range(20):
            Cyclic()
        try:
            interrupts.drop_pending()
        except BaseException as exc:
            failures.append(repr(exc))


thread = threading.Thread(target=lane)
thread.start()
thread.join()
print("done", failures)
"""


def _interpreters() -> list[str]:
    """This interpreter and the other CPython versions installed here (under pyenv on
    this machine kind, as scripts/test_integrations.sh finds 3.12), which take different
    paths through drop_pending."""
    found = {sys.executable}
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for version in ("3.12", "3.13"):
        if f"{sys.version_info.major}.{sys.version_info.minor}" == version:
            continue
        installed = sorted(root.glob(f"{version}.*/bin/python3"))
        if installed:
            found.add(str(installed[-1]))
    return sorted(found)


@pytest.mark.parametrize("python", _interpreters())
def test_dropping_an_interrupt_under_heavy_garbage_collection_lands_nowhere(python: str) -> None:
    """Given a thread making garbage whose finalizers run Python code (collections every
    few objects), when it drops a pending interrupt 300 times, then nothing lands anywhere
    and no call waits. On 3.12 and 3.13 the private interrupt that drop_pending aimed to
    clear the flag landed in a finalizer the interpreter ran first (reported as an
    exception ignored in ``__del__``), and the call spun its whole second for it."""
    module = Path(__file__).parents[2] / "src" / "errands" / "interrupts.py"
    try:
        done = subprocess.run(
            [python, "-c", GC_HEAVY, str(module)], capture_output=True, text=True, timeout=LIMIT
        )
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"{python} hung (killed after {LIMIT} s): {hung.stderr!r}")
    assert done.stdout.strip() == "done []", done.stderr[-2000:]
    assert "Exception ignored" not in done.stderr, done.stderr[-2000:]
