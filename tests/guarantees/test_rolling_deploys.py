"""Rolling deploys: a worker never claims a job type its code does not define (issue 21,
"Rolling deploys"). A job a newer release enqueued waits, uncharged, for a worker that
knows it, and ``errands status`` names it meanwhile. Both backends, real workers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from click.testing import CliRunner

import errands
from errands.cli.main import cli
from errands.jobs import JobState
from tests.conftest import running_worker


def test_a_job_type_the_worker_does_not_define_waits_uncharged_for_one_that_does(
    store: errands.App, worker: Callable[..., Any]
) -> None:
    """Given a worker running the old release's code, when the new release enqueues a job
    type that code does not define, then the worker never claims it (attempt 0, no error,
    still available while it runs other jobs), status lists it as waiting for a worker
    that defines it, and a worker running the new code runs it on its first attempt."""

    @store.job(name="deploy.old")
    def old(n: int) -> int:
        return n

    newer = errands.App(store.url, lease=3)

    @newer.job(name="deploy.new")
    def new(n: int) -> int:
        return n * 10

    @newer.job(name="deploy.old")
    def old_again(n: int) -> int:
        return n

    try:
        ghost = new.enqueue(n=4)
        with worker(concurrency=2):
            assert old.enqueue(n=1).result(timeout=30) == 1  # it claims what it knows...
            assert old.enqueue(n=2).result(timeout=30) == 2
            job = ghost.job()
            assert (job.state, job.attempt, job.errors) == (JobState.AVAILABLE, 0, [])
            assert store.unrunnable_jobs() == {"deploy.new": 1}
            shown = CliRunner().invoke(cli, ["status", "--url", store.url])
            assert shown.exit_code == 0, shown.output
            assert "no live worker does): deploy.new (1)" in shown.output
            with running_worker(newer):
                assert ghost.result(timeout=30) == 40
        assert ghost.job().attempt == 1
        assert store.unrunnable_jobs() == {}
    finally:
        newer.close()
