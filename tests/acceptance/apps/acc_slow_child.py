"""acc_basic's app, whose import takes ACC_SLOW_CHILD_IMPORT seconds outside the worker's
own process: the forkserver (which imports the app for its children) starts slowly, so a
test can stop the worker while its spare child is still starting."""

from __future__ import annotations

import os
import sys
import time

from acc_basic import app

__all__ = ["app"]

if sys.argv[:1] == ["-c"]:  # the forkserver (started as `python -c ...`), not the worker
    time.sleep(float(os.environ.get("ACC_SLOW_CHILD_IMPORT", "0")))
