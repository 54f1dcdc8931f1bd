"""A worker started by a supervisor (``--processes N``) tells it once that it started,
and asks for no other event: a subscriber that wants every event had each job of a
supervised worker build its lifecycle events for nobody (issue 17: ~10 us of a no-op
job's CPU on a sync worker, twice that on an async one)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import errands
from errands.worker.supervisor import SupervisorLink, stop_with_supervisor


def test_a_supervised_workers_link_wants_its_started_event_alone_and_says_it_once(
    tmp_path: Path,
) -> None:
    errands_log = logging.getLogger("errands")
    level = errands_log.level
    errands_log.setLevel(logging.WARNING)  # as `--log-level warning`: no job line is wanted
    app = errands.App(f"sqlite:///{tmp_path}/s.db")
    lifeline_r, lifeline_w = os.pipe()
    ready_r, ready_w = os.pipe()
    try:
        worker = app.worker()
        link = SupervisorLink(pid=os.getpid(), lifeline=lifeline_r, ready=ready_w)
        stop_with_supervisor(worker, link)

        for name in ("errands.job.started", "errands.job.completed"):
            assert not app.events.wants(name), name
        assert app.events.wants("errands.worker.started")

        app.events.emit("errands.worker.started", worker_id="someone else")
        assert link.ready is not None  # another worker's start says nothing
        app.events.emit("errands.worker.started", worker_id=worker.id)
        assert link.ready is None
        assert os.read(ready_r, 16) == b"1"  # once, then the pipe is closed
        assert os.read(ready_r, 16) == b""
    finally:
        os.close(lifeline_w)  # the "supervisor" goes: the watch thread stops the worker
        os.close(ready_r)
        app.close()
        errands_log.setLevel(level)
