"""A small-N run of the noisy-neighbour benchmark (``make bench-fairness``) on SQLite, so it
cannot rot: every figure is measured. Figures are never compared with a time or a rate
here (benchmarks report, they do not assert)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import fairness

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def test_the_noisy_neighbour_benchmark_runs_end_to_end_and_reports_every_figure(
    tmp_path: Path,
) -> None:
    result = fairness.main(
        [
            "--url", f"sqlite:///{tmp_path}/fair.db", "--backlog", "300", "--quiet", "3",
            "--seconds", "2", "--grace", "2", "--keys", "20", "--keys-jobs", "100",
            "--work", "0.002", "--concurrency", "4", "--keys-work", "0.001",
            "--keys-rounds", "1",
        ]
    )  # fmt: skip
    for run in ("idle", "fair", "fifo"):
        assert result[run]["quiet_jobs"] >= 3
        assert result[run]["quiet_dwell_p99"] is not None
    assert result["fair"]["backlog"] == 300
    assert set(result["shares"]["worker_seconds"]) == {"a", "c", "d", "slow"}
    assert 0 < result["shares"]["jain_index_per_weight"] <= 1
    assert result["keys"]["fair"]["jobs"] == result["keys"]["fifo"]["jobs"] == 100
    assert result["keys_work"]["fair"]["jobs"] == result["keys_work"]["fifo"]["jobs"] == 100
    assert result["keys_work"]["fair"]["work"] == 0.001 and result["keys"]["fair"]["work"] == 0


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


# Like every peer adapter (each needs its own venv installed), it runs in `make test-peers`.
@pytest.mark.peers
@pytest.mark.acceptance
@pytest.mark.xdist_group("bench_databases")
@pytest.mark.timeout(900)  # the first run makes pgqueuer's venv (pip install)
def test_the_peer_without_fair_claiming_runs_the_same_dwell_traffic_on_postgres() -> None:
    """``--peer pgqueuer`` runs the backlog and the quiet tenants' traffic in pgqueuer
    (its own venv and database), every figure measured, beside errands' runs."""
    from urllib.parse import urlsplit, urlunsplit

    from tests.pg import pg_base_url, require_pg

    require_pg()
    parts = urlsplit(pg_base_url())
    url = urlunsplit(parts._replace(path="/bench_fairness_smoke", query=""))
    import psycopg

    with psycopg.connect(pg_base_url(), autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS bench_fairness_smoke WITH (FORCE)")
        conn.execute("CREATE DATABASE bench_fairness_smoke")
    result = fairness.main(
        [
            "--url", url, "--peer", "pgqueuer", "--only", "dwell", "--backlog", "300",
            "--quiet", "3", "--seconds", "2", "--grace", "2", "--work", "0.002",
            "--concurrency", "4",
        ]
    )  # fmt: skip
    peer = result["peer"]
    assert (peer["queue"], peer["backlog"]) == ("pgqueuer", 300)
    assert peer["quiet_jobs"] >= 3 and peer["quiet_dwell_p99"] is not None
    assert result["quiet_p99_peer_over_idle"] is not None


def test_the_report_puts_the_peer_in_the_postgresql_fifo_column() -> None:
    from bench import report

    peer = {"quiet_dwell_p99": 41.5, "quiet_dwell_p99_is_lower_bound": True}
    results = {"fairness": {"postgres": {"peer": peer, "quiet_p99_peer_over_idle": 300.0}}}
    header, rows = report.fairness_rows(results)
    by_name = {row[0]: row for row in rows}
    assert len(by_name) == len(rows)  # every figure named once
    cells = dict(zip(header, by_name[next(n for n in by_name if "pgqueuer" in n)], strict=True))
    assert cells["PostgreSQL FIFO"] == "over 41.50 s"
    assert cells["SQLite FIFO"] == ""
    assert by_name["... the peer's against idle"][header.index("PostgreSQL FIFO")] == "300.00"
