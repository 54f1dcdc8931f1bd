"""What a process pays to start: a worker, a CLI command whose output goes to a script, and
a worker's child processes (their forkserver imports ``python -m errands``'s main module)
import the CLI without rich (~30 ms of CPU at every start; it draws tables on a terminal
only) and without the dashboard's libraries."""

from __future__ import annotations

import subprocess
import sys

FRONT_END_ONLY = ("rich", "starlette", "jinja2", "uvicorn")


def test_the_cli_and_the_worker_start_without_importing_rich_or_the_dashboard() -> None:
    code = (
        "import sys, errands.cli.main, errands.worker.worker\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({FRONT_END_ONLY!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]", out.stdout
