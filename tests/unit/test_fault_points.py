"""The fault-point hook's environment form (errands.faults), as the crash tests arm it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from errands import faults

CRASHER = """
from errands import faults
for _ in range(50):
    faults.fault_point("after_step")
print("survived")
"""


def _run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CRASHER],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_crash_budget_bounds_the_crashes_of_every_process_sharing_its_folder(
    tmp_path: Path,
) -> None:
    env = {"ERRANDS_FAULT_POINTS": "after_step:1:2", "ERRANDS_FAULT_DIR": str(tmp_path)}
    codes = [_run(env).returncode for _ in range(3)]
    assert codes == [faults.CRASH_EXIT_CODE, faults.CRASH_EXIT_CODE, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["after_step-0", "after_step-1"]


def test_a_point_without_a_budget_crashes_every_time_it_fires(tmp_path: Path) -> None:
    env = {"ERRANDS_FAULT_POINTS": "after_step", "ERRANDS_FAULT_DIR": str(tmp_path)}
    assert [_run(env).returncode for _ in range(2)] == [faults.CRASH_EXIT_CODE] * 2


def test_a_budget_without_a_shared_folder_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="ERRANDS_FAULT_DIR"):
        faults._parse("after_step:0.5:3")
