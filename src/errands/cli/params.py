"""Option types of the command line beyond click's own."""

from __future__ import annotations

import math
from typing import Any

import click


class FiniteFloatRange(click.FloatRange):
    """:class:`click.FloatRange` without NaN and infinity, which it lets through (NaN
    compares false with either bound): ``status --max-age nan`` was an alert that could
    never fire, ``worker --poll-interval nan`` a worker that could never sleep."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number; give seconds, such as 30", param, ctx)
        return number
