"""Jobs registered while a worker of the App starts and runs (an embedded worker, modules
imported late): the worker's threads read the registry while it grows."""

from __future__ import annotations

import threading

import errands
from tests.conftest import running_worker


def test_a_worker_starts_and_runs_while_another_thread_registers_jobs(
    app: errands.App,
) -> None:
    """A worker starting while the code registers jobs on another thread starts, and
    runs the jobs. Its start iterated the registry while it grew, and died on "dictionary
    changed size during iteration" (seen in CI: the test registering a job as its worker
    started)."""

    @app.job(name="reg.first")
    def first() -> str:
        return "ran"

    stop = threading.Event()
    registered: list[int] = []

    def register_more() -> None:
        n = 0
        while not stop.is_set() and n < 3_000:
            app.job(name=f"reg.late_{n}")(lambda: None)
            registered.append(n)
            n += 1

    for _ in range(5):  # each start races the registrations
        registering = threading.Thread(target=register_more, daemon=True)
        stop.clear()
        registering.start()
        try:
            with running_worker(app, concurrency=2, maintenance=False):
                assert first.enqueue().result(timeout=30) == "ran"
        finally:
            stop.set()
            registering.join(30)
        app.registry = {"reg.first": app.registry["reg.first"]}  # the next round anew
    assert registered
