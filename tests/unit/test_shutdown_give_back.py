"""Shutdown and a handler finishing at the end of the grace period agree on who owns the
attempt's outcome: exactly one of them. Shutdown set ``released`` apart from the
handler's decision, so a handler deciding at that moment had its completion written
after the release (refused by the fence) and the job ran again."""

from __future__ import annotations

import threading

from errands.worker.execution import Attempt
from tests.unit.test_fair_outcome import ROW


def test_a_handler_that_decided_first_keeps_its_outcome_and_is_not_released() -> None:
    attempt = Attempt(ROW, None, 30.0)
    assert attempt.decide()  # the handler's outcome
    assert not attempt.give_back()
    assert not attempt.released


def test_shutdown_that_takes_the_attempt_first_leaves_the_handlers_outcome_ignored() -> None:
    attempt = Attempt(ROW, None, 30.0)
    assert attempt.give_back()
    assert attempt.released and attempt.decided
    assert not attempt.decide()  # the handler's late outcome is not written


def _race(attempt: Attempt) -> list[str]:
    """The handler's decision and shutdown's give-back at once; who owned the outcome."""
    owners: list[str] = []
    start = threading.Barrier(2)

    def handler() -> None:
        start.wait()
        if attempt.decide():
            owners.append("handler")

    def shutdown() -> None:
        start.wait()
        if attempt.give_back():
            owners.append("shutdown")

    threads = [threading.Thread(target=handler), threading.Thread(target=shutdown)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return owners


def test_racing_shutdown_and_handler_exactly_one_owns_each_outcome() -> None:
    for _ in range(200):
        attempt = Attempt(ROW, None, 30.0)
        owners = _race(attempt)
        assert len(owners) == 1
        assert attempt.released == (owners == ["shutdown"])
