"""The chaos soak of RELIABILITY.md on both backends (issue 10).

- ``test_chaos_soak_ci``: CI-sized (2,000 jobs per backend and a few workflows of every
  shape, every fault kind at least once, about a minute per backend); runs in ``make test``.
- ``test_chaos_soak_full``: the published figures (``make soak``): 100,000 jobs per
  backend by default (``SOAK_JOBS`` overrides) beside issue 18's workflows (1,000 batches
  of 100 members and 200 DAGs: ``SOAK_WF_BATCHES``, ``SOAK_WF_BATCH_SIZE``,
  ``SOAK_WF_DAGS``), every fault kind at least 10 times (``SOAK_MIN_FAULTS``), a random
  seed (``SOAK_SEED`` replays a report's); see docs/reliability.md.

Both assert I1-I10 (see checker.py) and W1-W7 (workflows.py) and print their report in
the terminal summary, except I9's timing bound, which only the full-size run enforces
(the CI-sized one reports it). On PostgreSQL both run on the tests' own cluster
(tests/pg.py), so the restarts they inject touch no shared server.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .conftest import REPORTS, SoakStore
from .run import CI_WORKFLOWS, FULL_WORKFLOWS, SoakConfig, SoakResult, run_soak, workflow_sizes

BACKENDS = ("sqlite", "postgres")
# Issue 10's CI size, under a minute per backend on a 2-core machine: every fault kind of
# the backend once (`make soak`: 10 times each).
# One xdist worker runs every test that uses the tests' own PostgreSQL cluster (the SQLite
# run needs no server: it runs beside it, on another).
OWN_POSTGRES = pytest.mark.xdist_group("own_postgres")
CI_BACKENDS = ("sqlite", pytest.param("postgres", marks=OWN_POSTGRES))
# 2,000: the fault plan, not the job count, sets the run's length (every kind once, ~40 s).
# 5,000 (until 2026-12-04) were offered faster than 3 loaded workers run them, and the
# backlog took 20 s more to drain, with nothing more checked; 3,000 still did in a CI run
# beside the rest of the suite (pickup p50 22 s, 29 s of drain). 2,000 still send every
# kind of the mix several times (the rarest, 0.3 %, ~6), a transactional burst twice, the
# noisy tenant's burst once.
CI_JOBS = {"sqlite": 2_000, "postgres": 2_000}
CI_ROUNDS = {"sqlite": 1, "postgres": 1}
# Full size: a steady rate (the mix and the workflows' members together) within what 3
# workers sustain on 2 cores under the faults, so pickup latency measures the faults, not
# a standing backlog. PostgreSQL was offered 150 until the evening of 2026-12-03, when
# its full-size runs with the workflows sustained 103 and 131 jobs/s, then 110 until the
# run of 2026-12-04, which kept up (113.6 jobs/s over the run) but with the default queue's
# pickup p50 at 10.6 s: no room to drain what a fault piles up. SQLite at 90 kept up with
# room (pickup p50 0.34 s; docs/reliability.md).
FULL_RATE = {"sqlite": 90.0, "postgres": 95.0}


def _run(config: SoakConfig, tmp_path: Path, store: SoakStore, title: str) -> SoakResult:
    result = run_soak(config, tmp_path, store.url, store.restart)
    REPORTS.append((title, result.text))
    keep = os.environ.get("SOAK_REPORT_DIR")  # make soak: keep the reports beside the repo
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        (Path(keep) / f"soak-{config.backend}-{config.jobs}.txt").write_text(result.text)
    assert result.ok, result.text
    return result


@pytest.mark.acceptance
@pytest.mark.timeout(900)  # about 50 s each; generous for a loaded 2-core machine
@pytest.mark.parametrize("backend", CI_BACKENDS)
def test_chaos_soak_ci(backend: str, soak_store: SoakStore, tmp_path: Path) -> None:
    """Given 3 workers and a stream of mixed jobs, when every fault kind strikes at
    least once, then nothing is lost, every duplicate execution is explained by a
    recorded lease loss, and I1-I8, I10 hold; I9 is reported (a timing bound does not
    fail `make test` on a loaded machine; the full-size run enforces it)."""
    config = SoakConfig(
        backend=backend,
        jobs=CI_JOBS[backend],
        min_faults=CI_ROUNDS[backend],
        enforce_i9=False,
        workflows=workflow_sizes(CI_WORKFLOWS),
    )
    _run(config, tmp_path, soak_store, f"chaos soak (CI size) on {backend}")


@pytest.mark.soak
@pytest.mark.timeout(4 * 3600)
@pytest.mark.parametrize("backend", BACKENDS)
@OWN_POSTGRES
def test_chaos_soak_full(backend: str, soak_store: SoakStore, tmp_path: Path) -> None:
    """The full-size run whose figures docs/reliability.md publishes."""
    config = SoakConfig(
        backend=backend,
        jobs=int(os.environ.get("SOAK_JOBS", "100000")),
        min_faults=int(os.environ.get("SOAK_MIN_FAULTS", "10")),
        rate=float(os.environ.get("SOAK_RATE", FULL_RATE[backend])),
        backlog_cap=1500,
        gap=(2.0, 8.0),  # faults at random intervals, with time to recover in between
        drain_timeout=900.0,
        chaos_limit=3 * 3600.0,
        workflows=workflow_sizes(FULL_WORKFLOWS),
    )
    if os.environ.get("SOAK_SEED"):  # replay a run's workload and faults (its report's seed)
        config.seed = int(os.environ["SOAK_SEED"])
    result = _run(config, tmp_path, soak_store, f"chaos soak (full size) on {backend}")
    faults = result.findings.figures["faults injected"]
    assert all(
        faults.get(k, 0) >= config.min_faults
        for k in result.findings.figures.get("fault kinds", faults)
    ), faults
