"""Where a sync wait's reads run (errands.results.Pacer.read): with a deadline, in one of
errands' threads, waited for until the deadline (tests/postgres/test_waits_when_the_store_is_away.py
proves it against a locked table); a read made inside one (a nested workflow's result)
runs in that same thread; and once a few reads are left hanging past their deadlines, the
next ones run in the caller's thread again instead of taking every thread and connection."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from errands import results
from errands.results import Pacer


@pytest.fixture
def hanging() -> Iterator[threading.Event]:
    """An event the hanging reads wait for: set at the end, so they all end."""
    release = threading.Event()
    yield release
    release.set()


def _until_none_left_behind() -> None:
    pause = threading.Event()
    for _ in range(600):
        if results._left_behind == 0:
            return
        pause.wait(0.05)
    raise AssertionError(f"{results._left_behind} read(s) still left behind after 30 s")


def test_a_read_with_a_deadline_runs_in_errands_thread_and_one_without_in_the_callers() -> None:
    caller = threading.get_ident()
    assert Pacer(None, 0.05, 5.0).read(threading.get_ident) != caller
    assert Pacer(None, 0.05, None).read(threading.get_ident) == caller


def test_a_read_made_inside_a_read_runs_in_the_same_thread() -> None:
    outer, inner = Pacer(None, 0.05, 5.0), Pacer(None, 0.05, 5.0)
    idents = outer.read(lambda: (threading.get_ident(), inner.read(threading.get_ident)))
    assert idents is not None
    assert idents[0] == idents[1] != threading.get_ident()


def test_reads_left_hanging_past_their_deadline_are_bounded_then_the_caller_reads_itself(
    hanging: threading.Event,
) -> None:
    def hang() -> int:
        hanging.wait(30)
        return threading.get_ident()

    _until_none_left_behind()  # (an earlier test's read left behind, ending)
    caller = threading.get_ident()
    for _ in range(results.LEFT_BEHIND_MAX):
        pacer = Pacer(None, 0.05, 0.05)
        assert pacer.read(hang) is None  # no answer by the deadline: a failed read
        assert isinstance(pacer.error, TimeoutError)
    assert results._left_behind == results.LEFT_BEHIND_MAX
    # the next read is not offloaded: it runs here (and answers, the store being fine)
    assert Pacer(None, 0.05, 5.0).read(threading.get_ident) == caller
    hanging.set()
    _until_none_left_behind()  # the hanging reads end in their threads, counted out
    assert Pacer(None, 0.05, 5.0).read(threading.get_ident) != caller


FORKED = """
import os, threading
from errands import results
from errands.results import Pacer

release = threading.Event()
for _ in range(results.LEFT_BEHIND_MAX):
    Pacer(None, 0.05, 0.05).read(lambda: release.wait(30))
parent_count = results._left_behind
pid = os.fork()
if pid == 0:
    offloaded = Pacer(None, 0.05, 5.0).read(threading.get_ident) != threading.get_ident()
    print("child", results._left_behind, offloaded, flush=True)
    os._exit(0)
os.waitpid(pid, 0)
print("parent", parent_count, flush=True)
release.set()
"""


def test_a_forked_child_counts_none_of_its_parents_reads_as_left_behind() -> None:
    out = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", "-c", FORKED],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    lines = out.stdout.split("\n")
    assert f"parent {results.LEFT_BEHIND_MAX}" in lines, out
    assert "child 0 True" in lines, out


AT_EXIT = """
import atexit
from errands.results import Pacer

atexit.register(lambda: print("read", Pacer(None, 0.05, 5.0).read(lambda: 42), flush=True))
"""


def test_a_wait_in_an_atexit_hook_reads_in_its_own_thread() -> None:
    """At interpreter exit errands' threads take no new call (RuntimeError): a wait in
    an atexit hook (a web app's shutdown waiting for a job) reads in its own thread."""
    out = subprocess.run(
        [sys.executable, "-c", AT_EXIT], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "read 42", out
