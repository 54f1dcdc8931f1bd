"""`errands demo` (what `make demo` runs) works from a clean folder and reports the truth."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.acceptance


def test_demo_runs_end_to_end_on_a_fresh_sqlite_file_and_exits_zero(tmp_path: Path) -> None:
    """The demo replaces whatever sits at its path with a fresh database, finishes by itself,
    and its summary matches the store."""
    db = tmp_path / "demo.db"
    db.write_bytes(b"left over from an earlier run, not a database")  # the demo starts afresh
    env = {k: v for k, v in os.environ.items() if k not in ("ERRANDS_URL", "ERRANDS_APP")}
    proc = subprocess.run(
        [sys.executable, "-m", "errands", "demo", "--jobs", "60", "--db", str(db)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "every job reached a terminal state" in proc.stdout
    assert "errands dlq list" in proc.stdout  # it shows how to inspect the DLQ
    with sqlite3.connect(db) as conn:
        states = dict(conn.execute("SELECT state, count(*) FROM errands_jobs GROUP BY state"))
    assert set(states) <= {"completed", "dead"}, states
    assert states.get("dead") == 3  # the down webhook, the broken CSV, the declined card
    summary = re.search(r"^\s*completed\s+(\d+)\s*$", proc.stdout, re.MULTILINE)
    assert summary is not None, proc.stdout
    assert int(summary.group(1)) == states["completed"]
