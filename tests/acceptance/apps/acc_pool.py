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
