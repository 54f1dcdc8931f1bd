"""What keeps the benchmark honest without running it (issue 17): every configuration a
system is measured in names where its settings come from, both views exist for every
system, the third-party scenarios keep their shape, and the figures are derived as the
docs say. Fast: no database, no worker."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from bench.systems import SYSTEMS

from bench import report, run, scenarios, storage


def test_every_system_has_one_default_and_a_best_configuration_each_naming_its_source() -> None:
    for system in SYSTEMS:
        kinds = [c.kind for c in system.configs]
        assert kinds.count("default") == 1, system.name
        assert kinds.count("best") >= 1, system.name
        assert set(kinds) <= {"default", "best"}, system.name
        labels = [c.label for c in system.configs]
        assert len(set(labels)) == len(labels), system.name
        for config in system.configs:
            # A documentation page (a URL or a docs/ path) or the peer's own source or
            # --help for a default: something a reader can open and check.
            assert re.search(r"https?://|docs/|source|--help|\.py", config.source), (
                system.name,
                config.label,
                config.source,
            )
            assert config.settings, (system.name, config.label)


def test_the_default_configurations_add_no_tuning_knobs() -> None:
    errands = next(s for s in SYSTEMS if s.name == "errands-pg")
    # `errands worker module:app` as a user starts it: no -c, default log level.
    assert errands.default.options == {}
    assert errands.best[0].options == {"concurrency": 32, "prefetch": 1024, "log_level": "warning"}
    pgqueuer = next(s for s in SYSTEMS if s.name == "pgqueuer")
    assert pgqueuer.default.options["batch_size"] == 10
    assert pgqueuer.best[0].options["batch_size"] >= 100


def test_every_configuration_is_measured_in_every_run_and_processing_is_long_enough() -> None:
    assert run.FULL.runs >= 5
    assert run.FULL.throughput_jobs >= 100_000 or run.FULL.cap >= 10
    assert run.FULL.bulk_jobs >= 100_000 and run.FULL.single_jobs >= 30_000  # >= 10 s of calls
    for system in SYSTEMS:
        keys = [key for key, _, _ in run.scenarios_of(system, run.FULL)]
        for config in system.configs:
            for key in ("throughput_1", "throughput_2", "latency"):
                assert f"{key}@{config.label}" in keys, (system.name, key, config.label)


def test_a_capped_system_prefills_what_it_can_reach_and_a_fast_one_the_full_count() -> None:
    plan = run.FULL
    assert run.prefill_size(plan, []) == plan.throughput_jobs
    assert run.prefill_size(plan, [{"rate": 20_000, "capped": False}]) == plan.throughput_jobs
    slow = run.prefill_size(plan, [{"rate": 250.0, "capped": True}])
    assert slow == 7500  # 250/s x 20 s x 1.5: still more than the cap can drain
    assert slow >= 250.0 * plan.cap


def _raw(rates: list[float], label: str) -> dict[str, list[dict[str, object]]]:
    return {
        f"throughput_{p}@{label}": [
            {"rate": r * p, "done": 100, "capped": False, "run": i + 1} for i, r in enumerate(rates)
        ]
        for p in (1, 2)
    }


def test_both_views_pick_the_right_configuration_and_ratios_come_per_run() -> None:
    errands = next(s for s in SYSTEMS if s.name == "errands-pg")
    pgq = next(s for s in SYSTEMS if s.name == "pgqueuer")
    results = {
        "systems": {
            "errands-pg": {
                "store": "postgres",
                "compare_to": "",
                "raw": {**_raw([100, 110], "default"), **_raw([300, 330], "tuned")},
            },
            "pgqueuer": {
                "store": "postgres",
                "compare_to": "errands-pg",
                "raw": {**_raw([200, 200], "default"), **_raw([150, 300], "tuned")},
            },
        }
    }
    for name, system in (("errands-pg", errands), ("pgqueuer", pgq)):
        entry = results["systems"][name]
        entry["figures"] = run.summarise(entry["raw"], system)
    assert results["systems"]["errands-pg"]["figures"]["best_config"] == "tuned"
    label, fig = report.view_figures(results["systems"]["pgqueuer"], "default")
    assert label == "default" and fig["throughput_1"] == 200
    assert fig["spread"]["throughput_1"] == {"min": 200, "max": 200, "n": 2, "spread": 1.0}
    per_run = report._run_ratios(results, "errands-pg", "pgqueuer", "best", "throughput_1")
    assert per_run == [2.0, 1.1]
    _, rows = report._ratio_rows(results, "default")
    assert rows[0][3] == "0.53x (runs 0.50-0.55)"


def test_the_bulk_target_is_judged_against_the_copy_timed_alternating_with_it() -> None:
    """errands' PostgreSQL bulk enqueue times the raw COPY (1,000 rows a transaction) in
    rounds alternating with its own: the share of each run, then their median, is what
    the target reads; the limit's COPY, timed in a phase of its own, only without it."""
    errands = next(s for s in SYSTEMS if s.name == "errands-pg")
    bulk = [
        {"rate": 60_000, "raw_rate": 120_000, "vs_raw": 0.5},
        {"rate": 50_000, "raw_rate": 80_000, "vs_raw": 0.625},
        {"rate": 70_000, "raw_rate": 125_000, "vs_raw": 0.56},
    ]
    raw = {"enqueue_single": [{"rate": 1.0}], "enqueue_bulk": bulk}
    figures = run.summarise(raw, errands)
    assert figures["enqueue_bulk"] == 60_000
    assert figures["enqueue_bulk_raw"] == 120_000 and figures["enqueue_bulk_vs_raw"] == 0.56
    limit = {"figures": {"copy": 200_000.0, "copy_chunked": 150_000.0}}
    results: dict[str, Any] = {
        "systems": {"errands-pg": {"figures": figures}},
        "limit": {"postgres": limit},
    }
    results["shares"] = report.shares(results)
    assert results["shares"]["postgres"]["enqueue_bulk_vs_copy_chunked"] == 0.56
    (target,) = [t for t in report.targets(results) if t["target"].startswith("Enqueue bulk")]
    assert target["met"] and target["measured"].startswith(
        "56 % (median of the runs' shares, 50 %-62 %, each against the COPY timed"
    )
    rows = {row[0]: row[1:] for row in report._limit_rows(results, "postgres")}
    alternating = "COPY, 1,000 rows a transaction, alternating with errands' bulk enqueue"
    assert rows[alternating] == ["120,000", "60,000", "56 %"]
    # a run without the alternating figures (SQLite's, or an older one): the limit's COPY
    del figures["enqueue_bulk_raw"], figures["enqueue_bulk_vs_raw"]
    assert report.shares(results)["postgres"]["enqueue_bulk_vs_copy_chunked"] == 0.4
    assert alternating not in {row[0] for row in report._limit_rows(results, "postgres")}


def test_a_group_of_peers_measured_in_its_own_run_is_set_against_that_runs_errands() -> None:
    """Peers measured in a run of their own (bench.run --only errands --only PEER) come on
    the page with that run's errands figures and ratios, never another run's."""
    errands = next(s for s in SYSTEMS if s.name == "errands-pg")
    proc = next(s for s in SYSTEMS if s.name == "procrastinate")
    group: dict[str, Any] = {
        "started_at": "2026-12-03T15:27:00+0000", "duration_s": 3600.0,
        "load_before": [0.5], "load_after": [1.0], "plan": {"runs": 2},
        "systems": {
            "errands-pg": {"store": "postgres", "compare_to": "",
                           "raw": {**_raw([100, 100], "default"), **_raw([400, 400], "tuned")}},
            "procrastinate": {"store": "postgres", "compare_to": "errands-pg",
                              "raw": {**_raw([50, 50], "default"), **_raw([100, 200], "tuned")}},
        },
    }  # fmt: skip
    for name, system in (("errands-pg", errands), ("procrastinate", proc)):
        entry = group["systems"][name]
        entry["figures"] = run.summarise(entry["raw"], system)
    text = report.group_markdown(group)
    assert "Measured in their own run: procrastinate" in text
    assert "errands-pg / procrastinate" in text
    assert "(runs 2.00-4.00)" in text  # best against best, run by run: 400/200 and 400/100
    group["systems"]["procrastinate"]["configs"] = {
        "tuned": {"kind": "best", "settings": "concurrency 32", "source": "its docs"}
    }
    settings = report.settings_markdown({"systems": {}, "groups": [group]})
    assert "| procrastinate | tuned | best | concurrency 32 | its docs |" in settings


def test_the_scenarios_keep_the_third_party_phase_shapes() -> None:
    def total(name: str) -> float:
        return sum(p.seconds for p in scenarios.phases(name, 1.0, 600))

    # bench_harness/phases.py of hardbyte/postgresql-job-queue-benchmarking
    assert total("crash_recovery") == 30 + 60 + 60 + 60 + 60
    assert total("postgres_restart") == 30 + 60 + 60 + 60
    assert total("repeated_kills") == 30 + 60 + 120 + 60
    assert total("pg_backend_kill") == total("pool_exhaustion") == 30 + 60 + 60 + 60
    assert [p.seconds for p in scenarios.phases("active_readers", 1.0, 600)][2] == 600
    assert set(scenarios.SERVER_WIDE) <= set(scenarios.CHAOS)


def test_recovery_is_when_the_backlog_is_back_to_its_baseline_level() -> None:
    samples = []
    for t in range(40):
        sent = 100 * t
        done = sent - 50 if not 20 <= t < 30 else 100 * 20 - 50  # stalled from 20 to 29
        if t >= 30:
            done = sent - 50 if t >= 33 else sent - 300 * (33 - t)
        samples.append({"t": float(t), "sent": sent, "done": done})
    bounds = {"baseline": (5.0, 20.0)}
    assert scenarios.recovered_after(samples, bounds, 20.0, 100.0) == 13.0  # back at t=33


def test_pg_waldump_stats_are_parsed() -> None:
    line = (
        "Heap/UPDATE                                 9852 ( 13.55)              1926152 "
        "( 28.77)                    0 (  0.00)              1926152 ( 28.77)"
    )
    total = (
        "Total                                      72733                       6694765 "
        "[100.00%]                    0 [0.00%]              6694765 [100%]"
    )
    m = storage.STAT_ROW.match(line)
    assert m and m.group(1).strip() == "Heap/UPDATE" and int(m.group(3)) == 1926152
    t = storage.STAT_TOTAL.match(total)
    assert t and [int(x) for x in t.groups()] == [72733, 6694765, 0, 6694765]


def test_the_outage_and_the_third_party_recovery_time_come_from_the_completion_rate() -> None:
    rates = [(float(t), 100.0 if not 20 < t <= 30 else 0.0) for t in range(1, 50)]
    # the rate falls at t=21 and is back for the second ending at t=31
    assert scenarios.back_to_rate(rates, 20.0, 90.0, run=3) == 10.0
    assert scenarios.back_to_rate(rates, 30.0, 90.0, run=1) == 0.0
    assert scenarios.back_to_rate([(1.0, 0.0), (2.0, 50.0)], 0.0, 90.0, run=1) is None


def test_the_benchmarks_page_shows_a_kept_waiting_run_and_leaves_out_a_quick_one(
    tmp_path: Path,
) -> None:
    from bench.report import waiting_markdown

    def store(connections: int | None) -> dict[str, Any]:
        return {
            "wake_latency": {"jobs": 500, "p50_ms": 0.6, "p99_ms": 2.9},
            "many_waiters": {"waiters": 10000, "waiting_connections": connections,
                             "all_returned_s": 5.5},
            "enqueue": {"jobs": 5000, "sync_enqueue_per_s": 1775, "aenqueue_per_s": 3243},
        }  # fmt: skip

    kept = tmp_path / "waiting.json"
    kept.write_text(json.dumps({"quick": False, "postgres": store(1), "sqlite": store(None)}))
    page = waiting_markdown(kept)
    assert "| postgres | 0.60 | 2.90 | 10,000 | 1 | 5.5 | 1,775 | 3,243 |" in page
    assert "| sqlite | 0.60 | 2.90 | 10,000 | 0 |" in page
    kept.write_text(json.dumps({"quick": True, "postgres": store(1)}))
    assert waiting_markdown(kept) == ""


def test_the_machine_section_says_how_postgresql_ran_not_that_it_ran_at_its_defaults() -> None:
    """This machine's server runs with autovacuum off (a conf.d file): the page says so,
    and says when a run did not record its settings, instead of claiming defaults."""
    machine = {"postgresql_settings": {"autovacuum": "off (set in /etc/x/90-ci.conf)",
                                       "fsync": "on"}}  # fmt: skip
    line = report._pg_settings_line(machine)
    assert line == "PostgreSQL settings: autovacuum off (set in /etc/x/90-ci.conf), fsync on"
    assert "not recorded" in report._pg_settings_line({})


def test_an_update_with_some_scenario_cells_keeps_the_cells_measured_before() -> None:
    """A later run of the pressure cells alone (``--scenarios idle_in_tx --update``) adds
    its cells to the published ones; it replaced the whole section, dropping the chaos
    cells measured earlier."""
    published = json.loads((Path(run.RESULTS) / "latest.json").read_text())
    cell = published["scenarios"]["cells"]["crash_recovery/errands-pg"]

    def results(name: str, at: str) -> dict[str, Any]:
        return {
            "systems": {},
            "finished_at": at,
            "duration_s": 1.0,
            "load_before": 0.0,
            "load_after": 0.0,
            "scenarios": {"cells": {name: cell}, "where": at},
        }

    base = results("crash_recovery/errands-pg", "first")
    part = results("pg_backend_kill/errands-pg", "second")
    merged = run.merge_into(base, part, with_limit=False, with_scale=False)
    assert sorted(merged["scenarios"]["cells"]) == [
        "crash_recovery/errands-pg",
        "pg_backend_kill/errands-pg",
    ]
    assert merged["scenarios"]["where"] == "second"
    assert merged["updates"][-1]["sections"] == ["scenarios"]
