"""A worker's child processes (``--pool process``) and what they record: failures at the
edges of a child's job loop are the job's own, and the child lives on (real ``errands
worker`` processes on SQLite)."""

from __future__ import annotations

import acc_pool
import pytest

from .harness import Cluster, wait_until

pytestmark = pytest.mark.acceptance


def _pool_worker(cluster: Cluster) -> int:
    """A worker with one child process, and that child's pid (it has run a job)."""
    cluster.app("acc_pool")
    cluster.start_worker("--pool", "process", "-c", "1", app="acc_pool:app")
    return int(acc_pool.child_pid.enqueue().result(timeout=60))


def test_a_job_type_the_childs_app_lacks_fails_for_good_naming_the_fix_and_the_child_lives_on(
    cluster: Cluster,
) -> None:
    """Given a worker whose children load an app without a job type the worker has, when
    such a job runs, then it is dead at once (permanent: every retry would fail alike),
    its error names the type and says the child's app must define it, and the same
    child runs the next job. The child's KeyError ended it: the job was recorded as a
    crash, over and over, until it went dead as poison."""
    child = _pool_worker(cluster)
    handle = acc_pool.parent_only.enqueue()
    wait_until(lambda: cluster.state_of(handle.id) == "dead", 60, "the job to be dead")
    [error] = handle.job().errors
    assert (error.type, error.kind) == ("UnknownJob", "permanent")
    assert "'parent_only'" in error.message and "'acc_pool:app'" in error.message
    assert "the child's app must define it" in error.message
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
