"""An app for the process pool's tests (``--pool process``): jobs that reach the edges of
a worker child's job loop.

``app`` is looked up lazily (a module ``__getattr__``): the forkserver imports this module
for its children, and each child then looks ``app`` up in it as it loads the app
(errands.loading), so what is done there is done in the child alone. In a worker's child
the app lacks ``parent_only``: a worker whose children load an app without a job type
the worker's own app has.

While the file ACC_CHILD_START_FAULT names exists, a worker's child fails as it loads the
app: it cannot start. While the file ACC_FORKSERVER_FAULT names exists, the worker's
forkserver dies as it imports this module (before it forks any child), and appends a line
to that file's ``.deaths``; it deletes the file (one failure), unless it says ``always``.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import errands

_app = errands.App(lease=2.0)


def _in_a_forkserver() -> bool:
    """Whether this import runs in a forkserver's start-up (its preload)."""
    frame: Any = sys._getframe()
    while frame is not None:
        code = frame.f_code
        if code.co_name == "main" and code.co_filename.endswith("forkserver.py"):
            return True
        frame = frame.f_back
    return False


_FORKSERVER_FAULT = os.environ.get("ACC_FORKSERVER_FAULT", "")
if _FORKSERVER_FAULT and os.path.exists(_FORKSERVER_FAULT) and _in_a_forkserver():
    with open(f"{_FORKSERVER_FAULT}.deaths", "a") as deaths:
        deaths.write(f"{os.getpid()}\n")
    if Path(_FORKSERVER_FAULT).read_text() != "always":
        os.remove(_FORKSERVER_FAULT)
    os._exit(1)


def __getattr__(name: str) -> Any:
    if name != "app":
        raise AttributeError(name)
    if multiprocessing.parent_process() is not None:  # a worker's child, not the worker
        if os.path.exists(os.environ.get("ACC_CHILD_START_FAULT", "/nonexistent")):
            raise RuntimeError("injected: this worker child cannot start")
        _app.registry.pop("parent_only", None)
        if os.environ.get("ACC_TRACE_FILE"):
            _trace_to(os.environ["ACC_TRACE_FILE"])
    return _app


def _trace_to(path: str) -> None:
    """Tracing in this child, each ended span written to ``path`` as a JSON line."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

    from errands.observability.tracing import install_tracing

    out = open(path, "a")  # noqa: SIM115 - the child's life long
    exporter = ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n")
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    install_tracing(_app, tracer_provider=provider)


@_app.job(name="child_pid", retries=0)
def child_pid() -> int:
    return os.getpid()


@_app.job(name="child_parent", retries=0)
def child_parent() -> list[int]:
    """This child's pid and its parent's: the worker's when spawned, else the forkserver's."""
    return [os.getpid(), os.getppid()]


@_app.job(name="in_transaction", retries=0)
def in_transaction(ctx: errands.Context) -> int:
    """Completes in its own ctx.transaction() (its outcome written in the child)."""
    ctx.transaction()
    return os.getpid()


@_app.job(name="commits_then_fails", retries=3, backoff=0.1)
def commits_then_fails(ctx: errands.Context, path: str) -> None:
    """Commit errands' transaction through ``.raw`` (a write: a line appended to ``path``
    at the same time), then fail."""
    tx = ctx.transaction()
    tx.raw.execute("COMMIT")
    with open(path, "a") as out:
        out.write(f"{ctx.attempt}\n")
    raise ValueError("failed after committing")


@_app.job(name="parent_only", retries=3, backoff=0.1)
def parent_only() -> None:
    """Registered in the worker's app, not in its children's."""


class Unprintable(ValueError):
    def __str__(self) -> str:
        raise RuntimeError("this exception has no text")


@_app.job(name="unprintable", retries=0)
def unprintable() -> None:
    raise Unprintable()


@_app.job(name="huge_message", sensitive={"token"}, retries=0)
def huge_message(token: str, at: int, size: int) -> None:
    """Raise an exception whose message is ``size`` characters, quoting ``token`` (a
    sensitive argument) ``at`` characters in."""
    raise RuntimeError("x" * at + token + "y" * size)


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


@_app.job(name="keeps_reporting", retries=0)
def keeps_reporting(ctx: errands.Context, seconds: float) -> int:
    """Return at once, leaving a thread that reports progress every millisecond for
    ``seconds`` (a stale attempt's reports, once the outcome has gone)."""

    def stale() -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            ctx.progress(0.1, "a finished attempt's")
            time.sleep(0.001)

    threading.Thread(target=stale, daemon=True).start()
    return os.getpid()


@_app.job(name="reports_then_waits", retries=0)
def reports_then_waits(ctx: errands.Context, path: str) -> int:
    """Report progress once, then wait (a minute at most) for the file ``path``."""
    ctx.progress(0.5, "the running attempt's")
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    return os.getpid()
