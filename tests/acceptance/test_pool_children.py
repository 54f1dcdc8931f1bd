"""A worker's child processes (``--pool process``) and what they record: failures at the
edges of a child's job loop are the job's own, and the child lives on (real ``errands
worker`` processes on SQLite)."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import socket
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

import acc_pool
import pytest

import errands

from .harness import Cluster, Proc, children_of, pid_running, wait_until

pytestmark = pytest.mark.acceptance


def _pool_worker(cluster: Cluster) -> int:
    """A worker with one child process, and that child's pid (it has run a job)."""
    cluster.app("acc_pool")
    cluster.start_worker("--pool", "process", "-c", "1", app="acc_pool:app", label="worker")
    return int(acc_pool.child_pid.enqueue().result(timeout=60))


def test_a_job_type_the_childs_app_lacks_is_retried_with_backoff_naming_the_fix(
    cluster: Cluster,
) -> None:
    """Given a worker whose children load an app without a job type the worker has (as
    after a deploy whose newer code a child imported from disk), when such a job runs,
    then each attempt fails transiently (UnknownJob, naming the type and saying the
    child's app must define it) and is retried with backoff, as the worker's own
    UnknownJob is, until its attempts run out; the same child runs the next job. It was
    recorded permanent: dead at once, in the dead-letter queue, on the first attempt."""
    child = _pool_worker(cluster)
    handle = acc_pool.parent_only.enqueue()  # retries=3, backoff=0.1
    wait_until(lambda: cluster.state_of(handle.id) == "dead", 60, "the job to be dead")
    errors = handle.job().errors
    assert [(e.type, e.kind) for e in errors] == [("UnknownJob", "transient")] * 4
    assert "'parent_only'" in errors[0].message and "'acc_pool:app'" in errors[0].message
    assert "The child's app must define it" in errors[0].message
    assert acc_pool.child_pid.enqueue().result(timeout=60) == child


def test_an_exception_whose_str_raises_is_the_jobs_failure_and_the_child_lives_on(
    cluster: Cluster,
) -> None:
    """Given a handler in a child that raises an exception whose ``__str__`` raises, then
    the attempt is recorded as that exception (kind transient, not a crash), its message
    ``<unprintable Unprintable>``, and the same child runs the next job. Formatting the
    message ended the child: the job was recorded as the child's death (WorkerProcessDied,
    counted toward its poison limit)."""
    child = _pool_worker(cluster)
    handle = acc_pool.unprintable.enqueue()
    wait_until(lambda: cluster.state_of(handle.id) == "dead", 60, "the job to be dead")
    [error] = handle.job().errors
    assert (error.type, error.kind) == ("Unprintable", "transient")
    assert error.message == "<unprintable Unprintable>"
    assert "Unprintable" in (error.traceback or "")
    assert acc_pool.child_pid.enqueue().result(timeout=60) == child


def test_a_huge_exception_message_in_a_child_is_stored_clipped_and_scrubbed_whole(
    cluster: Cluster,
) -> None:
    """Given a handler in a child raising an exception whose message is 2 million
    characters and quotes a sensitive argument where it is cut, then its error entry
    keeps the message's head (at most MESSAGE_LIMIT characters, saying how many were
    cut), no part of the argument, and a traceback naming the handler's frame; the
    child lives on. The child sent the whole message through its pipe, and it was stored
    whole."""
    from errands.errortext import MESSAGE_LIMIT, TRACEBACK_LIMIT

    child = _pool_worker(cluster)
    secret, at, size = "tok-0123456789abcdef", MESSAGE_LIMIT - 50, 2_000_000
    handle = acc_pool.huge_message.enqueue(token=secret, at=at, size=size)
    wait_until(lambda: cluster.state_of(handle.id) == "dead", 60, "the job to be dead")
    [error] = handle.job().errors
    assert (error.type, error.kind) == ("RuntimeError", "transient")
    assert len(error.message) <= MESSAGE_LIMIT
    match = re.search(r"… \((\d+) more characters\)$", error.message)
    assert match and len(error.message) - len(match.group(0)) + int(match.group(1)) == (
        at + len("***") + size
    )
    assert secret[:6] not in error.message and secret[:6] not in (error.traceback or "")
    assert error.traceback and len(error.traceback) <= TRACEBACK_LIMIT + 4
    assert "in huge_message" in error.traceback
    assert acc_pool.child_pid.enqueue().result(timeout=60) == child


def test_a_handler_in_a_child_that_ended_its_transaction_and_failed_dies_once(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Given a handler in a child that commits errands' transaction through ``tx.raw``
    and then raises, then the job is dead after that one attempt (TransactionEnded), as
    in the worker's own threads: its committed writes are never repeated. The child
    recorded the ValueError, transient, and the job ran its committed part 4 times."""
    _pool_worker(cluster)
    ran = tmp_path / "attempts"
    handle = acc_pool.commits_then_fails.enqueue(path=str(ran))
    wait_until(lambda: cluster.state_of(handle.id) == "dead", 60, "the job to be dead")
    job = handle.job()
    assert (job.attempt, job.last_error.type) == (1, "TransactionEnded")  # type: ignore[union-attr]
    assert ran.read_text().split() == ["1"]


def test_a_progress_report_sent_after_its_jobs_outcome_leaves_the_idle_child_in_service(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Given a handler in a child that returns leaving a thread that reports progress,
    when the report reaches the idle child's pipe after the job's outcome, then the next
    job runs in the same child. The report was taken for the end of a dead child's pipe:
    the child was stopped and replaced, the next job waiting 2-4 s for the stop."""
    child = _pool_worker(cluster)
    marker = tmp_path / "reported"
    assert acc_pool.reports_after_return.enqueue(marker=str(marker)).result(timeout=60) == child
    wait_until(marker.exists, 30, "the late progress report to be sent")
    assert acc_pool.child_pid.enqueue().result(timeout=60) == child
    worker = cluster.procs[0]
    assert "died while idle" not in worker.stderr()


def test_a_progress_report_sent_after_its_jobs_outcome_is_not_the_next_jobs_progress(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Given a child whose last handler left a thread that reports progress a second
    later, when that report arrives while the child runs the next job, then it is not
    stored as the next job's progress (it names its own attempt): two heartbeats after it
    was sent, the running job still has none."""
    child = _pool_worker(cluster)
    marker, release = tmp_path / "reported", tmp_path / "release"
    late = acc_pool.reports_after_return.enqueue(marker=str(marker), after=1.0)
    assert late.result(timeout=60) == child
    running = acc_pool.waits_for.enqueue(path=str(release))
    wait_until(marker.exists, 30, "the late progress report to be sent")
    assert cluster.state_of(running.id) == "running"

    def lease() -> float:
        return float(
            cluster.query("SELECT lease_expires_at FROM errands_jobs WHERE id = ?", (running.id,))[
                0
            ][0]
        )

    for _ in range(2):  # heartbeats that began after the report was read: they store it
        seen = lease()
        wait_until(lambda seen=seen: lease() > seen, 30, "the running job's next heartbeat")
    assert running.progress() is None
    release.touch()
    assert running.result(timeout=60) == child


def test_a_stale_attempts_progress_reports_never_erase_the_running_attempts_latest(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Given a child whose last handler left a thread reporting progress every
    millisecond, when the next job reports its progress once and then runs on, then that
    report is stored as the running job's progress. The stale thread's next report
    replaced it in the child's one held report within the throttle's 0.1 s: the running
    job's report was never sent, and the job showed no progress at all."""
    child = _pool_worker(cluster)
    release = tmp_path / "release"
    assert acc_pool.keeps_reporting.enqueue(seconds=30.0).result(timeout=60) == child
    running = acc_pool.reports_then_waits.enqueue(path=str(release))
    wait_until(
        lambda: running.progress() is not None,
        10,
        "the running job's progress stored",
        describe=lambda: f"{cluster.state_of(running.id)}: {running.progress()}",
    )
    assert running.progress() == errands.Progress(0.5, "the running attempt's")
    release.touch()
    assert running.result(timeout=60) == child


def _forkserver_faulty_worker(cluster: Cluster, fault: Path, mode: str, *options: str) -> Proc:
    """A worker whose forkserver dies as it starts while ``fault`` exists (``mode``:
    ``once``, the file then deleted; ``always``)."""
    fault.write_text(mode)
    cluster.app("acc_pool")
    return cluster.start_worker(
        "--pool", "process", *options, app="acc_pool:app",
        env={"ACC_FORKSERVER_FAULT": str(fault)},
    )  # fmt: skip


def _kill(*pids: int) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    for pid in pids:
        wait_until(lambda pid=pid: not pid_running(pid), 30, f"child {pid} to die")


def test_a_forkserver_that_failed_once_starts_the_next_child(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Given a worker whose forkserver dies once as it starts its first child, then that
    child is started with spawn (the worker is its parent), and the next child comes
    from a forkserver again (started afresh). One failure made every later child a
    spawned one, each importing the app itself, for the worker's life."""
    fault = tmp_path / "forkserver-fault"
    worker = _forkserver_faulty_worker(cluster, fault, "once", "-c", "1")
    first, parent = acc_pool.child_parent.enqueue().result(timeout=60)
    assert parent == worker.pid and not fault.exists()
    _kill(first)  # its replacement starts as the next job comes
    second, parent = acc_pool.child_parent.enqueue().result(timeout=60)
    assert second != first and parent != worker.pid
    assert len(Path(f"{fault}.deaths").read_text().splitlines()) == 1
    assert "the next tries the forkserver again" in worker.stderr()


def test_a_forkserver_failing_three_times_in_a_row_is_given_up_for_spawn_saying_so_once(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Given a worker whose forkserver dies each time it starts, then the first three
    children are each started with spawn after a forkserver attempt, the worker then says
    once that it starts its children with spawn from now on, and a later child is
    spawned without another attempt."""
    fault = tmp_path / "forkserver-fault"
    worker = _forkserver_faulty_worker(cluster, fault, "always", "-c", "3", "--suspect-lanes", "1")
    deaths = Path(f"{fault}.deaths")
    assert len(deaths.read_text().splitlines()) == 3  # one per child started with the worker
    spawned = [
        pid
        for pid in children_of(worker.pid)
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert len(spawned) == 3
    _kill(*spawned)  # the next job needs a child started
    child, parent = acc_pool.child_parent.enqueue().result(timeout=60)
    assert parent == worker.pid and child not in spawned
    assert len(deaths.read_text().splitlines()) == 3
    assert worker.stderr().count("with spawn from now on") == 1


def test_a_job_whose_child_cannot_start_is_released_uncharged_with_growing_pauses(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Given a worker whose children cannot start (its child died, and its app fails to
    load in a new one), when a job on its last attempt comes, then the job is released
    each time (available again, its attempt not charged, the reason recorded), the worker
    claims it again only after a pause that doubles, and once children start again the
    job completes on that same attempt. It was failed as a charged attempt: dead at once,
    in the dead-letter queue for a fault of the machine's."""
    fault = tmp_path / "child-start-fault"
    cluster.app("acc_pool")
    worker = cluster.start_worker(
        "--pool", "process", "-c", "1", app="acc_pool:app",
        env={"ACC_CHILD_START_FAULT": str(fault)},
    )  # fmt: skip
    child = acc_pool.child_pid.enqueue().result(timeout=60)
    fault.touch()
    _kill(child)
    handle = acc_pool.child_pid.enqueue()  # retries=0: a charged failure ends it
    wait_until(
        lambda: len(_releases(worker)) >= 3 or cluster.state_of(handle.id) == "dead",
        60,
        "the job released three times",
    )
    fault.unlink()
    assert handle.result(timeout=60) != child
    job = handle.job()
    # its releases in a row, for one reason, are one entry counting them
    [released] = job.errors
    assert job.attempt == 1 and released.kind == "released"
    assert released.times == len(_releases(worker)) >= 3
    assert "injected: this worker child cannot start" in released.message
    gaps = [b - a for a, b in itertools.pairwise(_releases(worker))]
    assert gaps[0] >= 0.9 and gaps[1] >= 1.9, gaps  # 1 s, then 2 s: no spin
    assert "cannot start" in worker.stderr()


def _releases(worker: Proc) -> list[float]:
    """When the worker released a job for want of a child (from its log lines)."""
    stamps = re.findall(
        r"^(\S+ \S+) .*released 1 job\(s\): no worker", worker.stderr(), re.MULTILINE
    )
    return [datetime.strptime(t, "%Y-%m-%d %H:%M:%S,%f").timestamp() for t in stamps]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_workflow_a_childs_transaction_settles_is_announced_by_the_worker(
    cluster: Cluster,
) -> None:
    """A member completing in its own ctx.transaction() in a child process: the child
    committed the fan-in, and the workflow it settled was announced by nobody (no
    errands.workflow.settled, the metric at 0; on threads it counts 1)."""
    port = _free_port()
    cluster.app("acc_pool")
    worker = cluster.start_worker(
        "--pool", "process", "-c", "1", "--metrics-port", str(port),
        "--metrics-addr", "127.0.0.1", app="acc_pool:app", label="worker",
    )  # fmt: skip
    app = cluster.app("acc_pool")
    batch = errands.Batch("settled-in-a-child")
    batch.add(acc_pool.in_transaction.bind(), name="member")
    handle = app.enqueue_workflow(batch)
    [pid] = handle.result(timeout=60).values()
    assert pid != worker.pid  # (ran in a child)

    def settled() -> float:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return 0.0
        pattern = r'errands_workflows_settled_total\{[^}]*state="succeeded"[^}]*\} (\S+)'
        found = re.search(pattern, text)
        return float(found.group(1)) if found else 0.0

    wait_until(lambda: settled() == 1.0, 30, "the settled workflow in the worker's metrics")


def test_a_childs_process_span_ends_with_its_handler_and_is_exported(
    cluster: Cluster, tmp_path: Path
) -> None:
    """With tracing installed in the children, a process-pool job's process span (opened
    by the handler wrapper in the child) was ended only by an outcome event, which a
    child never sees: never exported, and kept for the child's whole life."""
    spans = tmp_path / "spans.jsonl"
    cluster.app("acc_pool")
    cluster.start_worker(
        "--pool", "process", "-c", "1", app="acc_pool:app", label="worker",
        env=cluster.env(ACC_TRACE_FILE=str(spans)),
    )  # fmt: skip
    pid = acc_pool.child_pid.enqueue().result(timeout=60)

    def exported() -> list[dict[str, Any]]:
        if not spans.exists():
            return []
        return [json.loads(line) for line in spans.read_text().splitlines() if line.strip()]

    [span] = wait_until(exported, 30, "the child's process span to be exported")
    assert span["name"] == "process default"
    assert span["attributes"]["errands.job.outcome"] == "completed"
    assert pid != os.getpid()
