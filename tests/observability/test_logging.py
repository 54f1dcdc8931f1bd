"""Job-scoped logs: the user's own loggers carry the job, JSON output parses line by line,
and a sensitive argument appears in no log line, CLI output or stored error (issue 6)."""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import errands
from errands.cli.main import cli
from errands.observability.logcontext import JsonFormatter, TextFormatter
from tests.integration.helpers import wait_until

SECRET = "hunter2-correct-horse"

# The app the worker subprocess imports (and this test process enqueues with).
APP_MODULE = textwrap.dedent(
    """
    import asyncio
    import logging

    import errands

    app = errands.App()
    shop = logging.getLogger("shop")


    @app.job(name="shop.charge", sensitive={"card"}, retries=0)
    def charge(order: int, card: str) -> None:
        shop.info("charging order %s", order)
        if order == 3:
            raise ValueError(f"card {card} declined for order {order}")


    @app.job(name="shop.refund")
    async def refund(order: int) -> None:
        shop.info("refunding order %s", order)
        await asyncio.sleep(0.01)
        shop.warning("refunded order %s", order)
    """
)


def test_records_of_the_users_own_logger_carry_the_job_in_sync_and_async_handlers(
    app: errands.App, worker_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    shop = logging.getLogger("shop")

    @app.job(name="lg.sync")
    def sync_job(order: int) -> None:
        shop.info("sync order %s", order)

    @app.job(name="lg.thread")
    def thread_job(order: int) -> None:
        # as docs/observability.md says: a thread started in a copy of the job's context
        worker = threading.Thread(
            target=contextvars.copy_context().run, args=(shop.info, "thread order %s", order)
        )
        worker.start()
        worker.join()

    @app.job(name="lg.async", queue="async")
    async def async_job(order: int) -> None:
        shop.info("async order %s: start", order)
        await asyncio.sleep(0.02)  # other tasks interleave on the same loop
        shop.info("async order %s: done", order)

    handles = {f"sync order {n}": sync_job.enqueue(order=n) for n in (1, 2)}
    handles["thread order 5"] = thread_job.enqueue(order=5)
    for n in (3, 4):
        handle = async_job.enqueue(order=n)
        handles[f"async order {n}: start"] = handles[f"async order {n}: done"] = handle
    with worker_factory(queues="default,async", concurrency=4):
        for handle in handles.values():
            handle.result(timeout=10)
    shop.info("outside any job")

    records = {r.getMessage(): r for r in caplog.records if r.name == "shop"}
    assert set(records) == {*handles, "outside any job"}
    for message, handle in handles.items():
        record = records[message]
        assert (record.job_id, record.job_name, record.attempt) == (handle.id, handle.name, 1)
        as_json = json.loads(JsonFormatter().format(record))
        assert as_json["job_id"] == handle.id and as_json["logger"] == "shop"
        assert f"[job {handle.id} {handle.name}@" in TextFormatter().format(record)
    assert not hasattr(records["outside any job"], "job_id")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _import_app(folder: Path) -> Any:
    sys.path.insert(0, str(folder))
    try:
        import obs_shop

        return obs_shop
    finally:
        sys.path.remove(str(folder))


@pytest.mark.parametrize("pool", ["thread", "process"])
def test_a_json_worker_logs_parseable_lines_with_the_job_and_no_secret_anywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pool: str
) -> None:
    """A real ``python -m errands worker --log-format json --metrics-port`` process; with
    ``--pool process`` the sync handlers log from the worker's child processes (whose
    records had no job fields)."""
    (tmp_path / "obs_shop.py").write_text(APP_MODULE)
    url = f"sqlite:///{tmp_path}/shop.db"
    monkeypatch.setenv("ERRANDS_URL", url)
    shop = _import_app(tmp_path)
    try:
        charges = [shop.charge.enqueue(order=n, card=SECRET) for n in (1, 2, 3)]
        refund = shop.refund.enqueue(order=4)
        port = _free_port()
        stderr = (tmp_path / "worker.err").open("w+")
        env = {**os.environ, "ERRANDS_URL": url, "PYTHONPATH": str(tmp_path)}
        worker = subprocess.Popen(
            [sys.executable, "-m", "errands", "worker", "obs_shop:app", "--log-format", "json",
             "--log-level", "debug",  # the started lines (with masked arguments) are DEBUG
             "--poll-interval", "0.05", "--metrics-port", str(port),
             "--metrics-addr", "127.0.0.1", "--pool", pool],
            cwd=tmp_path, env=env, stderr=stderr, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            wait_until(
                lambda: (
                    all(h.job().state.value in ("completed", "dead") for h in charges)
                    and refund.job().state.value == "completed"
                ),
                timeout=20,
                what="the worker to run every job",
            )

            def scrape() -> str:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                        return str(r.read().decode())
                except OSError:
                    return ""

            metrics = wait_until(
                lambda: (text := scrape()) and 'outcome="dead"' in text and text,
                what="metrics with the dead job",
            )
            assert 'errands_jobs_completed_total{job="shop.charge",outcome="completed"' in metrics
            assert "process_cpu_seconds_total" in metrics  # the global registry
        finally:
            worker.send_signal(signal.SIGTERM)
            assert worker.wait(timeout=20) == 0
        stderr.seek(0)
        lines = [line for line in stderr.read().splitlines() if line.strip()]
        stderr.close()
    finally:
        shop.app.close()
        sys.modules.pop("obs_shop", None)

    records = [json.loads(line) for line in lines]  # every line is one JSON object
    by_message = {r["message"]: r for r in records if r["logger"] == "shop"}
    for n, handle in zip((1, 2, 3), charges, strict=True):
        assert by_message[f"charging order {n}"]["job_id"] == handle.id
        assert by_message[f"charging order {n}"]["job_name"] == "shop.charge"
    for message in ("refunding order 4", "refunded order 4"):
        assert by_message[message]["job_id"] == refund.id
        assert by_message[message]["queue"] == "default"
    events = {r.get("event") for r in records}
    assert {"errands.job.started", "errands.job.completed", "errands.job.dead"} <= events
    completed = [r for r in records if r.get("event") == "errands.job.completed"]
    assert all(isinstance(r["duration"], float) for r in completed)
    started = [r for r in records if r.get("event") == "errands.job.started"]
    assert any("card='***'" in r["message"] for r in started)
    assert SECRET not in "\n".join(lines)

    # the stored error and every CLI view of the job
    dead = charges[2].job()
    assert dead.state.value == "dead"
    assert dead.errors[-1].message == "card *** declined for order 3"
    assert SECRET not in (dead.errors[-1].traceback or "")
    runner = CliRunner()
    for args in (
        ["jobs", "show", str(dead.id)],
        ["jobs", "show", "--json", str(dead.id)],
        ["jobs", "list", "--json"],
        ["jobs", "list"],
        ["dlq", "show", str(dead.id)],
        ["dlq", "list", "--json"],
    ):
        result = runner.invoke(cli, [*args, "--url", url])
        assert result.exit_code == 0, (args, result.output)
        assert str(dead.id) in result.output
        assert SECRET not in result.output, args
    listed = json.loads(runner.invoke(cli, ["jobs", "list", "--json", "--url", url]).stdout)
    assert {j["args"].get("card") for j in listed if j["name"] == "shop.charge"} == {"***"}
