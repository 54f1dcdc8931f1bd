"""``errands dashboard``, the real command in a subprocess: what it says it serves."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import errands


def test_a_dashboard_on_port_0_prints_the_port_the_os_chose_and_serves_there(
    tmp_path: Path,
) -> None:
    """Given ``errands dashboard --port 0`` (the OS picks a free port), then its start-up
    line names the port it listens on, and the dashboard answers there. It printed
    ``http://127.0.0.1:0/``, a port nobody can reach."""
    url = f"sqlite:///{tmp_path}/serve.db"
    (tmp_path / "serve_app.py").write_text(
        textwrap.dedent(
            f"""
            import errands

            app = errands.App({url!r})
            """
        )
    )
    store = errands.App(url)
    store.migrate()
    store.close()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("ERRANDS_")},
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "errands", "dashboard", "serve_app:app", "--port", "0"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()  # the start-up line (or why it could not start)
        match = re.search(r"errands dashboard on http://127\.0\.0\.1:(\d+)/", line)
        assert match, line
        port = int(match.group(1))
        assert port != 0, line
        body, deadline = "", time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as answer:
                    body = answer.read().decode()
                    break
            except OSError:
                assert server.poll() is None, "the dashboard exited"
                time.sleep(0.1)
        assert "errands" in body.lower(), body[:300]
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        if server.stdout is not None:
            server.stdout.close()
