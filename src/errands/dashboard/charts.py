"""Throughput and failure-rate charts for the last hour, drawn on the server as SVG.

The numbers come from ``backend.job_throughput`` (per queue and minute). This module only
lays them out: bar and line geometry in SVG user units, axis labels and a tooltip text per
minute. The templates turn the result into ``<svg>`` markup (autoescaped like the rest).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from ..backends.base import ThroughputBucket

WINDOW_SECONDS = 3600.0
BUCKET_SECONDS = 60.0


@dataclass
class Minute:
    at: float  # bucket start, epoch seconds
    completed: int = 0
    dead: int = 0
    failed: int = 0

    @property
    def attempts(self) -> int:
        return self.completed + self.failed

    @property
    def failure_rate(self) -> float | None:
        return None if self.attempts == 0 else self.failed / self.attempts


@dataclass
class Series:
    """One queue's (or all queues') minutes over the window, oldest first."""

    minutes: list[Minute]

    @property
    def completed(self) -> int:
        return sum(m.completed for m in self.minutes)

    @property
    def dead(self) -> int:
        return sum(m.dead for m in self.minutes)

    @property
    def failed(self) -> int:
        return sum(m.failed for m in self.minutes)

    @property
    def failure_rate(self) -> float | None:
        attempts = self.completed + self.failed
        return None if attempts == 0 else self.failed / attempts


def build_series(
    rows: Iterable[ThroughputBucket], now: float, *, bucket: float = BUCKET_SECONDS
) -> tuple[Series, dict[str, Series]]:
    """Every minute of the window, empty ones included: the total and one per queue."""
    count = int(WINDOW_SECONDS // bucket)
    last = math.floor(now / bucket) * bucket
    starts = [last - bucket * (count - 1 - i) for i in range(count)]
    index = {round(s): i for i, s in enumerate(starts)}
    total = Series([Minute(s) for s in starts])
    queues: dict[str, Series] = {}
    for row in rows:
        i = index.get(round(row.at))
        if i is None:
            continue
        per = queues.setdefault(row.queue, Series([Minute(s) for s in starts]))
        for series in (total, per):
            minute = series.minutes[i]
            minute.completed += row.completed
            minute.dead += row.dead
            minute.failed += row.failed
    return total, queues


@dataclass
class Bar:
    x: float
    y: float
    width: float
    height: float
    kind: str  # css class: completed, failed


@dataclass
class Chart:
    width: int
    height: int
    bars: list[Bar] = field(default_factory=list)
    line: str = ""  # SVG path data for the failure-rate line
    dots: list[tuple[float, float, str]] = field(default_factory=list)
    hovers: list[tuple[float, float, str]] = field(default_factory=list)  # x, width, tooltip
    y_labels: list[tuple[float, str]] = field(default_factory=list)
    x_labels: list[tuple[float, str, str]] = field(default_factory=list)  # x, text, anchor
    plot_left: float = 0
    plot_bottom: float = 0
    plot_right: float = 0
    empty: bool = True
    label: str = ""


def _clock(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, tz=UTC).strftime("%H:%M")


def _nice_ceiling(value: float) -> float:
    if value <= 0:
        return 1.0
    magnitude = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * magnitude:
            return step * magnitude
    return 10 * magnitude


def _frame(width: int, height: int, axes: bool) -> tuple[float, float, float, float]:
    """left, top, right, bottom of the plot area."""
    if not axes:
        return 1.0, 2.0, width - 1.0, height - 1.0
    return 44.0, 8.0, width - 8.0, height - 20.0


def _x_labels(minutes: Sequence[Minute], left: float, slot: float) -> list[tuple[float, str, str]]:
    """A time label every 15 minutes, the last one ending at the plot's right edge."""
    labels = []
    last = len(minutes) - 1
    for i, minute in enumerate(minutes):
        if i % 15 == 0 and last - i >= 5:
            labels.append((left + slot * i, _clock(minute.at), "start" if i == 0 else "middle"))
        elif i == last:
            labels.append((left + slot * (i + 1), _clock(minute.at + BUCKET_SECONDS), "end"))
    return labels


def throughput_chart(
    series: Series, *, width: int = 640, height: int = 150, axes: bool = True
) -> Chart:
    """Stacked bars per minute: completed jobs (bottom) and failed attempts (top)."""
    left, top, right, bottom = _frame(width, height, axes)
    minutes = series.minutes
    slot = (right - left) / max(len(minutes), 1)
    peak = _nice_ceiling(max((m.attempts for m in minutes), default=0))
    scale = (bottom - top) / peak
    chart = Chart(width, height, plot_left=left, plot_bottom=bottom, plot_right=right)
    chart.label = (
        f"Throughput, last hour: {series.completed} completed, {series.failed} failed attempts, "
        f"{series.dead} dead"
    )
    gap = min(1.0, slot * 0.15)
    for i, m in enumerate(minutes):
        x = left + slot * i + gap / 2
        y = bottom
        for value, kind in ((m.completed, "completed"), (m.failed, "failed")):
            if value:
                h = max(value * scale, 1.0)
                y -= h
                chart.bars.append(
                    Bar(round(x, 2), round(y, 2), round(slot - gap, 2), round(h, 2), kind)
                )
        chart.hovers.append(
            (
                round(left + slot * i, 2),
                round(slot, 2),
                f"{_clock(m.at)} UTC: {m.completed} completed, {m.failed} failed, {m.dead} dead",
            )
        )
    chart.empty = series.completed + series.failed == 0
    if axes:
        chart.y_labels = [
            (bottom, "0"),
            (top, _count_label(peak)),
            ((top + bottom) / 2, _count_label(peak / 2)),
        ]
        chart.x_labels = _x_labels(minutes, left, slot)
    return chart


def failure_rate_chart(
    series: Series, *, width: int = 640, height: int = 150, axes: bool = True
) -> Chart:
    """The share of finished attempts that failed, per minute (gaps where nothing ran)."""
    left, top, right, bottom = _frame(width, height, axes)
    minutes = series.minutes
    slot = (right - left) / max(len(minutes), 1)
    chart = Chart(width, height, plot_left=left, plot_bottom=bottom, plot_right=right)
    rate = series.failure_rate
    chart.label = "Failure rate, last hour: " + ("no attempts" if rate is None else f"{rate:.1%}")
    path: list[str] = []
    pen_up = True
    for i, m in enumerate(minutes):
        x = round(left + slot * (i + 0.5), 2)
        r = m.failure_rate
        if r is None:
            pen_up = True
        else:
            y = round(bottom - r * (bottom - top), 2)
            path.append(f"{'M' if pen_up else 'L'}{x} {y}")
            pen_up = False
            chart.dots.append((x, y, "failed" if r > 0 else "ok"))
        tip = "no attempts" if r is None else f"{r:.0%} of {m.attempts} attempts failed"
        chart.hovers.append(
            (round(left + slot * i, 2), round(slot, 2), f"{_clock(m.at)} UTC: {tip}")
        )
    chart.line = " ".join(path)
    chart.empty = rate is None
    if axes:
        chart.y_labels = [(bottom, "0%"), ((top + bottom) / 2, "50%"), (top, "100%")]
        chart.x_labels = _x_labels(minutes, left, slot)
    return chart


def _count_label(value: float) -> str:
    if value >= 1000:
        return f"{value / 1000:g}k"
    return f"{value:g}"
