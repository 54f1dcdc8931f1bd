"""The Celery side of ``bench.workflows --celery`` (issue 18) runs at a tiny size: a chord
on Redis (broker and result backend) for the fan-in latency and the 1 -> N -> 1 fan-out/
fan-in, and a chain, with a real ``celery worker``, in Celery's bench venv."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from bench.report import workflows_markdown
from bench.workflows import celery

from tests.pg import unavailable

pytestmark = [pytest.mark.acceptance, pytest.mark.xdist_group("bench_databases")]

REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/7")


def require_redis() -> None:
    parts = urlsplit(REDIS_URL)
    try:
        socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379), 2).close()
    except OSError as exc:
        unavailable(f"no Redis at {REDIS_URL} ({exc}); start one or set BENCH_REDIS_URL")


# Like every peer adapter of the benchmarks (none runs in make test: each needs its own
# venv installed), it runs in `make test-peers`.
@pytest.mark.peers
@pytest.mark.timeout(600)  # the first run makes Celery's venv (pip install)
def test_the_celery_side_of_the_workflow_bench_runs_and_records_every_figure() -> None:
    require_redis()
    figures = celery(REDIS_URL, batches=3, width=3, fan=10, steps=5)
    latency = figures["fan_in_latency"]
    assert (latency["batches"], latency["width"]) == (3, 3)
    assert 0 < latency["p50_ms"] <= latency["max_ms"]
    assert figures["fan_out_fan_in"]["members_per_s"] > 0
    assert figures["chain"]["steps_per_s"] > 0


def test_the_benchmarks_page_shows_a_kept_workflow_run_as_preliminary_with_its_load(
    tmp_path: Path,
) -> None:
    def shape(p50: float, members: float, steps: float) -> dict[str, Any]:
        return {
            "fan_in_latency": {"batches": 100, "width": 10, "p50_ms": p50, "p99_ms": 2 * p50},
            "fan_out_fan_in": {"width": 2000, "members_per_s": members},
            "chain": {"steps": 200, "steps_per_s": steps},
        }

    kept = tmp_path / "workflows.json"
    run = {"at": "2026-12-01T22:40:00+0000", "store": "postgresql", "load_before": 16.2,
           "load_after": 18.0}  # fmt: skip
    kept.write_text(json.dumps({**shape(4.0, 1500, 300), "celery": shape(16.0, 26, 19),
                                "run": run}))  # fmt: skip
    page = workflows_markdown(kept)
    assert "Preliminary figures" in page and "16.2 before, 18.0 after" in page
    assert "| errands-postgresql | 4.0 | 8.0 | 1,500 | 300 |" in page
    assert "| celery | 16.0 | 32.0 | 26 | 19 |" in page
    assert workflows_markdown(tmp_path / "none.json") == ""  # no run kept: no section
