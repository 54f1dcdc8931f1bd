"""Imported by the process pool's forkserver alone, first of its preload: the forkserver
ignores SIGTERM and SIGHUP, as each worker child does (process_pool.child_main).

A SIGTERM sent to every process of a worker (systemd's default KillMode=control-group,
``kill -- -PGID``) killed the forkserver, and the children forked from it, whose parent
it is, took that for their worker's death and left: the running jobs were recorded as
crashes, charged toward their poison limit, instead of finishing within the worker's
grace. The worker decides when its children stop; the forkserver leaves with the worker
(its pipe to the worker closes).
"""

from __future__ import annotations

import signal

for _ignored in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(_ignored, signal.SIG_IGN)
