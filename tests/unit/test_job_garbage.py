"""A finished job leaves nothing for the garbage collector: its row, attempt, handler call,
Context and task are freed by reference counting once the worker is done with it. Each
job used to leave ~16 objects in reference cycles (the attempt and its handler call, the
attempt and its Context's runtime, a failure's traceback and the frame that caught it),
and the full collections that found them took ~40 % of a busy worker's CPU
(src/errands/worker/collector.py). The worker runs in a process of its own, with the
collector off and every unreachable object kept (``gc.DEBUG_SAVEALL``), for each kind of
job: sync and async, returning, failing, retried, taking ``ctx``, in ``ctx.transaction()``
(an async one's outcome is committed on a thread of its own)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from errands.worker.execution import Attempt
from tests.unit.test_fair_outcome import ROW

SCRIPT = """
import collections, gc, json, sys, threading
import errands
from errands.worker.worker import Worker

app = errands.App(sys.argv[1])

@app.job(name="plain")
def plain(n: int) -> int:
    return n

@app.job(name="plain_async")
async def plain_async(n: int) -> int:
    return n

@app.job(name="fails", retries=0)
def fails(n: int) -> None:
    raise ValueError("fails on purpose")

@app.job(name="fails_async", retries=0)
async def fails_async(n: int) -> None:
    raise ValueError("fails on purpose")

@app.job(name="retried", retries=2, backoff=lambda attempt: 0.0)
def retried(n: int) -> None:
    raise ValueError("fails on purpose")

@app.job(name="with_ctx")
def with_ctx(n: int, ctx: errands.Context) -> None:
    ctx.progress(0.5, "half")

@app.job(name="with_ctx_async")
async def with_ctx_async(n: int, ctx: errands.Context) -> None:
    ctx.progress(0.5, "half")

@app.job(name="in_transaction")
def in_transaction(n: int, ctx: errands.Context) -> None:
    ctx.transaction().execute("SELECT 1")

@app.job(name="in_transaction_async")
async def in_transaction_async(n: int, ctx: errands.Context) -> None:
    tx = await ctx.atransaction()
    await tx.execute("SELECT 1")

kinds = [plain, plain_async, fails, fails_async, retried, with_ctx, with_ctx_async,
         in_transaction, in_transaction_async]
handles = app.enqueue_many([kind.bind(i) for kind in kinds for i in range(int(sys.argv[2]))])
worker = Worker(app, concurrency=4)
gc.collect()
gc.disable()
gc.set_debug(gc.DEBUG_SAVEALL)
thread = threading.Thread(target=lambda: worker.run(install_signals=False))
thread.start()
completed = collections.Counter()
for handle in handles:
    try:
        handle.result(timeout=60)
        completed[handle.name] += 1
    except errands.JobFailed:
        pass
worker.stop()
thread.join(60)
gc.collect()
ours = collections.Counter(
    type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("errands")
)
print(json.dumps({"garbage": len(gc.garbage), "errands": ours, "jobs": len(handles),
                  "completed": completed}))
"""


@pytest.mark.timeout(120)
def test_a_finished_job_leaves_no_reference_cycle_for_the_garbage_collector(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'garbage.db'}"
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, url, "20"],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["jobs"] == 180
    every = 20
    assert found["completed"] == {
        name: every
        for name in (
            "plain",
            "plain_async",
            "with_ctx",
            "with_ctx_async",
            "in_transaction",
            "in_transaction_async",
        )
    }, found
    assert found["errands"] == {}, found
    # what the worker's own start and stop leave, not a share of each job (16 a job before)
    assert found["garbage"] < 180, found


@pytest.mark.parametrize("first", ["written", "handler_over"])
def test_an_attempt_lets_go_of_its_context_and_handler_only_after_both_ends(first: str) -> None:
    """Written while its handler still runs (abandoned past its timeout: the lease keeper
    may still abandon its thread, cancel its task, set its ctx.cancelled), or its handler
    over before the outcome is written: the attempt keeps them until the other end."""
    attempt = Attempt(row=ROW, definition=None, lease_seconds=30.0)
    ctx, runtime, call, task = object(), object(), object(), object()
    attempt.ctx, attempt.runtime = ctx, runtime  # type: ignore[assignment]
    attempt.future, attempt.task = call, task  # type: ignore[assignment]
    ends = {"written": attempt.outcome_written, "handler_over": attempt.handler_over}
    ends[first]()
    assert (attempt.ctx, attempt.runtime, attempt.future, attempt.task) == (
        ctx,
        runtime,
        call,
        task,
    )
    ends["handler_over" if first == "written" else "written"]()
    assert (attempt.ctx, attempt.runtime, attempt.future, attempt.task) == (None,) * 4
