"""Nothing that stops a process-pool attempt (``--pool process``) on the worker's side
costs the pool a child: the child is given back, or killed and replaced.

The worker stops a handler thread by raising HandlerInterrupt inside it (a timeout's
second step, a graceful stop's end of grace: ``ThreadRunner.interrupt``); for a
process-pool attempt that thread hands the job to the pool and waits for the child's
answer. The tests aim that interrupt, the worker's own way, at the instant it hurt most
(chosen with a profile hook on the handler thread, which changes nothing of the code it
watches), in a real worker with a real child process and one slot.
"""

from __future__ import annotations

import importlib
import secrets
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import errands
from errands.backends.base import ClaimParams, QueueClaim
from errands.worker.dispatch import Dispatcher
from errands.worker.process_pool import ChildFailure, ProcessRunner
from errands.worker.worker import Worker

pytestmark = pytest.mark.acceptance

HANGS_FIRST = """
import os
import time

import errands

app = errands.App()


@app.job(name="hangs_first", retries=3, backoff=0.05)
def hangs_first(ctx: errands.Context) -> int:
    if ctx.attempt == 1:
        time.sleep(60)
    return os.getpid()


@app.job(name="reports")
def reports(ctx: errands.Context) -> int:
    ctx.progress(0.5, "half way")
    return os.getpid()
"""

# Where the interrupt lands: the call that hands the job to the pool (ProcessRunner.submit
# starting a thread), or the wait for the child's answer.
INSTANTS = {
    "handing_over": (threading.Thread.start, ProcessRunner.submit),
    "waiting": (Future.result, Dispatcher._run_child),
}


def _aim_at(instant: str, worker: list[Worker], aimed: list[str]) -> Any:
    """A profile hook: in a handler thread, interrupt its attempt as ``instant`` comes."""
    called, caller = (f.__code__ for f in INSTANTS[instant])

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if not threading.current_thread().name.startswith("errands-job"):
            sys.setprofile(None)  # only the handler threads are watched
            return
        back = frame.f_back
        if event != "call" or aimed or frame.f_code is not called or back is None:
            return
        if back.f_code is caller:
            aimed.append(instant)  # (the interrupt may land before the next line runs)
            [attempt] = worker[0].attempts()
            worker[0].threads.interrupt(attempt.future)  # type: ignore[arg-type]

    return hook


def _app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, errands.App]:
    """The jobs above, in a module of their own (children import it afresh), on a store."""
    name = f"hangs_app_{secrets.token_hex(4)}"
    (tmp_path / f"{name}.py").write_text(HANGS_FIRST)
    monkeypatch.syspath_prepend(str(tmp_path))
    app = importlib.import_module(name).app
    app.url = f"sqlite:///{tmp_path}/store.db"
    return name, app


@pytest.mark.parametrize("instant", list(INSTANTS))
def test_an_interrupt_landing_in_a_process_attempts_thread_leaves_the_pool_its_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, instant: str
) -> None:
    """Given a worker with one child process, when HandlerInterrupt lands in the thread of
    a job's first attempt (a 60 s sleep) as it hands the job to the pool, or as it waits
    for the answer, then that attempt is recorded as interrupted and its retry runs in a
    child at once. Landing as the job was handed over, it left the child taken and never
    given back (the pool had no child for ever after); landing in the wait, it left the
    child running the attempt given up on, the retry waiting behind it."""
    name, app = _app(tmp_path, monkeypatch)
    handle = app.registry["hangs_first"].enqueue()
    holder: list[Worker] = []
    aimed: list[str] = []
    threading.setprofile(_aim_at(instant, holder, aimed))  # the handler threads start now
    try:
        worker = app.worker(
            concurrency=1, pool="process", app_path=f"{name}:app", poll_interval=0.05, grace=1
        )
        holder.append(worker)
        thread = threading.Thread(target=worker.run, kwargs={"install_signals": False})
        thread.start()
        try:
            handle.result(timeout=60)
            job = app.get_job(handle.id)
        finally:
            worker.stop()
            thread.join(30)
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
        app.close()
    assert aimed == [instant]
    assert (job.attempt, [e.type for e in job.errors]) == (2, ["HandlerInterrupt"])


def test_a_progress_callback_that_raises_fails_its_job_and_the_child_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a runner of one child, when the caller's progress callback raises as the
    child reports, then the job fails (its child may still run it: killed and replaced)
    and the next job runs in a fresh child. The runner's thread died with the error: the
    job never got an answer, and its child stayed busy for ever."""
    name, app = _app(tmp_path, monkeypatch)
    app.registry["reports"].enqueue()
    app.registry["reports"].enqueue()
    rows = app.backend.job_claim(ClaimParams([QueueClaim("default", 2)], 2, "test", 30.0))
    first, second = sorted(rows, key=lambda r: r.id)
    runner = ProcessRunner(f"{name}:app", app.url, 1)
    try:
        [child] = runner.pids()

        def refuse(report: tuple[float, str]) -> None:
            raise RuntimeError("the caller cannot take this report")

        with pytest.raises(ChildFailure, match="cannot take this report") as failed:
            runner.submit(first, on_progress=refuse).result(30)
        assert failed.value.kind == "transient"
        answer = runner.submit(second).result(30)
        assert int(answer.result_json) != child and runner.pids() != [child]
    finally:
        runner.shutdown()
        app.close()
