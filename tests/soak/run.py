"""One soak run: start the workers, stream the workload, inject the chaos, drain, check.

::

    workload thread ──enqueue──> store <──claim/finish── 3 worker processes
                                   ^                         ^  (PostgreSQL: each
    chaos driver ──faults, canaries┘      SIGKILL/STOP/CONT ─┘   behind its own proxy)

    then: heal everything, wait for the backlog to drain, SIGTERM the workers,
    check I1-I10 (checker.py) and write the report (report.py).
"""

from __future__ import annotations

import os
import platform
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import soak_app

from tests.pg import own_server_of

from . import dashboard_check
from .chaos import POSTGRES_KINDS, SQLITE_KINDS, Chaos, Restarter
from .checker import TERMINAL, Findings, check
from .cluster import Cluster
from .report import render
from .store import Store
from .workflows import Sizes
from .workload import Ledger, Workload

CRON_JOB = "soak.cron"  # its slots keep coming: the drain waits only for those due before it

FAULT_POINTS = "after_step:0.002,before_complete_commit:0.003,after_complete_commit:0.003"
# The workflows' fan-in path (tests/soak/workflows.py): each point at this probability,
# lowered so that it fires about FAN_IN_CRASHES times in the run however many members
# end (1,000 batches of 100 would otherwise mean a thousand worker restarts).
FAN_IN_POINTS = {"before_fan_in": 0.01, "before_callback_insert": 0.02, "after_fan_in_commit": 0.01}
FAN_IN_CRASHES = 10


def fan_in_points(sizes: Sizes) -> str:
    """The fan-in fault points for a run carrying ``sizes``' workflows."""
    reached = {
        "before_fan_in": sizes.jobs(),  # each member's end (sizes.jobs() counts callbacks too)
        "before_callback_insert": sizes.callbacks(),
        "after_fan_in_commit": sizes.jobs(),
    }
    return ",".join(
        f"{point}:{min(p, FAN_IN_CRASHES / max(reached[point], 1)):.2g}"
        for point, p in FAN_IN_POINTS.items()
    )


# Rough seconds one fault of each kind takes (fault, heal, canary, gap), to pace the
# workload so that jobs keep flowing for the whole chaos plan.
EPISODE_SECONDS = {
    "sigkill": 2.5,
    "sigstop": 8.0,
    "conn_kill": 3.5,
    "pg_restart": 4.0,
    "proxy_cut": 7.5,
    "cancel": 6.0,
    "sigterm": 9.0,
}


# Workflows at the CI size: every shape twice or more, a few batches (one of them dead).
CI_WORKFLOWS = Sizes(batches=5, batch_size=10, dags=14)
# Issue 18's full size: 1,000 batches of 100 members and 200 DAGs.
FULL_WORKFLOWS = Sizes(batches=1000, batch_size=100, dags=200)


def workflow_sizes(default: Sizes) -> Sizes:
    """``default``, with what SOAK_WF_BATCHES, SOAK_WF_BATCH_SIZE, SOAK_WF_DAGS say."""
    sizes = Sizes(
        batches=int(os.environ.get("SOAK_WF_BATCHES", default.batches)),
        batch_size=int(os.environ.get("SOAK_WF_BATCH_SIZE", default.batch_size)),
        dags=int(os.environ.get("SOAK_WF_DAGS", default.dags)),
    )
    if min(sizes.batches, sizes.dags) < 0 or sizes.batch_size < 1:
        raise ValueError(f"SOAK_WF_*: counts >= 0 and a batch size >= 1, got {sizes}")
    return sizes


@dataclass
class SoakConfig:
    backend: str  # "sqlite" or "postgres"
    jobs: int
    workers: int = 3
    concurrency: int = 8
    lease: float = soak_app.LEASE
    poll_interval: float = 0.05
    maintenance_tick: float = 0.2
    min_faults: int = 1  # each fault kind at least this many times
    gap: tuple[float, float] = (0.3, 1.2)  # seconds between two faults
    backlog_cap: int = 3000
    rate: float | None = None  # jobs/s of the mix; None: spread over the fault plan
    unique_every: float = 8.0
    fault_points: str = FAULT_POINTS  # and the fan-in's, by the workflows' sizes
    # workflows spread over the run (tests/soak/workflows.py); the CI size by default
    workflows: Sizes = field(default_factory=lambda: CI_WORKFLOWS)
    chaos_limit: float = 3600.0  # stop injecting after this long, whatever the plan
    drain_timeout: float = 180.0
    kinds: tuple[str, ...] | None = None  # only these fault kinds (default: all of the backend)
    # I9 past its bound fails the run (full size) or is reported (CI size: a timing bound
    # must not fail `make test` on a loaded 2-core machine)
    enforce_i9: bool = True
    seed: int = field(default_factory=lambda: random.randrange(1 << 30))


@dataclass
class SoakResult:
    config: SoakConfig
    findings: Findings
    text: str

    @property
    def ok(self) -> bool:
        return not self.findings.violations


def run_soak(
    config: SoakConfig, folder: Path, url: str, pg_restart: Restarter | None = None
) -> SoakResult:
    """``pg_restart``: how to restart the PostgreSQL server (a private cluster's); None:
    the local ``pg_ctlcluster`` cluster serving ``url`` when there is one (as root)."""
    rng = random.Random(config.seed)
    store = Store(url)
    store.create_tables()
    app = soak_app.app
    app.close()
    app.url = url
    app.migrate()
    if pg_restart is None and not store.sqlite:
        server = own_server_of(url)  # the tests' own cluster: restarting it disturbs no one
        if server is not None:
            pg_restart = server.restart
    kinds = config.kinds or (SQLITE_KINDS if store.sqlite else POSTGRES_KINDS)
    notes = []
    if not store.sqlite and pg_restart is None:
        kinds = tuple(k for k in kinds if k != "pg_restart")
        notes.append("PostgreSQL restarts skipped: the store is not the tests' own cluster")
    cluster = Cluster(
        folder,
        store,
        workers=config.workers,
        concurrency=config.concurrency,
        poll_interval=config.poll_interval,
        maintenance_tick=config.maintenance_tick,
        lease=config.lease,
        fault_points=",".join(
            p for p in (config.fault_points, fan_in_points(config.workflows)) if p
        ),
    )
    ledger = Ledger()
    planned = config.min_faults * sum(EPISODE_SECONDS[k] for k in kinds)
    if config.rate:  # the mix and the workflows' jobs together keep to the rate
        planned = max(planned, (config.jobs + config.workflows.jobs()) / config.rate)
    workload = Workload(
        store,
        app,
        ledger,
        total=config.jobs,
        planned_seconds=planned,
        backlog_cap=config.backlog_cap,
        unique_every=config.unique_every,
        rng=random.Random(rng.random()),
        workflows=config.workflows,
    )
    chaos = Chaos(
        cluster=cluster,
        store=store,
        workload=workload,
        app=app,
        rng=random.Random(rng.random()),
        kinds=kinds,
        lease=config.lease,
        gap=config.gap,
        pg_restart=pg_restart,
    )
    timings: dict[str, float] = {}
    exit_codes: dict[str, int | None] = {}
    try:
        started = time.monotonic()
        wall_started = time.time()
        cluster.start()
        timings["startup"] = time.monotonic() - started
        workload.start()
        chaos_started = time.monotonic()
        chaos.run(
            min_each=config.min_faults,
            workload_done=workload.done.is_set,
            # Paced by a rate: keep the pace to the end. Paced by the plan: the plan is
            # done, so enqueue what is left now.
            on_plan_done=(lambda: None) if config.rate else workload.hurry.set,
            deadline=chaos_started + config.chaos_limit,
        )
        timings["chaos"] = time.monotonic() - chaos_started
        workload.hurry.set()
        while not workload.done.wait(0.2):
            cluster.supervise()
        if workload.error is not None:
            raise workload.error
        quiesced_at, _ = drain(store, cluster, config.drain_timeout)
        last_heal = max((ep.healed for ep in chaos.episodes), default=quiesced_at)
        timings["drain after the last fault"] = time.time() - last_heal
        timings["total"] = time.monotonic() - started
        exit_codes = cluster.stop_all(graceful=True)
        findings = check(
            store,
            ledger,
            chaos,
            quiesced_at=quiesced_at,
            lease=config.lease,
            poll_interval=config.poll_interval,
            enforce_i9=config.enforce_i9,
        )
        _process_findings(findings, cluster, chaos, exit_codes, timings)
        dashboard_check.recheck(findings, app)
        short = {k: chaos.counts[k] for k in kinds if chaos.counts[k] < config.min_faults}
        if short:
            findings.fail(
                "plan", f"fault kinds injected fewer than {config.min_faults} times: {short}"
            )
        findings.figures["notes"] = notes + chaos.log
        findings.figures["episodes"] = [
            f"{ep.kind}@{ep.started - wall_started:.1f}s+{ep.healed - ep.started:.1f}s "
            f"rec={'-' if ep.recovery is None else f'{ep.recovery:.2f}'} {ep.detail}".strip()
            for ep in chaos.episodes
        ]
        text = render(config, findings, store, timings, platform_info(store))
        (folder / f"soak-report-{config.backend}.txt").write_text(text)
        return SoakResult(config, findings, text)
    finally:
        workload.close()
        chaos.close()
        cluster.close()
        app.close()
        store.close()


def drain(store: Store, cluster: Cluster, timeout: float) -> tuple[float, float]:
    """Wait until every job inserted so far is terminal, and every job inserted since
    too except cron's (cron keeps adding slots): a workflow whose last member ends
    during the drain inserts its callbacks then, and they must run before the workers
    stop (a CI-sized run once stopped them with two callbacks still available); then until
    every death's on_dead hooks ran; returns (the moment the drain began, seconds it
    took)."""
    since = time.time()
    begun = time.monotonic()
    marks = ", ".join(f"'{s}'" for s in TERMINAL)
    while time.monotonic() - begun < timeout:
        cluster.supervise()
        left = store.scalar(
            f"SELECT count(*) FROM {{s}}errands_jobs WHERE state NOT IN ({marks}) "
            f"AND ({store.epoch('inserted_at')} <= %s OR name <> %s)",
            (since, CRON_JOB),
        )
        if not left:
            break
        time.sleep(0.1)
    # Then the on_dead hooks of every death: a worker killed before it ran them left their
    # record, which the leader takes over after the app's grace (soak_app: 6 s).
    while time.monotonic() - begun < timeout:
        cluster.supervise()
        if not store.scalar("SELECT count(*) FROM {s}errands_dead_hooks"):
            break
        time.sleep(0.1)
    return since, time.monotonic() - begun


def _process_findings(
    findings: Findings,
    cluster: Cluster,
    chaos: Chaos,
    exit_codes: dict[str, int | None],
    timings: dict[str, float],
) -> None:
    logs = cluster.log_counts()
    faults = dict(chaos.counts)
    if logs["fault points fired"]:
        faults["fault point crash (F2)"] = logs["fault points fired"]
    findings.figures["faults injected"] = faults
    findings.figures["sessions terminated"] = chaos.terminated
    findings.figures["worker log"] = dict(logs)
    findings.figures["stale writes rejected"] = logs["stale writes rejected"]
    findings.figures["worker processes started"] = len(cluster.procs)
    findings.figures["workers that refused to start (database away)"] = cluster.refused
    if cluster.startup_crashes:  # its startup steps retry transient errors (Worker._at_startup)
        findings.fail(
            "workers",
            f"{len(cluster.startup_crashes)} worker(s) died while starting, on a transient "
            "database error they should have waited out",
            cluster.startup_crashes,
        )
    crashed = {c: n for c, n in cluster.exits.items() if c != "86"}  # 86: a fault point
    if crashed:
        findings.fail(
            "workers",
            f"worker processes exited by themselves, by exit code: {crashed}",
            cluster.exit_tails,
        )
    unclean = {k: v for k, v in exit_codes.items() if v != 0}
    if unclean:
        findings.fail("F4", f"workers did not stop cleanly on SIGTERM: {unclean}")
    done = sum(n for s, n in findings.figures["states"].items() if s in TERMINAL)
    total = timings.get("total") or 1.0
    findings.figures["throughput jobs/s (whole run)"] = round(done / total, 1)


def platform_info(store: Store) -> dict[str, str]:
    import sqlite3

    import errands

    info = {
        "machine": f"{_cpu()}, {_cores()} cores, {_memory()} RAM, Linux {platform.release()}",
        "python": platform.python_version(),
        "errands": errands.__version__,
        "sqlite": sqlite3.sqlite_version,
    }
    if not store.sqlite:
        import psycopg

        info["postgresql"] = str(store.scalar("SHOW server_version"))
        info["psycopg"] = psycopg.__version__
    return info


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


def _memory() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return f"{int(line.split()[1]) / 1024 / 1024:.0f} GiB"
    except OSError:
        pass
    return "?"
