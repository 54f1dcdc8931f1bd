"""`errands demo` (what `make demo` runs) works from a clean folder and reports the truth."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest

pytestmark = pytest.mark.acceptance


def run_demo(
    errands: list[str], folder: Path, *options: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``errands demo OPTIONS`` in ``folder``, without ERRANDS_URL and ERRANDS_APP."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if k not in ("ERRANDS_URL", "ERRANDS_APP")}
    return subprocess.run(
        [*errands, "demo", *options],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_demo_runs_end_to_end_on_a_fresh_sqlite_file_and_exits_zero(tmp_path: Path) -> None:
    """The demo replaces whatever sits at its path with a fresh database, finishes by itself,
    and its summary matches the store."""
    db = tmp_path / "demo.db"
    db.write_bytes(b"left over from an earlier run, not a database")  # the demo starts afresh
    proc = run_demo([sys.executable, "-m", "errands"], tmp_path, "--jobs", "60", "--db", str(db))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "every job reached a terminal state" in proc.stdout
    assert "errands dlq list" in proc.stdout  # it shows how to inspect the DLQ
    with closing(sqlite3.connect(db)) as conn:
        states = dict(conn.execute("SELECT state, count(*) FROM errands_jobs GROUP BY state"))
    assert set(states) <= {"completed", "dead"}, states
    assert states.get("dead") == 3  # the down webhook, the broken CSV, the declined card
    summary = re.search(r"^\s*completed\s+(\d+)\s*$", proc.stdout, re.MULTILINE)
    assert summary is not None, proc.stdout
    assert int(summary.group(1)) == states["completed"]


def test_the_next_steps_the_demo_prints_run_as_pasted_without_the_venv_on_path(
    tmp_path: Path,
) -> None:
    """``make demo`` runs ``.venv/bin/errands``, whose folder is not on PATH: the commands
    it prints name the script by its path from the current folder, and each one works
    when pasted there (the worker and the dashboard, which run until stopped, are checked
    with --help); the dashboard is among them."""
    script = Path(sys.executable).parent / "errands"
    env = {k: v for k, v in os.environ.items() if k not in ("ERRANDS_URL", "ERRANDS_APP")}
    env["PATH"] = "/usr/bin:/bin"  # no venv on PATH, as after `make demo`
    venv = tmp_path / "venv-bin"
    venv.symlink_to(script.parent)  # the demo's folder holds the venv, as the repo root does
    proc = run_demo(["venv-bin/errands"], tmp_path, "--jobs", "30", "--db", "demo.db", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = proc.stdout.split("Next steps", 1)[1]
    commands = [line.strip() for line in steps.splitlines() if "venv-bin/errands " in line]
    assert len(commands) == 7, steps
    assert any(" dashboard errands.demo:app " in c for c in commands)
    for command in commands:
        assert command.startswith("venv-bin/errands "), command
        if " worker " in command or " dashboard " in command:
            command += " --help"  # they run until stopped
        done = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, (command, done.stdout, done.stderr)
        assert "command not found" not in done.stderr
