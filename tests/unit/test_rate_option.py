"""``rate="COUNT/PERIOD"``: what is taken, and a clear error for what is not."""

from __future__ import annotations

from pathlib import Path

import pytest

import errands
from errands.backends.limits import RATE_COUNT_MAX, parse_rate
from errands.errors import ConfigurationError


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("20/s", (20, 1.0)), ("100/m", (100, 60.0)), ("5/h", (5, 3600.0)),
     ("1000/d", (1000, 86400.0)), ("10/30s", (10, 30.0)), ("1/.5s", (1, 0.5)),
     ("1/0.5s", (1, 0.5)), (" 3 / 2 min ", (3, 120.0)), ("1/0.001s", (1, 0.001))],
)  # fmt: skip
def test_a_rate_is_a_count_per_period(text: str, parsed: tuple[int, float]) -> None:
    assert parse_rate(text) == parsed


@pytest.mark.parametrize(
    ("text", "says"),
    [("1/.s", "write COUNT/PERIOD"),  # a lone '.': a ValueError from float() before
     ("1/s.", "write COUNT/PERIOD"), ("fast", "write COUNT/PERIOD"),
     ("0/s", "count must be from 1"), (f"{RATE_COUNT_MAX + 1}/s", "count must be from 1"),
     ("1/2d", "to one day"), ("1/0.0000001s", r"from 1 ms \(0.001s\)"),
     ("1/0.0009s", r"from 1 ms \(0.001s\)")],
)  # fmt: skip
def test_a_rate_that_cannot_be_stored_is_refused_naming_the_form(text: str, says: str) -> None:
    """A count past PostgreSQL's integer was taken and failed deep in the store at
    declare and enqueue (SQLite stored it)."""
    with pytest.raises(ConfigurationError, match=says):
        parse_rate(text)


@pytest.mark.parametrize(
    "limit",
    [2**31, 2**40, 10**400, True, 0, -1, 2.0, "10"],
    ids=["2**31", "2**40", "10**400", "True", "0", "-1", "2.0", "'10'"],
)
def test_a_queue_limit_that_cannot_be_stored_is_refused_at_declaration(
    tmp_path: Path, limit: object
) -> None:
    """app.queue(limit=2**40) was taken, and every worker on PostgreSQL then failed at
    its start storing it ("integer out of range"); limit=True was a limit of 1."""
    app = errands.App(f"sqlite:///{tmp_path}/errands.db")
    with pytest.raises(ConfigurationError, match=r"limit must be >= 1, an int of at most"):
        app.queue("emails", limit=limit)  # type: ignore[arg-type]
    app.queue("emails", limit=2**31 - 1)  # the largest a store keeps
