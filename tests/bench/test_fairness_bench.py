"""A small-N run of the noisy-neighbour benchmark (``make bench-fairness``) on SQLite, so it
cannot rot: every figure is measured. Figures are never compared with a time or a rate
here (benchmarks report, they do not assert)."""

from __future__ import annotations

from pathlib import Path

from bench import fairness

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


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


def test_make_bench_reports_the_fair_queue_beside_the_fifo_run_on_both_stores() -> None:
    """``bench.run`` stores the benchmark under ``results["fairness"][store]``; the report
    puts the fair and the FIFO figures side by side, with issue 19's targets, and names a
    store whose run failed."""
    import json

    from bench import report

    recorded = json.loads((RESULTS / "fairness-sqlite.json").read_text())
    results = {"fairness": {"sqlite": recorded, "postgres": {"error": "RuntimeError: down"}}}
    header, rows = report.fairness_rows(results)
    assert header == ["figure", "SQLite fair", "SQLite FIFO", "PostgreSQL fair",
                      "PostgreSQL FIFO", "target"]  # fmt: skip
    by_name = {row[0]: row for row in rows}
    keys = by_name["1,000 backlogged keys: throughput"]
    assert keys[1].endswith(" /s") and keys[2].endswith(" /s") and keys[3:5] == ["failed"] * 2
    assert by_name["... behind the backlog"][2].startswith("over ")  # FIFO: none started
    assert "## Fair queues (issue 19)" in report.fairness_markdown(results)
    assert report.fairness_markdown({}) == ""
