"""The completer hands the queues a finish's fan-in released jobs into to the worker."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from errands.backends.base import FinishParams
from errands.worker.completer import Completer


class Backend:
    def __init__(self, released: set[str]) -> None:
        self.released = released
        self.writes = 0

    def job_finish_many(self, outcomes: list[FinishParams]) -> list[bool]:
        self.writes += 1
        return [True] * len(outcomes)

    def workflow_take_released(self) -> set[str]:
        released, self.released = self.released, set()
        return released

    def workflow_take_settled(self) -> list[Any]:
        return []


class App:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def workflows_settled(self, **_: Any) -> None: ...


OUTCOME = FinishParams(id=1, lease_token="t", state="completed")


def test_the_queues_a_finish_released_jobs_into_wake_the_worker_once_written() -> None:
    woken: list[set[str]] = []
    app: Any = App(Backend({"default"}))
    completer = Completer(app, lambda *_: None, on_released=woken.append)
    assert completer._store([(None, OUTCOME)]) == [((None, OUTCOME), True)]  # type: ignore[list-item]
    assert woken == [{"default"}]
    completer._store([(None, OUTCOME)])  # type: ignore[list-item]
    assert woken == [{"default"}]  # nothing released by this one


def test_a_wake_up_that_raises_never_writes_the_outcomes_again() -> None:
    def fail(queues: set[str]) -> None:
        raise RuntimeError("boom")

    backend = Backend({"default"})
    app: Any = App(backend)
    completer = Completer(app, lambda *_: None, on_released=fail)
    assert completer._store([(None, OUTCOME)]) == [((None, OUTCOME), True)]  # type: ignore[list-item]
    assert backend.writes == 1


def test_a_failed_batch_is_tried_again_within_a_second_and_logged_once_per_streak(
    monkeypatch: Any, caplog: Any
) -> None:
    """While the store is away the completer tries again at most RETRY_PAUSE_MAX (1 s)
    apart, so its outcomes are written within a second of the store's return (it was up
    to 10 s); the streak logs one traceback, not one per try."""
    import logging

    import psycopg

    from errands.worker import completer as module

    sleeps: list[float] = []
    monkeypatch.setattr(module, "_pause", sleeps.append)  # not time.sleep: every thread's
    backend = Backend(set())
    fails = {"left": 9}
    write = backend.job_finish_many

    def flaky(outcomes: list[FinishParams]) -> list[bool]:
        if fails["left"]:
            fails["left"] -= 1
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return write(outcomes)

    backend.job_finish_many = flaky  # type: ignore[method-assign]
    app: Any = App(backend)
    completer = Completer(app, lambda *_: None)
    with caplog.at_level(logging.WARNING, logger="errands.worker"):
        assert completer._store([(None, OUTCOME)]) == [((None, OUTCOME), True)]  # type: ignore[list-item]
    assert len(sleeps) == 9
    assert max(sleeps) <= module.RETRY_PAUSE_MAX, sleeps
    assert sleeps[-1] >= module.RETRY_PAUSE_MAX / 2, sleeps  # the pause grew to the cap
    assert sum(1 for r in caplog.records if r.exc_info) == 1


def test_a_stop_that_gives_up_on_unwritten_outcomes_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store that does not answer: the completer's stop gave up after its timeout
    without a word, and the outcomes were lost to the rescue (jobs run again)."""
    gate = threading.Event()

    class Stuck(Backend):
        def job_finish_many(self, outcomes: list[FinishParams]) -> list[bool]:
            gate.wait(10)
            return [True] * len(outcomes)

    from errands.worker.execution import Attempt
    from tests.unit.test_fair_outcome import ROW

    app: Any = App(Stuck(set()))
    completer = Completer(app, lambda *_: None)
    completer.start()
    for _ in range(3):
        completer.submit(Attempt(ROW, None, 30.0), OUTCOME)
    completer.stop(timeout=0.2)
    gate.set()
    [line] = [r.getMessage() for r in caplog.records if "unwritten" in r.getMessage()]
    assert "still unwritten after 0.2 s" in line
