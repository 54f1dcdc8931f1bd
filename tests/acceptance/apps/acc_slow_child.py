"""acc_basic's app, which a worker's child process takes ACC_SLOW_CHILD_START seconds to
load (the worker itself loads it at once), so a test can stop the worker while its spare
child is still starting. The child touches the file ACC_CHILD_LOADING names as it begins.

``app`` is looked up lazily (a module ``__getattr__``): the forkserver imports this module
for its children, and each child then looks ``app`` up in it (errands.loading)."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

from acc_basic import app as _app


def __getattr__(name: str) -> Any:
    if name != "app":
        raise AttributeError(name)
    if multiprocessing.parent_process() is not None:  # a worker's child, not the worker
        Path(os.environ["ACC_CHILD_LOADING"]).touch()
        time.sleep(float(os.environ.get("ACC_SLOW_CHILD_START", "0")))
    return _app
