"""The soak's workload generator retries what it must (tests/soak/workload.py)."""

from __future__ import annotations

import random
from typing import Any

from errands.errors import EnqueueUncertain

from .workload import Ledger, Workload, transient


def test_an_enqueue_whose_commit_was_lost_is_retried_not_fatal() -> None:
    """A PostgreSQL restart while an enqueue commits raises EnqueueUncertain: the
    generator retries it (the mix's keys make that safe) instead of ending the run (a
    CI-sized run on PostgreSQL once failed so)."""
    assert transient(EnqueueUncertain("lost while committing"))
    calls: list[int] = []

    def enqueue() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise EnqueueUncertain("the connection was lost while the enqueue was committing")
        return "stored"

    workload: Any = object.__new__(Workload)
    workload.ledger, workload.rng = Ledger(), random.Random(1)
    workload.stop = type("Never", (), {"is_set": staticmethod(lambda: False)})()
    assert Workload._retrying(workload, enqueue) == "stored"
    assert len(calls) == 2 and workload.ledger.enqueue_retries == 1


def test_a_programming_error_is_not_retried() -> None:
    assert not transient(ValueError("a bug"))
