"""The order a worker's prefetched jobs wait in for a handler thread (issue 19): a fair
queue's job whose key has none waiting goes first, within bounds."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from errands.jobs import JobRow
from errands.worker.dispatch import Dispatcher


def _row(queue: str, key: str | None, rescues: int = 0) -> JobRow:
    return JobRow(1, "job", queue, "{}", "{}", "running", 0, 1, 3, 0.0, None, "[]", None,
                  0.0, 0.0, None, "w", "t", 0.0, rescues, 0, None, None, None, None, None,
                  None, None, None, None, None, key)  # fmt: skip


def _dispatcher(concurrency: int) -> Any:
    worker = SimpleNamespace(concurrency=concurrency, shares_slots=False,
                             claimer=SimpleNamespace(prefetching={"fair"}))  # fmt: skip
    return Dispatcher(worker)  # type: ignore[arg-type]


def test_at_most_concurrency_fair_jobs_go_ahead_before_the_oldest_waiting_one_begins() -> None:
    d = _dispatcher(2)
    first = d._goes_first(_row("fair", "noisy"))
    assert first[1] is True  # nothing waits: first, passing nobody
    waiting = d._goes_first(_row("fair", "noisy"))
    assert waiting[1] is False  # its key has one waiting: in arrival order
    ahead = [d._goes_first(_row("fair", f"quiet{n}"))[1] for n in range(4)]
    assert ahead == [True, True, False, False]  # two go ahead, then arrival order again
    d._begins("fair", waiting[0], waiting[1])  # the oldest one in order begins
    assert d._goes_first(_row("fair", "quiet9"))[1] is True


def test_a_fair_job_never_goes_ahead_of_another_queues_waiting_job() -> None:
    d = _dispatcher(8)
    plain = d._goes_first(_row("plain", None))
    assert plain == (None, False)
    assert d._goes_first(_row("fair", "quiet"))[1] is False
    d._begins("plain", None, False)
    # only the fair queue's "quiet" waits now: a job of another key may go ahead of it
    assert d._goes_first(_row("fair", "other"))[1] is True


def test_a_rescued_job_goes_first_whatever_its_queue() -> None:
    d = _dispatcher(1)
    d._goes_first(_row("plain", None))
    assert d._goes_first(_row("plain", None, rescues=1))[1] is True


def test_a_worker_without_a_prefetching_fair_queue_keeps_arrival_order_and_counts_nothing() -> None:
    worker = SimpleNamespace(
        concurrency=2, shares_slots=False, claimer=SimpleNamespace(prefetching=set())
    )
    d: Any = Dispatcher(worker)  # type: ignore[arg-type]
    assert d._goes_first(_row("plain", None)) == (None, False)
    assert d._goes_first(_row("plain", "tenant")) == (None, False)
    assert d._goes_first(_row("plain", None, rescues=1)) == (None, True)
    d._begins("plain", None, False)
    assert not d._waiting_queues and not d._waiting_keys
