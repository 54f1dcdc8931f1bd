"""Two operators edit the same pending jobs at once, on real PostgreSQL locks.

``app.edit`` locked its jobs one by one in the caller's order, in a transaction that was
not run again when the server broke a lock cycle: two edits of the same ids in opposite
orders each held half of them and waited for the other's, and one got a raw
``DeadlockDetected`` (``errands jobs edit`` printed a traceback). The jobs are locked in
id order, as a replay and a discard run, in a transaction that runs again when the store
aborts it to break a cycle.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

import errands
from errands.backends.base import ActionResult

JOBS = 3_000


@pytest.fixture
def app(pg_url: str) -> Iterator[errands.App]:
    app = errands.App(pg_url)
    try:
        yield app
    finally:
        app.close()


def edit_at_once(app: errands.App, edits: dict[str, tuple[list[int], int]]) -> dict[str, Any]:
    """Each ``actor: (ids, priority)`` edit in a thread of its own, started together: what
    each returned, or raised."""
    barrier = threading.Barrier(len(edits))
    outcomes: dict[str, Any] = {}

    def edit(actor: str, ids: list[int], priority: int) -> None:
        try:
            barrier.wait()
            outcomes[actor] = app.edit(ids, priority=priority, actor=actor)
        except BaseException as exc:  # handed to the test
            outcomes[actor] = exc

    threads = [threading.Thread(target=edit, args=(a, *e)) for a, e in edits.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not any(t.is_alive() for t in threads), "an edit is still blocked"
    return outcomes


def test_two_edits_of_the_same_jobs_in_opposite_orders_both_succeed(app: errands.App) -> None:
    @app.job(name="edit.target", queue="held")
    def target(n: int) -> None: ...

    ids = [h.id for h in app.enqueue_many([target.bind(n=n) for n in range(JOBS)])]
    for round_ in range(3):
        up, down = 10 + round_, 20 + round_
        outcomes = edit_at_once(app, {"up": (ids, up), "down": (ids[::-1], down)})
        for outcome in outcomes.values():
            assert isinstance(outcome, ActionResult), outcome  # not DeadlockDetected
            assert (outcome.matched, outcome.skipped) == (sorted(ids), {})
        priorities = {j.priority for j in app.jobs(queue="held", limit=JOBS)}
        assert len(priorities) == 1 and priorities <= {up, down}
