"""A hook's time limit never lands inside errands' own store call (errands.interrupts): a
SQLite hook interrupted while it held the write lock left it held for good (a soak hung)."""

from __future__ import annotations

import threading
import time

from errands.hooks import HookTimeout, Lane
from errands.interrupts import shielded


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
