"""The last-hour charts: minutes aligned to the database clock, bars and rate line laid out."""

from __future__ import annotations

from errands.backends.base import ThroughputBucket
from errands.dashboard import charts

NOW = 1_800_000_030.0  # 30 s into a minute


def test_every_minute_of_the_hour_is_there_and_rows_land_in_their_minute() -> None:
    last = 1_800_000_000.0
    rows = [
        ThroughputBucket(last, "emails", completed=4, dead=0, failed=1),
        ThroughputBucket(last - 60, "payments", completed=2, dead=1, failed=1),
        ThroughputBucket(last - 7200, "emails", completed=99, dead=0, failed=0),  # too old
    ]
    total, per_queue = charts.build_series(rows, NOW)
    assert len(total.minutes) == 60
    assert total.minutes[-1].at == last and total.minutes[0].at == last - 59 * 60
    assert (total.completed, total.failed, total.dead) == (6, 2, 1)
    assert per_queue["emails"].minutes[-1].completed == 4
    assert per_queue["payments"].minutes[-2].failed == 1
    assert total.failure_rate == 2 / 8


def test_throughput_bars_stack_failed_on_completed_scaled_to_a_round_peak() -> None:
    total, _ = charts.build_series(
        [ThroughputBucket(1_800_000_000.0, "q", completed=30, dead=0, failed=10)], NOW
    )
    chart = charts.throughput_chart(total)
    completed, failed = chart.bars
    assert (completed.kind, failed.kind) == ("completed", "failed")
    assert abs(failed.y + failed.height - completed.y) < 0.01  # stacked
    assert abs(completed.height - 3 * failed.height) < 0.1
    assert chart.y_labels[1][1] == "50"  # 40 rounds up to 50
    assert chart.x_labels[-1][2] == "end" and not chart.empty


def test_failure_rate_line_has_gaps_where_nothing_ran() -> None:
    rows = [
        ThroughputBucket(1_800_000_000.0 - 120, "q", completed=1, dead=0, failed=1),
        ThroughputBucket(1_800_000_000.0, "q", completed=3, dead=0, failed=0),
    ]
    total, _ = charts.build_series(rows, NOW)
    chart = charts.failure_rate_chart(total)
    assert chart.line.count("M") == 2  # two separate runs: the empty minute breaks the line
    assert [kind for _, _, kind in chart.dots] == ["failed", "ok"]
    empty = charts.failure_rate_chart(charts.build_series([], NOW)[0])
    assert empty.empty and empty.line == ""
