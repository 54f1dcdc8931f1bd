"""A handler's result over ``App(max_result_bytes=...)`` is refused where it is encoded
(in the child process, with ``--pool process``): the job is dead at once, its error
naming the limit, and the result never crosses the pipe nor reaches the store. A 200 MB
result was stored, its worker at 465 MB of memory."""

from __future__ import annotations

import importlib
import secrets
import threading
from pathlib import Path

import pytest

import errands

pytestmark = pytest.mark.acceptance

APP = """
import os

import errands

app = errands.App(max_result_bytes=10_000)


@app.job(name="sized", retries=3)
def sized(size: int) -> dict:
    return {"pid": os.getpid(), "text": "x" * size}
"""


@pytest.mark.parametrize("pool", ["thread", "process"])
def test_a_result_over_max_result_bytes_fails_the_job_at_once_naming_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pool: str
) -> None:
    name = f"sized_app_{secrets.token_hex(4)}"
    (tmp_path / f"{name}.py").write_text(APP)
    monkeypatch.syspath_prepend(str(tmp_path))
    app: errands.App = importlib.import_module(name).app
    app.url = f"sqlite:///{tmp_path}/store.db"
    small = app.registry["sized"].enqueue(size=1_000)
    big = app.registry["sized"].enqueue(size=50_000)
    worker = app.worker(concurrency=1, pool=pool, app_path=f"{name}:app", poll_interval=0.05)
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        assert len(small.result(timeout=60)["text"]) == 1_000
        with pytest.raises(errands.JobFailed):
            big.result(timeout=60)
    finally:
        worker.stop()
        thread.join(30)
    job = big.job()
    app.close()
    assert (job.state.value, job.attempt, job.result) == ("dead", 1, None)
    [error] = job.errors
    assert (error.type, error.kind) == ("InvalidPayload", "permanent")
    assert "over the limit of 10,000 (App(max_result_bytes=...))" in error.message
