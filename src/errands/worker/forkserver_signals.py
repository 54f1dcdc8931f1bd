"""Imported by the process pool's forkserver alone (its preload): the server outlives
SIGTERM and SIGHUP, as each worker child does (process_child.child_main).

A SIGTERM sent to every process of a worker (systemd's default KillMode=control-group,
``kill -- -PGID``) killed the forkserver, and the children forked from it, whose parent
it is, took that for their worker's death and left: the running jobs were recorded as
crashes, charged toward their poison limit, instead of finishing within the worker's
grace. The worker decides when its children stop; the forkserver leaves with the worker
(its pipe to the worker closes).

A handler, not SIG_IGN: an ignored signal stays ignored across exec, in every program a
process forked from the server starts, and the server is the worker process's own
(another forkserver-context pool of the app's forks from it too: its workers would never
stop on SIGTERM). A process forked from the server that kept this handler gets the
default action, as if it had never been set.
"""

from __future__ import annotations

import os
import signal
from types import FrameType

_SERVER = os.getpid()


def _outlive(signum: int, frame: FrameType | None) -> None:
    if os.getpid() == _SERVER:
        return  # the server: its worker decides when it goes
    signal.signal(signum, signal.SIG_DFL)  # forked from it: what the signal would do
    os.kill(os.getpid(), signum)


for _name in ("SIGTERM", "SIGHUP"):  # (no SIGHUP on Windows)
    _signum = getattr(signal, _name, None)
    if _signum is not None:
        signal.signal(_signum, _outlive)
