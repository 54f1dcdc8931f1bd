"""A property test of fair claiming over random interleavings, on every backend.

Each example makes a fair queue with 2-5 keys, each with a backlog, and runs claim
rounds of ``slots`` jobs. Between rounds every running attempt ends by a random path:
completion, failure (retried at once, or later), cancel, release at shutdown, rescue
after its lease expired, or suspension. After every step:

- **starvation bound:** a key with a due job is claimed within ``ceil(keys / slots) + 1``
  rounds (keys within their share of worker time: the test's attempts take milliseconds,
  far under the one-second quantum);
- **no slot leaks:** every attempt a claim started and a fenced write ended holds no slot
  (no running row is left; per key, the figures show none running), and each ended
  attempt was folded into its key's usage exactly once.
"""

from __future__ import annotations

import itertools
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from errands.backends import Backend
from errands.backends.base import (
    FinishParams,
    LeaseRef,
    ListParams,
    QueueClaim,
    QueueSettings,
    RescueParams,
)
from errands.jobs import EnqueueRequest, JobRow

from .conftest import Harness
from .support import WORKER, error

ENDINGS = ("complete", "fail_now", "fail_later", "cancel", "release", "rescue", "suspend")
_queues = itertools.count()


def _jobs(queue: str, key: str, n: int) -> list[EnqueueRequest]:
    return [
        EnqueueRequest(
            name="fair.prop", queue=queue, args_json="{}", priority=0, max_attempts=50,
            delay=0.0, run_at=None, key=None, timeout=None, lease_seconds=None, fair_key=key,
        )
        for _ in range(n)
    ]  # fmt: skip


def _end(backend: Backend, harness: Harness, row: JobRow, how: str) -> bool:
    """End one attempt by ``how``; True when the fenced write landed."""
    token = row.lease_token or ""
    if how == "release":
        return backend.job_release_many([LeaseRef(row.id, token, 30.0)]) == [True]
    if how == "rescue":
        harness.expire_lease(backend, row.id)
        rescue = RescueParams(row.id, token, "retryable", error(row.attempt), 0.0)
        return backend.job_rescue_many([rescue]) == [True]
    if how == "cancel":
        backend.job_cancel(row.id, "prop")
    outcome = {
        "complete": FinishParams(row.id, token, "completed", result_json="1"),
        "fail_now": FinishParams(row.id, token, "retryable", error=error(row.attempt)),
        "fail_later": FinishParams(row.id, token, "retryable", error=error(), delay=3600.0),
        "cancel": FinishParams(row.id, token, "retryable", error=error(row.attempt)),
        "suspend": FinishParams(row.id, token, "waiting", wait_signal="never"),
    }[how]
    return backend.job_finish_many([outcome]) == [True]


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    keys=st.integers(2, 5),
    slots=st.integers(1, 3),
    endings=st.lists(st.sampled_from(ENDINGS), min_size=1, max_size=40),
    rounds=st.integers(3, 8),
)
def test_every_backlogged_key_is_claimed_within_the_bound_and_no_slot_leaks(
    backend: Backend,
    harness: Harness,
    keys: int,
    slots: int,
    endings: list[str],
    rounds: int,
) -> None:
    queue = f"fairprop{next(_queues)}"
    backend.queue_declare(QueueSettings(queue, fair=True), "test")
    names = [f"tenant:{k}" for k in range(keys)]
    requests = [r for k, name in enumerate(names) for r in _jobs(queue, name, 4 + 2 * k)]
    key_of = {
        result.id: r.fair_key
        for result, r in zip(backend.job_insert_many(requests), requests, strict=True)
    }
    bound = math.ceil(keys / slots) + 1
    waited = dict.fromkeys(names, 0)  # rounds each key has been due and not claimed
    ended = 0
    pick = itertools.cycle(endings)
    for _ in range(rounds):
        before = backend.fair_figures(queue)
        due = {f.key for f in before if f.due > 0}
        # A worker's round: rescued jobs first (in claim order), then fresh ones, fairly.
        claimed = list(
            backend.job_claim_limited(QueueClaim(queue, slots), WORKER, 30.0, suspects=True)
        )
        fresh = QueueClaim(queue, slots - len(claimed))
        claimed += backend.job_claim_limited(fresh, WORKER, 30.0) if fresh.limit else []
        assert len(claimed) == min(slots, sum(f.due for f in before)), "a free slot was idle"
        served = {key_of[r.id] for r in claimed}
        for name in names:
            waited[name] = 0 if name in served or name not in due else waited[name] + 1
            assert waited[name] <= bound, f"{name} waited {waited[name]} rounds (bound {bound})"
        for row in claimed:
            assert _end(backend, harness, row, next(pick)), f"{row.id}: the fenced write missed"
            ended += 1
        figures = backend.fair_figures(queue)
        assert sum(f.running for f in figures) == 0, "a slot leaked"
        assert sum(f.attempts for f in figures) == ended, "an attempt was folded twice or never"
    assert backend.job_list(ListParams(state="running", queue=queue)) == []
