"""How a worker process's garbage collector runs.

A job's objects (its row, attempt, handler call, Context) are freed by reference counting
once its outcome is written and its handler is over: a finished job leaves no reference
cycle (``tests/unit/test_job_garbage.py``; rarer ends, an abandoned handler say, still
may). The collector still runs, because CPython starts a
young collection after every 700 new container objects, and a claim of hundreds of jobs
makes thousands at once. The prefetched jobs are alive at that moment, so each young
collection moves them to an older generation, and every few claims a full collection
walked every object of the process: the app's modules, classes and functions, ~50,000
objects for errands and its libraries alone, more for a large app. Measured on two
worker processes of 100,000 no-op jobs on PostgreSQL (``-c 32 --prefetch 1024``): the
collector took ~25 % of each process's CPU (0.8 of 3.2 s), ~40 % before the cycles were
broken.

So a process that is a worker's own (``errands worker``, ``flask errands-worker``,
``manage.py errands_worker``), once the app is imported and the worker built:

- collects once and *freezes* what exists (``gc.freeze()``): the app's import-time
  objects live as long as the process, and no collection walks them again;
- starts a young collection after 10,000 new objects instead of 700 (CPython's default
  before 3.13): most of a claim's objects are gone by then. The collector took ~0.2 s
  of the 3.2 s; with the cycles broken too, two processes ran 1.11 x the rate of the code
  before (5 alternated rounds, 0.99-1.26).

Thresholds other than CPython's own are the app's (``gc.set_threshold``, before or after
errands is imported) and kept; the objects are frozen all the same. An App or a Worker
made in an application's own process never changes the collector: that process is the
application's to tune (``manage.py errands_worker`` run by ``call_command`` inside one
tunes it: it is meant as a process of its own).
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000  # new container objects between young collections
# CPython's own thresholds (3.11 and 3.12; 3.13): only these are raised. Others were set
# by the app, before errands was imported as much as after (a Django settings module).
CPYTHON_DEFAULTS = ((700, 10, 10), (2000, 10, 10))

# The thresholds when errands was imported (errands/__init__ imports this module): ones
# changed since are the app's (errands worker imports the app after errands).
AT_IMPORT = gc.get_threshold()


def use_worker_gc() -> None:
    """Tune this process's collector for a worker (see the module's docstring)."""
    thresholds = gc.get_threshold()
    if thresholds == AT_IMPORT and thresholds in CPYTHON_DEFAULTS:
        gc.set_threshold(YOUNG_THRESHOLD, *thresholds[1:])
    gc.collect()
    gc.freeze()
