"""The CLI's own warnings and errors follow the worker's log format: a worker started with
``--log-format json`` writes nothing but JSON lines, its start-up error included (an
operator's log pipeline parses exactly that line)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from errands.cli.render import notice
from errands.observability.logcontext import JsonFormatter, TextFormatter


@pytest.fixture
def root_handler() -> Iterator[logging.Handler]:
    """A handler on the root logger for the test, the root's own put back after."""
    root = logging.getLogger()
    saved, level = list(root.handlers), root.level
    handler = logging.StreamHandler()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        root.handlers[:], root.level = saved, level


def test_a_notice_is_a_plain_line_without_errands_logging(capsys: pytest.CaptureFixture) -> None:
    runner = CliRunner()
    with runner.isolation() as (_, err, *_):
        notice("there is no database at /x.db yet")
        notice("cannot connect", "error")
    assert err.getvalue().decode().splitlines() == [
        "warning: there is no database at /x.db yet",
        "error: cannot connect",
    ]


def test_a_notice_is_a_json_record_when_the_process_logs_json(
    root_handler: logging.Handler, caplog: pytest.LogCaptureFixture
) -> None:
    root_handler.setFormatter(JsonFormatter())
    with caplog.at_level(logging.INFO, logger="errands.cli"):
        notice("ERRANDS_URL is not used")
        notice("cannot connect", "error")
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [
        ("errands.cli", "WARNING", "ERRANDS_URL is not used"),
        ("errands.cli", "ERROR", "cannot connect"),
    ]
    root_handler.setFormatter(TextFormatter())  # text logging: the plain line again
    caplog.clear()
    notice("plain")
    assert caplog.records == []


def test_a_json_worker_that_cannot_reach_its_store_says_so_in_one_json_line(
    tmp_path: Path,
) -> None:
    (tmp_path / "shop.py").write_text("import errands\n\napp = errands.App()\n")
    done = subprocess.run(
        [sys.executable, "-m", "errands", "worker", "shop:app", "--log-format", "json",
         "--url", "postgresql://postgres@127.0.0.1:1/nothing"],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    [record] = [json.loads(line) for line in done.stderr.splitlines() if line.strip()]
    assert record["level"] == "error" and record["logger"] == "errands.cli", record
    assert "cannot connect to PostgreSQL" in record["message"], record
