"""App(dead_hooks_grace=): when the leader runs on_dead hooks that no worker marked done."""

from __future__ import annotations

import pytest

import errands
from errands.errors import ConfigurationError


def test_the_grace_defaults_to_a_minute_or_three_hook_time_limits() -> None:
    assert errands.App("sqlite:///unused.db").dead_hooks_grace == 60.0
    assert errands.App("sqlite:///unused.db", hook_timeout=30).dead_hooks_grace == 90.0


def test_a_grace_not_longer_than_the_hook_time_limit_is_refused_with_the_reason() -> None:
    """Every slow hook would run twice: the leader would take it over while it runs."""
    with pytest.raises(ConfigurationError, match="must exceed hook_timeout"):
        errands.App("sqlite:///unused.db", hook_timeout=10, dead_hooks_grace=10)
