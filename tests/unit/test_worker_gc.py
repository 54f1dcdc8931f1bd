"""A process that is a worker's own tunes its garbage collector once the app is imported
(src/errands/worker/collector.py): the objects that exist are frozen, and a young
collection starts after 10,000 new objects; thresholds the app set itself are kept. Run
in processes of their own: a frozen collector is the process's for good."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

TUNE = """
import gc, json, sys
import errands  # as errands worker does: errands first, then the app
from errands.worker.collector import use_worker_gc
exec(sys.argv[1])  # the app's own import-time code
use_worker_gc()
print(json.dumps({"thresholds": gc.get_threshold(), "frozen": gc.get_freeze_count()}))
"""

# A Django settings module, say: the app's code may run before errands is imported.
TUNE_APP_FIRST = """
import gc, json, sys
exec(sys.argv[1])
import errands
from errands.worker.collector import use_worker_gc
use_worker_gc()
print(json.dumps({"thresholds": gc.get_threshold(), "frozen": gc.get_freeze_count()}))
"""


def tuned(app_code: str, script: str = TUNE) -> dict[str, list[int] | int]:
    out = subprocess.run(
        [sys.executable, "-c", script, app_code], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result: dict[str, list[int] | int] = json.loads(out.stdout)
    return result


def test_a_worker_process_freezes_what_exists_and_collects_young_objects_less_often() -> None:
    found = tuned("pass")
    assert found["thresholds"] == [10_000, 10, 10]
    assert isinstance(found["frozen"], int) and found["frozen"] > 1_000


@pytest.mark.parametrize("script", [TUNE, TUNE_APP_FIRST], ids=["errands_first", "app_first"])
@pytest.mark.parametrize("own", [(500, 5, 5), (5_000, 10, 10), (50_000, 20, 20)])
def test_thresholds_the_app_set_itself_are_kept(own: tuple[int, int, int], script: str) -> None:
    found = tuned(f"gc.set_threshold(*{own!r})", script)
    assert found["thresholds"] == list(own)
    assert isinstance(found["frozen"], int) and found["frozen"] > 1_000
