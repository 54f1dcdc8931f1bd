"""The Chancy side of ``bench.workflows --chancy`` (issue 18) runs at a tiny size: Chancy
workflows (steps with dependencies) for the fan-in latency, the 1 -> N -> 1 fan-out/
fan-in and a chain, with a real Chancy worker, in Chancy's bench venv and a database of
its own; and the benchmarks page shows Chancy's rows and errands' ratios to each peer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from bench.report import workflows_markdown
from bench.workflows import chancy

from tests.pg import pg_base_url, require_pg

pytestmark = [pytest.mark.acceptance, pytest.mark.xdist_group("bench_databases")]


# Like every peer adapter of the benchmarks (none runs in make test: each needs its own
# venv installed), it runs in `make test-peers`. Chancy's leader advances workflows, and
# its Leadership plugin first tries to lead after 60 s: the run takes a minute or more.
@pytest.mark.peers
@pytest.mark.timeout(900)  # the first run makes Chancy's venv (pip install)
def test_the_chancy_side_of_the_workflow_bench_runs_and_records_every_figure() -> None:
    require_pg()
    parts = urlsplit(pg_base_url())
    url = urlunsplit(parts._replace(path="/bench_chancy_smoke", query=""))
    figures = chancy(url, batches=3, width=3, fan=10, steps=5, send_outgoing_interval=0.05)
    latency = figures["fan_in_latency"]
    assert (latency["batches"], latency["width"]) == (3, 3)
    assert 0 < latency["p50_ms"] <= latency["max_ms"]
    assert figures["fan_out_fan_in"]["members_per_s"] > 0
    assert figures["chain"]["steps_per_s"] > 0


def shape(p50: float, members: float, steps: float) -> dict[str, Any]:
    return {
        "fan_in_latency": {"batches": 20, "width": 10, "p50_ms": p50, "p99_ms": 2 * p50},
        "fan_out_fan_in": {"width": 200, "members_per_s": members},
        "chain": {"steps": 50, "steps_per_s": steps},
    }


def test_the_benchmarks_page_shows_chancy_beside_errands_with_the_ratios(
    tmp_path: Path,
) -> None:
    kept = tmp_path / "workflows.json"
    run = {"at": "2026-12-03T10:40:00+0000", "store": "postgresql", "load_before": 1.2,
           "load_after": 2.0, "quick": True}  # fmt: skip
    kept.write_text(json.dumps({
        **shape(5.0, 1000, 100), "celery": shape(10.0, 50, 40),
        "chancy": shape(900.0, 40, 2), "chancy_fast_updates": shape(50.0, 200, 20),
        "run": run,
    }))  # fmt: skip
    page = workflows_markdown(kept)
    assert "`python -m bench.workflows --celery --chancy`" in page
    assert "**Small sizes** (`--quick`" in page
    assert "| chancy | 900.0 | 1800.0 | 40 | 2.0 |" in page
    assert "| chancy, updates every 50 ms | 50.0 | 100.0 | 200 | 20 |" in page
    # latency: the peer's over errands'; rates: errands' over the peer's
    assert "| chancy | 180.0x | 180.0x | 25.0x | 50.0x |" in page
    assert "| celery | 2.0x | 2.0x | 20.0x | 2.5x |" in page


def test_a_workflows_run_without_chancy_shows_no_chancy_rows(tmp_path: Path) -> None:
    kept = tmp_path / "workflows.json"
    kept.write_text(json.dumps({**shape(5.0, 1000, 100), "run": {"store": "postgresql"}}))
    page = workflows_markdown(kept)
    assert "chancy" not in page.lower() and "errands against each peer" not in page
