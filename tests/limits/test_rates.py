"""Rate limits per queue (``app.queue("hooks", rate="20/s")``) and per job type
(``@app.job(rate="20/s")``), cluster-wide (item 4).

Semantics: a sliding window over ``errands_rate_log``, where every claim of a
rate-limited queue or job type logs one row per job it starts, by the database clock. A
claim takes at most N minus the starts logged in the last period, so **at most N jobs
start in any window of the period**, whatever the number of workers. Under a backlog the
starts come in bursts of N: a claim held back by the window tells the worker when the
window frees up, and the worker claims again at that moment rather than at its next poll,
so the observed rate is N per period even with a poll interval close to the period.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import errands
from errands.backends.limits import format_rate, parse_rate
from errands.errors import ConfigurationError

from .helpers import Intervals, most_in_window, wait_until, workers

RATE = 20
WINDOW = 10.0


def observed_rate(starts: list[float]) -> float:
    """Starts per second in [t0, t0 + 10 s), t0 being the first start."""
    t0 = starts[0]
    return sum(1 for t in starts if t0 <= t < t0 + WINDOW) / WINDOW


def test_queue_rate_and_job_type_rate_of_20_per_second_hold_within_10_percent_over_10_s(
    store: errands.App,
) -> None:
    """Given a queue limited to 20/s and, in another queue, a job type limited to 20/s
    beside an unlimited one, with backlogs of 260 and two workers of 30 slots: over the
    10 s from each first start, 20/s ±10 % started; no window of 1 s (by the database
    clock) holds more than 20 starts of either; the unlimited job type is not held back.
    """
    runs = Intervals()

    def define(app: errands.App) -> None:
        app.queue("hooks", rate="20/s")
        app.job(name="hooks.deliver", queue="hooks")(deliver)
        app.job(name="api.call", queue="api", rate="20/s")(call)
        app.job(name="api.log", queue="api")(log_line)

    def deliver(n: int) -> None:
        with runs.run("queue-rate"):
            pass

    def call(n: int) -> None:
        with runs.run("job-rate"):
            pass

    def log_line(n: int) -> None:
        with runs.run("free"):
            pass

    define(store)
    peer = errands.App(store.url)
    define(peer)
    jobs = [store.registry["hooks.deliver"].bind(n=i) for i in range(260)]
    calls = [store.registry["api.call"].bind(n=i) for i in range(260)]
    for i in range(60):  # interleaved, so the claim's look-ahead always sees some
        calls.insert(i * 4, store.registry["api.log"].bind(n=i))
    store.enqueue_many(jobs + calls)
    try:
        # A coarse poll (0.6 s against a 1 s period) on purpose: the window's wake-up,
        # not the poll, must pace the claims.
        with workers([store, peer], concurrency=30, poll_interval=0.6):
            wait_until(
                lambda: runs.start_times("queue-rate") and runs.start_times("job-rate"),
                30,
                "the first starts",
            )
            t0 = max(runs.start_times("queue-rate")[0], runs.start_times("job-rate")[0])
            time.sleep(max(0.0, t0 + WINDOW + 0.3 - time.monotonic()))
    finally:
        peer.close()

    for label in ("queue-rate", "job-rate"):
        rate = observed_rate(runs.start_times(label))
        assert RATE * 0.9 <= rate <= RATE * 1.1, f"{label}: observed {rate}/s"
    free = runs.start_times("free")
    assert len(free) == 60
    assert free[-1] - free[0] < 3.0, "the unlimited job type must not wait for the rate"
    for name in ("hooks.deliver", "api.call"):
        claimed = [
            j.attempted_at.timestamp() for j in store.jobs(name=name, limit=300) if j.attempted_at
        ]
        assert most_in_window(claimed, 1.0) <= RATE, name


def test_rate_strings_parse_and_bad_ones_fail_at_declaration(tmp_path: Path) -> None:
    assert parse_rate("100/m") == (100, 60.0)
    assert parse_rate("20/s") == (20, 1.0)
    assert parse_rate("5/h") == (5, 3600.0)
    assert parse_rate("1000/d") == (1000, 86400.0)
    assert parse_rate("10/30s") == (10, 30.0)
    assert format_rate(*parse_rate("10/30s")) == "10/30s"
    app = errands.App(f"sqlite:///{tmp_path}/errands.db")
    for bad in ("20", "20/fortnight", "0/s", "5/2d", "-1/s"):
        with pytest.raises(ConfigurationError, match="rate="):
            app.queue("hooks", rate=bad)
    with pytest.raises(ConfigurationError, match="rate="):

        @app.job(name="bad.rate", rate="fast")
        def bad() -> None: ...

    assert app.queues == {}
    assert app.registry == {}
