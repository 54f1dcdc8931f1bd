"""An app for the process pool's tests (``--pool process``): jobs that reach the edges of
a worker child's job loop.

``app`` is looked up lazily (a module ``__getattr__``): the forkserver imports this module
for its children, and each child then looks ``app`` up in it as it loads the app
(errands.loading), so what is done there is done in the child alone. In a worker's child
the app lacks ``parent_only``: a worker whose children load an app without a job type
the worker's own app has.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from pathlib import Path
from typing import Any

import errands

_app = errands.App(lease=2.0)


def __getattr__(name: str) -> Any:
    if name != "app":
        raise AttributeError(name)
    if multiprocessing.parent_process() is not None:  # a worker's child, not the worker
        _app.registry.pop("parent_only", None)
    return _app


@_app.job(name="child_pid", retries=0)
def child_pid() -> int:
    return os.getpid()


@_app.job(name="parent_only", retries=3, backoff=0.1)
def parent_only() -> None:
    """Registered in the worker's app, not in its children's."""


class Unprintable(ValueError):
    def __str__(self) -> str:
        raise RuntimeError("this exception has no text")


@_app.job(name="unprintable", retries=0)
def unprintable() -> None:
    raise Unprintable()


@_app.job(name="reports_after_return", retries=0)
def reports_after_return(ctx: errands.Context, marker: str, after: float = 0.3) -> int:
    """Return at once, leaving a thread that reports progress once the outcome has gone
    (``after`` seconds later), then creates the file ``marker``."""

    def late() -> None:
        time.sleep(after)
        ctx.progress(1.0, "reported after the job ended")  # sent at once: none came before
        Path(marker).touch()

    threading.Thread(target=late, daemon=True).start()
    return os.getpid()


@_app.job(name="waits_for", retries=0)
def waits_for(path: str) -> int:
    """Wait (a minute at most) for the file ``path``."""
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    return os.getpid()
