"""A small-N run of ``make bench`` so the harness cannot rot (issue 8, item 5).

It runs the real entry point (``python -m bench.run --smoke``: tiny counts) for errands
on SQLite and PostgreSQL, the raw SQL limit and the long-run memory section, then checks
the JSON it wrote: every figure measured, nothing failed. Figures are never compared with a time or
a rate here (benchmarks report, they do not assert); the full run is ``make bench``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.pg import require_pg

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.acceptance
# The harness makes and drops databases named bench_errands_pg, bench_limit, ...: here
# under a prefix of this process's own, so two suites on one server (two checkouts, two
# xdist processes) never drop each other's.
ENV = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "BENCH_DB_PREFIX": f"bench_t{os.getpid()}_"}


def run_bench(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m bench...`` here; exit 0 or fail with its output's tail, also when it
    overran ``timeout`` (a stalled step then shows in the log where it stalled)."""
    # Scratch files of its own: bench.run deletes its folder at the end, and two smoke
    # runs at once shared bench/.work (one deleted it under the other: "folder ... does
    # not exist").
    env = {**ENV, "BENCH_WORK": tempfile.mkdtemp(prefix="bench-work-")}
    try:
        run = subprocess.run(
            [sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
            timeout=timeout, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        out = exc.stderr or b""
        text = out.decode(errors="replace") if isinstance(out, bytes) else out
        pytest.fail(f"{args[0]} ran past {timeout:g} s; its log so far:\n{text[-3000:]}")
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.mark.timeout(300)
def test_the_benchmark_harness_runs_end_to_end_and_records_every_figure(tmp_path: Path) -> None:
    require_pg()
    run = run_bench(
        [
            "bench.run", "--smoke", "--only", "errands", "--only", "limit", "--only", "memory",
            "--no-scale", "--results", str(tmp_path),
        ],
        timeout=280,
    )  # fmt: skip
    results = json.loads((tmp_path / "partial.json").read_text())
    assert results["mode"] == "smoke"
    for name in ("errands-sqlite", "errands-pg"):
        system = results["systems"][name]
        assert system["error"] is None and system["failures"] == [], system
        figures = system["figures"]
        for key in (
            "enqueue_single",
            "enqueue_single_raw",
            "enqueue_single_vs_raw",
            "enqueue_bulk",
            "enqueue_async",
            "enqueue_async_concurrent",
            "throughput_1",
        ):
            assert figures.get(key) and figures[key] > 0, (name, key, figures)
    # PostgreSQL's bulk enqueue is timed alternating with the raw COPY, as the target reads it
    pg = results["systems"]["errands-pg"]["figures"]
    assert pg["enqueue_bulk_raw"] > 0 and pg["enqueue_bulk_vs_raw"] > 0, pg
    for store in ("postgres", "sqlite"):
        limit = results["limit"][store]
        assert "error" not in limit and all(v > 0 for v in limit["figures"].values()), limit
        memory = results["memory"][store]
        assert not memory.get("error"), memory
        assert memory["checkpoints"][-1]["completed"] >= memory["jobs"]
        assert memory["stopped_cleanly"] is True
    assert any(t["target"].startswith("Enqueue bulk") for t in results["targets"])
    assert "issue 8 and 17 targets" in run.stdout
    # Both views, and every configuration's figures under its own label (the smoke plan
    # measures one process's rate of the configurations beyond the defaults: each still
    # starts its workers with its own options; the full plan measures each in full).
    for name in ("errands-sqlite", "errands-pg"):
        figures = results["systems"][name]["figures"]
        assert set(figures["configs"]) == {"default", "tuned", "async"}
        assert figures["best_config"] == "tuned" or figures["configs"]["tuned"]["throughput_1"]
        for config in figures["configs"].values():
            assert config["throughput_1"], config
        default = figures["configs"]["default"]
        assert default["throughput_2"] and default["latency_p50"], default
    pg_runs = results["systems"]["errands-pg"]["raw"]["throughput_1@default"]
    assert "after_prefill" in pg_runs[0]["hooks"]  # ANALYZE ran between prefill and workers


@pytest.mark.timeout(300)
def test_the_storage_and_scenario_steps_run_end_to_end(tmp_path: Path) -> None:
    """Issue 17's steps at toy sizes on the test server: the storage cost per job (with
    its pg_waldump breakdown when the server's WAL is readable here), one chaos cell that
    acts on nothing but the system's own workers, and one pressure cell. The server-wide
    cells (PostgreSQL restart, pool exhaustion) are skipped, as they must be on a shared
    server; they run with --scratch-pg."""
    require_pg()
    run_bench(
        [
            "bench.run", "--no-systems", "--only", "errands-pg",
            "--storage", "--storage-jobs", "200",
            "--scenarios", "crash_recovery,idle_in_tx,postgres_restart",
            "--scenario-scale", "0.008", "--pressure-seconds", "2", "--scenario-rate", "100",
            "--drain-seconds", "40", "--results", str(tmp_path),
        ],
        timeout=280,
    )  # fmt: skip
    results = json.loads((tmp_path / "partial.json").read_text())
    cells = results["storage"]["systems"]["errands-pg"]
    assert set(cells) == {"default", "tuned", "async", "tuned+checkpoint"}
    for cell in cells.values():
        assert not cell.get("error"), cell
        assert cell["jobs"] == 200 and cell["wal_per_job"] > 0 and cell["bytes_per_1m"] > 0
    sc = results["scenarios"]["cells"]
    assert "skipped" in sc["postgres_restart/errands-pg"]
    for name in ("crash_recovery", "idle_in_tx"):
        cell = sc[f"{name}/errands-pg"]
        assert not cell.get("error"), cell
        assert cell["sent"] > 0 and cell["lost"] == 0, cell
        assert cell["series"] and cell["phases"]["recovery"]["rate"] is not None
    assert any(t["target"].startswith("WAL ≤") for t in results["targets"])


@pytest.mark.timeout(200)
def test_the_waiting_bench_runs_and_records_every_figure(tmp_path: Path) -> None:
    """`python -m bench.waiting --quick` (issue 20) measures wake-up latency, waiters per
    connection and async enqueue on both stores; one connection serves every waiter."""
    require_pg()
    run_bench(["bench.waiting", "--quick", "--results", str(tmp_path)], timeout=180)
    results = json.loads((tmp_path / "waiting.json").read_text())
    assert results["preliminary"] is True
    for store in ("sqlite", "postgres"):
        figures = results[store]
        assert figures["wake_latency"]["p50_ms"] > 0
        assert figures["many_waiters"]["all_returned_s"] > 0
        assert figures["enqueue"]["aenqueue_per_s"] > 0
    assert results["postgres"]["many_waiters"]["waiting_connections"] == 1


@pytest.mark.timeout(200)
def test_the_workflow_bench_runs_and_records_every_figure(tmp_path: Path) -> None:
    """`python -m bench.workflows --quick` (issue 18): fan-in latency, a fan-out/fan-in's
    and a chain's throughput, with a real worker process."""
    out = tmp_path / "workflows.json"
    run_bench(
        ["bench.workflows", "--quick", "--url", f"sqlite:///{tmp_path}/wf.db", "--json", str(out)],
        timeout=180,
    )
    figures = json.loads(out.read_text())
    assert figures["fan_in_latency"]["p50_ms"] > 0
    assert figures["fan_out_fan_in"]["members_per_s"] > 0
    assert figures["chain"]["steps_per_s"] > 0


@pytest.mark.timeout(120)
def test_the_pairs_tool_alternates_its_systems_and_records_each_round(tmp_path: Path) -> None:
    """`python -m bench.pairs` (a quick A/B beside the full harness): a round runs each
    system once, a configuration's options overridden by JSON, ratios per round."""
    out = tmp_path / "pairs.json"
    tuned, capped = "errands-sqlite:tuned", 'errands-sqlite:tuned:{"concurrency": 2}'
    args = ["bench.pairs", "--pairs", "1", "--jobs", "200", "--results", str(out)]
    run_bench([*args, "--system", tuned, "--system", capped], timeout=110)
    results = json.loads(out.read_text())
    assert [r["round"] for r in results["runs"][capped]] == [1]
    assert all(r["rate"] > 0 and r["done"] == 200 for r in results["runs"][tuned])
    assert results["summary"][tuned]["ratios"] == [1.0]
    assert results["summary"][capped]["ratios"][0] > 0


def test_the_pairs_tool_names_what_it_does_not_know() -> None:
    from bench.pairs import parse_system

    _, system, options = parse_system('errands-pg:tuned:{"concurrency": 4}')
    assert system.name == "errands-pg" and options["concurrency"] == 4
    assert options["prefetch"] == 1024  # the rest of the configuration kept
    with pytest.raises(SystemExit, match=r"no system 'nope'; choose one of: .*errands-pg"):
        parse_system("nope:tuned")
    with pytest.raises(SystemExit, match="errands-pg has no configuration 'fast': default"):
        parse_system("errands-pg:fast")
    with pytest.raises(SystemExit, match="must be a JSON object"):
        parse_system("errands-pg:tuned:{oops")
