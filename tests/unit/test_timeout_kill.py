"""A process-pool (or async) attempt past its timeout is stopped at once (its child
killed, its task cancelled); whatever ends it next is a timeout. An answer racing the kill
was recorded as Interrupted, kind "lease_lost": a lease loss that never happened, of the
kind that excuses a duplicate run."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from errands.worker.execution import Attempt, JobTimeout
from errands.worker.recorder import OutcomeRecorder
from errands.worker.timeouts import on_deadline
from tests.unit.test_fair_outcome import ROW


def test_an_answer_racing_the_kill_of_a_timed_out_child_is_recorded_as_a_timeout() -> None:
    attempt = Attempt(row=ROW, definition=None, lease_seconds=30.0)
    kills: list[BaseException] = []
    attempt.kill = kills.append
    on_deadline(SimpleNamespace(loop=None), attempt)  # type: ignore[arg-type]
    assert [type(k) for k in kills] == [JobTimeout]

    decided: list[Any] = []
    recorder = SimpleNamespace(decided=lambda a, exc, result, **kw: decided.append((exc, result)))
    OutcomeRecorder.handler_returned(recorder, attempt, None, '"answered"')  # type: ignore[arg-type]
    [(exc, result)] = decided
    assert isinstance(exc, JobTimeout) and result is None
