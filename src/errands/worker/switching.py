"""How often a worker process's threads take the GIL from each other.

A worker's threads (its handler threads, the claim loop, the completer, the async
handlers' event loop) take the GIL from each other at most every *switch interval* while
each has Python to run. At Python's default of 0.005 s, many quick jobs on ``-c 32``
spent 10-14 % more CPU a job than at 0.02 s (interleaved runs of 100,000 no-op jobs on
PostgreSQL, one and two processes: 56 -> 48 and 54 -> 49 us a job; 0.01 to 0.05 s alike).
The cost: while handlers run pure Python, a thread that wants the GIL (a heartbeat, a
claim, a step of the event loop) may wait this long for each of them that takes it first;
with many CPU-bound handlers and a short lease, ``--switch-interval 0.005`` is Python's
default again. A job's start on an idle worker waits for nothing.

Set only by the commands that run a worker in a process of its own (``errands worker``,
``flask errands-worker``, ``manage.py errands_worker``), never by an App or a Worker made
in an application's process, whose threads are the application's to tune.
"""

from __future__ import annotations

import sys

SWITCH_INTERVAL = 0.02  # seconds


def use_switch_interval(seconds: float = SWITCH_INTERVAL) -> None:
    """This process's GIL switch interval (``sys.setswitchinterval``)."""
    sys.setswitchinterval(seconds)
