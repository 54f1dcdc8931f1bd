"""An app whose job forks a child process and stops it with SIGTERM, as a handler's
``multiprocessing.Pool`` does on Linux (the fork start method; ``Pool.__exit__``
terminates its workers): the forked child inherits the worker's signal handler."""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import errands


def _sleep_when_ready(ready: Any) -> None:
    ready.set()
    time.sleep(30)


app = errands.App()


@app.job(name="fork_and_terminate")
def fork_and_terminate() -> int | None:
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    child = context.Process(target=_sleep_when_ready, args=(ready,))
    child.start()
    # Once it runs: CPython drops a signal that reaches a child between its fork and its
    # interpreter's reset of the signal state, whatever the handler.
    ready.wait(20)
    child.terminate()  # SIGTERM
    child.join(20)
    return child.exitcode


@app.job(name="forks_and_returns", retries=0)
def forks_and_returns(pidfile: str) -> int:
    """Fork, and return from the handler in both processes (no os._exit in the child):
    the child writes its pid to ``pidfile`` first."""
    import os

    child = os.fork()
    if child == 0:
        with open(pidfile, "w") as out:
            out.write(str(os.getpid()))
    return os.getpid()
