"""Results without polling: ``result_listener`` reports jobs that ended (by id, or "some
may have") once it listens, and ``job_states`` answers which watched jobs are over."""

from __future__ import annotations

import threading

from errands.backends import Backend

from .support import claim_one, finish, insert


def test_job_states_gives_the_state_of_each_existing_job(backend: Backend) -> None:
    """Unknown ids are left out; known ones carry their current state."""
    waiting = insert(backend, delay=3600)
    running = insert(backend)
    claim_one(backend)
    assert backend.job_states([waiting, running, 999_999]) == {
        waiting: "scheduled",
        running: "running",
    }
    assert backend.job_states([]) == {}


def test_job_get_many_reads_the_existing_jobs_of_a_list(backend: Backend) -> None:
    """One query returns each existing job's full row; unknown ids are left out."""
    first, second = insert(backend), insert(backend, delay=60)
    rows = {r.id: r for r in backend.job_get_many([first, second, 999_999])}
    assert set(rows) == {first, second}
    assert rows[second].state == "scheduled" and rows[first] == backend.job_get(first)
    assert backend.job_get_many([]) == []


def test_the_result_listener_reports_a_job_that_ends(backend: Backend) -> None:
    """Once listening, the commit of an outcome reaches on_done: with the job's id, or
    with None (ask job_states), within a moment."""
    job_id = insert(backend)
    seen: list[list[int] | None] = []
    reported = threading.Event()
    listened = threading.Event()

    def on_done(ids: list[int] | None) -> None:
        seen.append(ids)
        if ids is None or job_id in ids:
            reported.set()

    listener = backend.result_listener(on_done, listened.set)
    assert listener is not None, f"{type(backend).__name__}: no result listener"
    listener.start()
    try:
        assert listener.listening.wait(5), "the listener never started listening"
        row = claim_one(backend)
        reported.clear()
        assert finish(backend, row, "completed", result_json="1")
        assert reported.wait(5), f"no report of job {job_id}; saw {seen}"
        assert backend.job_states([job_id]) == {job_id: "completed"}
    finally:
        listener.stop()
