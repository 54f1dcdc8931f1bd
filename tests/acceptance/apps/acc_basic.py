"""The acceptance tests' main app: a short lease so lost workers are noticed in seconds.

Job names are explicit, so the test process and the worker processes agree on them
however the module is imported. The store comes from ``ERRANDS_URL``.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
from typing import Any

from acc_support import EFFECTS_ENV, connect, record, runs

import errands

LEASE = 2.0
QUICK_BACKOFF = 0.1  # rescued or failed jobs come back at once: tests wait on nothing else

app = errands.App(lease=LEASE)


@app.job(name="sleepy", retries=3, backoff=QUICK_BACKOFF)
def sleepy(ctx: errands.Context, seconds: float, first_only: bool = False) -> dict[str, Any]:
    """Sleep ``seconds`` (ignoring cancellation, like a blocking call); with ``first_only``
    only on attempt 1, so a rescued retry finishes at once."""
    record(ctx)
    if not first_only or ctx.attempt == 1:
        time.sleep(seconds)
    return {"attempt": ctx.attempt, "pid": os.getpid(), "worker": ctx.worker_id}


@app.job(name="rendezvous", retries=3, backoff=QUICK_BACKOFF)
def rendezvous(ctx: errands.Context, expected: int, patience: float = 60.0) -> dict[str, Any]:
    """Wait until ``expected`` rendezvous runs have begun (``patience`` s at most): they
    all complete met only if they all ran at once."""
    record(ctx)
    record(ctx, "meet")
    deadline = time.monotonic() + patience
    while (seen := runs("meet")) < expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return {"met": seen >= expected, "pid": os.getpid()}


@app.job(name="noop", retries=3, backoff=QUICK_BACKOFF)
def noop(ctx: errands.Context, n: int = 0) -> int:
    record(ctx)
    return n


@app.job(name="switch_interval", retries=0)
def switch_interval(ctx: errands.Context, meet: int = 0) -> list[float]:
    """[this process's pid, the GIL's switch interval where the handler runs, the
    collector's young threshold there, how many objects it froze]; with ``meet``, once
    that many of these runs have begun (they ran at once: one a slot)."""
    if meet:
        record(ctx, "switch_meet")
    deadline = time.monotonic() + 30
    while runs("switch_meet") < meet and time.monotonic() < deadline:
        time.sleep(0.02)
    return [os.getpid(), sys.getswitchinterval(), gc.get_threshold()[0], gc.get_freeze_count()]


@app.job(name="fail_first", retries=3, backoff=QUICK_BACKOFF)
def fail_first(ctx: errands.Context, label: str = "") -> str:
    """Dead on its first execution (Permanent); succeeds when run again (a DLQ replay)."""
    if record(ctx) == 0:
        raise errands.Permanent(f"{label or 'job'}: the first execution fails on purpose")
    return "replayed ok"


@app.job(name="crash", retries=5, backoff=QUICK_BACKOFF)
def crash(ctx: errands.Context) -> None:
    """Kills its own worker process, like a segfault or the OOM killer would."""
    record(ctx)
    os._exit(1)


@app.job(name="crash_once", retries=5, backoff=QUICK_BACKOFF)
def crash_once(ctx: errands.Context) -> int:
    """Kills its own worker process on its first run (a segfault, the OOM killer); its
    rescued run completes."""
    if record(ctx) == 0:
        os._exit(1)
    return ctx.attempt


@app.job(name="approval", retries=0)
def approval(ctx: errands.Context, order: int) -> dict[str, Any]:
    """Wait for signal ``approved`` (suspended, holding no slot, until it arrives)."""
    record(ctx)
    decision = ctx.wait_for_signal("approved", timeout=600)
    return {"order": order, "decision": decision, "pid": os.getpid()}


@app.job(name="reporting", retries=0)
def reporting(ctx: errands.Context, until: str) -> int:
    """Report progress in a tight loop, then wait (at most a minute) for file ``until``."""
    record(ctx)
    for page in range(1, 1001):
        ctx.progress(page / 1000, f"rendered {page} of 1000 pages")
    deadline = time.monotonic() + 60
    while not os.path.exists(until) and time.monotonic() < deadline:
        time.sleep(0.02)
    return os.getpid()


@app.job(name="fork_then_die", retries=0)
def fork_then_die(ctx: errands.Context, pidfile: str, seconds: float) -> None:
    """Fork a process that sleeps ``seconds`` holding every descriptor of this one (the
    worker child's pipe too, as a multiprocessing pool or a shell would), then die."""
    record(ctx)
    pid = os.fork()
    if pid == 0:
        time.sleep(seconds)
        os._exit(0)
    with open(pidfile, "w") as out:
        out.write(str(pid))
    os._exit(7)


@app.job(name="terminates_its_subprocess", retries=0)
def terminates_its_subprocess(ctx: errands.Context) -> int | None:
    """Start a program, stop it with SIGTERM, and return its exit status."""
    record(ctx)
    program = subprocess.Popen(["sleep", "30"])
    time.sleep(0.2)
    program.terminate()
    try:
        return program.wait(timeout=10)
    except subprocess.TimeoutExpired:
        program.kill()
        return None


@app.job(name="closes_its_descriptors", retries=2, backoff=QUICK_BACKOFF)
def closes_its_descriptors(ctx: errands.Context, seconds: float, ends: str) -> None:
    """Close every inherited descriptor as daemonising code does (the worker child's pipe
    and its sentinel too), open pipes that take their numbers, then sleep ``seconds`` and
    append this process's pid to file ``ends``. Its run is recorded first, with an
    ``overlap`` effect when an earlier run of the job still runs then."""
    conn = connect(os.environ[EFFECTS_ENV])  # (closed before the descriptors go)
    try:
        earlier = [pid for (pid,) in conn.execute(
            "SELECT pid FROM effects WHERE job_id = ? AND kind = 'run'", (ctx.job_id,)
        )]  # fmt: skip
        rows = [("run", os.getpid())]
        rows += [("overlap", pid) for pid in earlier if _running(pid)]
        for kind, pid in rows:
            conn.execute(
                "INSERT INTO effects (job_id, attempt, pid, worker, kind, at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (ctx.job_id, ctx.attempt, pid, ctx.worker_id, kind, time.time()),
            )
    finally:
        conn.close()
    os.closerange(3, 1024)
    taken = [os.pipe() for _ in range(8)]  # noqa: F841 (held open while it sleeps)
    time.sleep(seconds)
    with open(ends, "a") as out:
        out.write(f"{os.getpid()}\n")


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False
