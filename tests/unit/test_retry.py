"""Backoff policies: the default schedule, its jitter and cap, and what as_backoff accepts."""

from __future__ import annotations

import pytest

from errands.retry import (
    DEFAULT_BACKOFF,
    CallableBackoff,
    ExponentialBackoff,
    as_backoff,
)

SAMPLES = 300


@pytest.mark.parametrize(("attempt", "nominal"), [(1, 2.0), (2, 4.0), (3, 8.0)])
def test_default_backoff_waits_2_4_8_seconds_within_25_percent_jitter(
    attempt: int, nominal: float
) -> None:
    """Retries 1, 2, 3 wait about 2 s, 4 s and 8 s, never beyond ±25 %."""
    delays = [DEFAULT_BACKOFF.delay(attempt) for _ in range(SAMPLES)]
    assert all(nominal * 0.75 <= d <= nominal * 1.25 for d in delays)
    assert len(set(delays)) > SAMPLES // 2  # jittered, not one fixed value
    assert min(delays) < nominal < max(delays)


def test_default_backoff_never_waits_past_its_one_hour_cap_jitter_included() -> None:
    """max_delay bounds the wait after jitter: a late attempt waits between 45 min and the
    one-hour cap, never beyond it."""
    delays = [DEFAULT_BACKOFF.delay(40) for _ in range(SAMPLES)]
    assert all(3600 * 0.75 <= d <= 3600 for d in delays)
    assert min(delays) < 3600 * 0.99


@pytest.mark.parametrize("attempt", [1024, 1025, 10_000, 2**62])
def test_backoff_survives_any_attempt_number(attempt: int) -> None:
    """The exponent stops growing at the cap: no OverflowError at attempt 1025 or beyond."""
    assert DEFAULT_BACKOFF.delay(attempt) <= 3600
    assert ExponentialBackoff(base=1e-300, factor=1.0001, jitter=0.0).delay(attempt) <= 3600


def test_retry_delay_replaces_a_broken_policy_with_the_default() -> None:
    """A policy that raises, or returns NaN, infinity, a negative or a non-number, gives
    the default delay for that retry (2 s ± 25 % after the first attempt)."""
    from errands.retry import retry_delay

    for broken in (
        lambda a: 1 / 0,
        lambda a: float("nan"),
        lambda a: float("inf"),
        lambda a: -5,
        lambda a: "soon",
    ):
        assert 1.5 <= retry_delay(as_backoff(broken), 1, job="t") <= 2.5
    assert retry_delay(as_backoff(lambda a: 10**12), 1, job="t") == 365 * 86400.0


def test_backoff_without_jitter_is_exact_and_capped() -> None:
    """base * factor**(attempt-1), then the cap, with no randomness when jitter is 0."""
    policy = ExponentialBackoff(base=1.0, factor=3.0, max_delay=20.0, jitter=0.0)
    assert [policy.delay(a) for a in (1, 2, 3, 4, 5)] == [1.0, 3.0, 9.0, 20.0, 20.0]


def test_backoff_treats_attempt_zero_like_the_first() -> None:
    """An attempt number below 1 never produces a fractional exponent."""
    assert ExponentialBackoff(jitter=0.0).delay(0) == 2.0


@pytest.mark.parametrize(
    "options",
    [{"base": -1.0}, {"factor": 0.5}, {"max_delay": -1.0}, {"jitter": 1.0}, {"jitter": -0.1}],
)
def test_exponential_backoff_rejects_nonsense_settings(options: dict[str, float]) -> None:
    """Negative delays, shrinking factors and jitter outside [0, 1) are refused."""
    with pytest.raises(ValueError, match="ExponentialBackoff needs"):
        ExponentialBackoff(**options)


def test_as_backoff_of_none_is_the_default_policy() -> None:
    """No backoff option means the documented default."""
    assert as_backoff(None) is DEFAULT_BACKOFF


def test_as_backoff_passes_a_policy_object_through() -> None:
    """Anything with a delay method is used as it is."""
    policy = ExponentialBackoff(base=5.0)
    assert as_backoff(policy) is policy


def test_as_backoff_wraps_a_callable_of_the_attempt() -> None:
    """A function attempt -> seconds becomes a policy calling it."""
    policy = as_backoff(lambda attempt: attempt * 10)
    assert isinstance(policy, CallableBackoff)
    assert [policy.delay(a) for a in (1, 2, 3)] == [10.0, 20.0, 30.0]


def test_a_callable_backoff_returning_a_negative_delay_is_an_error() -> None:
    """A backoff function may not ask for a wait in the past."""
    with pytest.raises(ValueError, match="returned -1"):
        as_backoff(lambda attempt: -1).delay(1)


@pytest.mark.parametrize("value", [7, 7.0])
def test_as_backoff_of_a_number_is_a_constant_delay(value: float) -> None:
    """A number of seconds waits that long before every retry, without jitter."""
    policy = as_backoff(value)
    assert [policy.delay(a) for a in (1, 2, 10)] == [7.0, 7.0, 7.0]


def test_as_backoff_rejects_a_negative_constant() -> None:
    """A constant backoff below zero is refused."""
    with pytest.raises(ValueError, match=">= 0"):
        as_backoff(-3)


def test_as_backoff_rejects_something_that_is_no_backoff() -> None:
    """A string is neither a policy, a callable nor a number."""
    with pytest.raises(TypeError, match="backoff='soon'"):
        as_backoff("soon")  # type: ignore[arg-type]
