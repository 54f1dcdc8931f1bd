"""An app whose import takes ``ACC_IMPORT_SECONDS`` (a large app, a slow disk): its
workers are still importing when a test kills their supervisor."""

from __future__ import annotations

import os
import time

from acc_basic import app

time.sleep(float(os.environ.get("ACC_IMPORT_SECONDS", "0")))

__all__ = ["app"]
