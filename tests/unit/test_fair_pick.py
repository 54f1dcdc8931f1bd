"""The fair claim's ordering (errands.backends.fair.fair_pick), as a pure function."""

from __future__ import annotations

import pytest

from errands.backends.fair import (
    FairCandidate,
    KeyState,
    check_weight,
    decayed,
    effective_priority,
    fair_pick,
)
from errands.errors import ConfigurationError

NOW = 1_000_000.0


def jobs(key: str, n: int, *, priority: int = 0, run_at: float = NOW - 10, first: int = 0):
    return [
        FairCandidate(first + i, "job", None, None, None, None, key, priority, run_at + i * 0.001)
        for i in range(n)
    ]


def keys_of(picked):
    return [c.fair_key for c in picked.chosen]


def admit_all(_: FairCandidate) -> bool:
    return True


def test_one_job_per_key_per_round_before_any_key_takes_a_second() -> None:
    """A backlog enqueued first does not hold the keys behind it: each backlogged key
    takes one job before any takes a second."""
    cands = jobs("a", 100, run_at=NOW - 100) + jobs("b", 2, first=1000) + jobs("c", 2, first=2000)
    picked = fair_pick(cands, {}, 3, admit_all, now=NOW)
    assert sorted(keys_of(picked)) == ["a", "b", "c"]


def test_the_least_recently_started_keys_go_first_when_slots_are_fewer_than_keys() -> None:
    cands = jobs("a", 5) + jobs("b", 5, first=100) + jobs("c", 5, first=200)
    states = {
        "a": KeyState(last_started=NOW - 1),
        "b": KeyState(last_started=NOW - 30),
        "c": KeyState(last_started=None),
    }
    assert keys_of(fair_pick(cands, states, 2, admit_all, now=NOW)) == ["c", "b"]


def test_slots_beyond_one_per_key_go_by_weighted_recent_worker_time() -> None:
    """With more slots than keys, a key that used 10x the worker time of another gets
    the extra slots only after the other has caught up."""
    cands = jobs("slow", 20) + jobs("fast", 20, first=100)
    states = {
        "slow": KeyState(usage=10.0, mean_cost=10.0, last_started=NOW - 5),
        "fast": KeyState(usage=1.0, mean_cost=1.0, last_started=NOW - 5),
    }
    picked = keys_of(fair_pick(cands, states, 10, admit_all, now=NOW))
    assert picked.count("slow") == 1  # its round-robin turn only: "fast" is 9 s behind
    assert picked.count("fast") == 9


def test_weights_share_the_extra_slots_in_proportion() -> None:
    cands = jobs("heavy", 50) + jobs("light", 50, first=100)
    states = {"heavy": KeyState(weight=4.0), "light": KeyState(weight=1.0)}
    picked = keys_of(fair_pick(cands, states, 10, admit_all, now=NOW))
    assert picked.count("heavy") == 8 and picked.count("light") == 2


def test_a_key_far_over_its_share_waits_out_the_round_robin_turns() -> None:
    cands = jobs("hog", 10) + jobs("b", 10, first=100) + jobs("c", 10, first=200)
    states = {
        "hog": KeyState(usage=100.0, mean_cost=1.0, last_started=NOW - 60),
        "b": KeyState(usage=1.0, last_started=NOW - 1),
        "c": KeyState(usage=1.0, last_started=NOW - 1),
    }
    assert keys_of(fair_pick(cands, states, 2, admit_all, now=NOW)) == ["b", "c"]
    # but a free slot no one else can use still goes to it (work-conserving)
    assert keys_of(fair_pick(jobs("hog", 3), states, 2, admit_all, now=NOW)) == ["hog", "hog"]


def test_higher_priority_keys_go_first_whatever_their_usage() -> None:
    cands = jobs("a", 3, priority=5) + jobs("b", 3, first=100)
    states = {"a": KeyState(usage=1000.0), "b": KeyState()}
    assert keys_of(fair_pick(cands, states, 4, admit_all, now=NOW)) == ["a", "a", "a", "b"]


def test_aging_moves_a_waiting_job_up_one_level_per_period() -> None:
    assert effective_priority(0, NOW - 25, NOW, 10.0) == 2
    assert effective_priority(0, NOW - 9.9, NOW, 10.0) == 0
    assert effective_priority(3, NOW + 5, NOW, 10.0) == 3
    assert effective_priority(0, NOW - 1e6, NOW, None) == 0
    old_low = jobs("a", 1, priority=0, run_at=NOW - 25)
    fresh_high = jobs("b", 1, priority=1, run_at=NOW, first=100)
    picked = fair_pick(old_low + fresh_high, {}, 1, admit_all, now=NOW, aging=10.0)
    assert keys_of(picked) == ["a"]


def test_a_gated_job_is_skipped_and_the_next_key_takes_its_slot() -> None:
    cands = jobs("capped", 5) + jobs("free", 5, first=100)

    def admit(c: FairCandidate) -> bool:
        return c.fair_key != "capped"

    picked = fair_pick(cands, {}, 3, admit, now=NOW)
    assert keys_of(picked) == ["free"] * 3
    assert picked.gated == 5


def test_decay_halves_usage_every_half_life() -> None:
    assert decayed(8.0, 60.0) == pytest.approx(4.0)
    assert decayed(8.0, -5.0) == 8.0


@pytest.mark.parametrize("weight", [0, -1, float("nan"), "5", True, 1e9])
def test_a_weight_must_be_a_positive_number(weight: object) -> None:
    with pytest.raises(ConfigurationError, match="weight must be a number above 0"):
        check_weight("tenant:a", weight)


def test_a_key_more_than_its_slack_under_its_share_goes_before_the_round_robin_turns() -> None:
    """Keys of weight 1 at their slack's edge (a second over their share) would keep
    taking turns with a key of weight 2 three seconds under its own: it goes first,
    though it started a job last; keys within their slack keep their turns."""
    cands = jobs("a", 5) + jobs("c", 5, first=100) + jobs("d", 5, first=200)
    states = {
        "a": KeyState(usage=24.0, mean_cost=0.05, last_started=NOW - 3),
        "c": KeyState(usage=44.0, mean_cost=0.05, last_started=NOW - 1, weight=2.0),
        "d": KeyState(usage=24.0, mean_cost=0.05, last_started=NOW - 2),
    }  # total 92: shares 23, 46, 23
    assert keys_of(fair_pick(cands, states, 1, admit_all, now=NOW)) == ["c"]
    states["c"].usage = 46.0  # within its slack: back to the turns, longest waiting first
    assert keys_of(fair_pick(cands, states, 3, admit_all, now=NOW)) == ["a", "d", "c"]
