"""Shutdown and a handler finishing at the end of the grace period agree on who owns the
attempt's outcome: exactly one of them. Shutdown set ``released`` apart from the
handler's decision, so a handler deciding at that moment had its completion written
after the release (refused by the fence) and the job ran again."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from errands.worker import timeouts
from errands.worker.execution import SHUTDOWN, Attempt
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


# -- the stop takes an attempt over at the end of its grace period -------------------------
# It used to ask the handler to stop and let go of (roll back) its ctx.transaction()
# without taking the outcome: a handler returning at that moment was recorded
# ``completed`` without its transaction's writes (tests/effects/test_transaction_at_
# shutdown.py); and a handler that had stopped when asked was charged a timeout that came
# while the stop waited for another job's step.


def test_a_handler_that_decided_first_is_not_taken_over_by_the_stop() -> None:
    attempt = Attempt(ROW, None, 30.0)
    assert attempt.decide()
    assert not attempt.stop_for_shutdown()  # its outcome (and transaction) are its own
    assert not attempt.stopping


def test_a_handler_ending_after_the_stop_took_it_over_records_nothing_and_cannot_time_out() -> None:
    attempt = Attempt(ROW, None, 30.0)
    attempt.deadline = 123.0
    assert attempt.stop_for_shutdown()
    assert not attempt.decide()  # the handler's end: not the attempt's outcome
    assert attempt.ended_at_stop and not attempt.decided
    assert attempt.deadline is None  # disarmed: the lease keeper has nothing to fire
    assert not attempt.time_out(200.0)  # its timeout came after it stopped: not charged
    assert not attempt.timed_out
    assert attempt.give_back()  # the stop's release


def test_a_timeout_while_the_handler_still_runs_after_the_stop_took_it_over_is_recorded() -> None:
    attempt = Attempt(ROW, None, 30.0)
    assert attempt.stop_for_shutdown()
    assert attempt.time_out(200.0)  # still running at its deadline: timed out
    assert attempt.timed_out and attempt.timeout_at == 200.0
    assert not attempt.decide()  # the handler's own end still records nothing...
    assert attempt.decide(over_stop=True)  # ...the timeout is (abandon: over the stop)
    assert not attempt.give_back()


def test_the_lease_keeper_fires_no_timeout_for_a_handler_ended_after_the_stop_took_it_over() -> (
    None
):
    """The keeper found the attempt undecided (left to the stop) with its deadline
    passed: it asked the ended handler to stop, marked it timed out, and the stop then
    recorded a timeout (charged; dead on its last attempt, its on_dead hooks run)."""
    attempt = Attempt(ROW, None, 30.0)
    attempt.deadline = 1.0
    assert attempt.stop_for_shutdown()
    attempt.interrupt(SHUTDOWN, None)
    assert not attempt.decide()  # it returned on ctx.cancelled
    attempt.deadline = 1.0  # (as if read by the keeper before the handler ended)
    worker = SimpleNamespace(loop=None, abandon_after=10.0)
    timeouts.on_deadline(worker, attempt)  # type: ignore[arg-type]
    assert not attempt.timed_out
    assert attempt.deadline is None
    assert attempt.stop_reason == SHUTDOWN  # not asked again, for a timeout


def _race_stop(attempt: Attempt) -> list[str]:
    """The handler's decision and the stop's claim at once; who owned the outcome."""
    owners: list[str] = []
    start = threading.Barrier(2)

    def handler() -> None:
        start.wait()
        if attempt.decide():
            owners.append("handler")

    def stop() -> None:
        start.wait()
        if attempt.stop_for_shutdown():
            owners.append("stop")

    threads = [threading.Thread(target=handler), threading.Thread(target=stop)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return owners


def test_racing_stop_and_handler_exactly_one_owns_the_outcome() -> None:
    for _ in range(200):
        attempt = Attempt(ROW, None, 30.0)
        owners = _race_stop(attempt)
        assert len(owners) == 1
        assert attempt.decided == (owners == ["handler"])
        assert attempt.ended_at_stop == (owners == ["stop"])
