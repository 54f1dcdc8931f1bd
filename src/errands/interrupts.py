"""Regions of errands' own code that an asynchronous interrupt must not land in.

A hook past its ``hook_timeout`` and a sync handler past its timeout are stopped by an
exception raised inside their thread (``PyThreadState_SetAsyncExc``), which lands at
whatever bytecode the thread is running. Landing inside one of errands' own store calls
made from that thread (a hook that enqueues, the hooks' own "done" mark, a handler's
``enqueue``) it could leave a lock taken and a transaction open: on SQLite, the process's
write lock and the file's, for good (seen in a soak: every worker's heartbeats failed for
23 minutes). So the store's transactions run :func:`shielded`, and whoever raises such an
interrupt asks :func:`aim_unless_shielded` first: a thread inside a shield is interrupted
once it leaves it (the caller tries again later).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_depth: dict[int, int] = {}  # thread ident -> how many shields it is inside
_lock = threading.Lock()


@contextmanager
def shielded() -> Iterator[None]:
    """Run the body with no asynchronous interrupt aimed at this thread."""
    ident = threading.get_ident()
    with _lock:
        _depth[ident] = _depth.get(ident, 0) + 1
    try:
        yield
    finally:
        with _lock:
            left = _depth[ident] - 1
            if left:
                _depth[ident] = left
            else:
                del _depth[ident]


def aim_unless_shielded(ident: int, aim: Callable[[], None]) -> bool:
    """Call ``aim()`` (which raises the interrupt in thread ``ident``) unless that thread
    is inside a shield; False when it is (the caller tries again later)."""
    with _lock:
        if ident in _depth:
            return False
        aim()
        return True
