"""A small-N run of the noisy-neighbour benchmark (``make bench-fairness``) on SQLite, so it
cannot rot: every figure is measured. Figures are never compared with a time or a rate
here (benchmarks report, they do not assert)."""

from __future__ import annotations

from pathlib import Path

from bench import fairness


def test_the_noisy_neighbour_benchmark_runs_end_to_end_and_reports_every_figure(
    tmp_path: Path,
) -> None:
    result = fairness.main(
        [
            "--url", f"sqlite:///{tmp_path}/fair.db", "--backlog", "300", "--quiet", "3",
            "--seconds", "2", "--grace", "2", "--keys", "20", "--keys-jobs", "100",
            "--work", "0.002", "--concurrency", "4",
        ]
    )  # fmt: skip
    for run in ("idle", "fair", "fifo"):
        assert result[run]["quiet_jobs"] >= 3
        assert result[run]["quiet_dwell_p99"] is not None
    assert result["fair"]["backlog"] == 300
    assert set(result["shares"]["worker_seconds"]) == {"a", "c", "d", "slow"}
    assert 0 < result["shares"]["jain_index_per_weight"] <= 1
    assert result["keys"]["fair"]["jobs"] == result["keys"]["fifo"]["jobs"] == 100
