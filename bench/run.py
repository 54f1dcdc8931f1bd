"""``make bench``: errands and its peers, side by side, in one run on this machine.

    python -m bench.run                 # full: every figure the median of 5 runs (~2.5 h)
    python -m bench.run --quick         # 1 run, small counts: a few minutes, for development
    python -m bench.run --only errands  # errands-sqlite + errands-pg (+ limit, scale, memory)
    python -m bench.run --only pgqueuer --only limit
    python -m bench.run --no-systems --storage --scratch-pg        # storage cost per job
    python -m bench.run --no-systems --finished-rows 10000000 --scratch-pg   # slow: ~1 h
    python -m bench.run --no-systems --scenarios --scratch-pg      # chaos and pressure

Each system runs through a small adapter under ``bench/peers/`` with its own venv's
python (see :mod:`bench.systems`); each scenario gets a fresh store (a PostgreSQL
database cloned from a migrated template, a flushed Redis db, a new SQLite file). A full
run writes ``bench/results/latest.json`` and ``docs/benchmarks.md``; a quick or partial
run writes ``bench/results/partial.json`` and leaves those alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from . import limit, machine, memory, report, scale, scenarios, storage
from .systems import BENCH, PEERS, SYSTEMS, System, by_name, python_for, versions

RESULTS = BENCH / "results"
# Scratch files (SQLite stores) of one run, deleted at its end: BENCH_WORK names another
# folder (two runs at once, as the smoke tests are, deleted each other's).
WORK = Path(os.environ.get("BENCH_WORK") or BENCH / ".work")
PG_URL_DEFAULT = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS_URL_DEFAULT = "redis://127.0.0.1:6379"
REDIS_DB = {"celery": 1, "dramatiq": 2}
ATTEMPTS = 3  # a scenario that fails (a server restarted under it) is tried again


@dataclass(frozen=True)
class Plan:
    runs: int
    single_jobs: int
    bulk_jobs: int
    throughput_jobs: int
    cap: float  # seconds of processing at most per throughput run (slow peers)
    latency_jobs: int
    latency_rate: float
    concurrency: int
    limit_jobs: int
    limit_single: int
    limit_cap: float
    scale_rows: int
    scale_jobs: int
    scale_runs: int
    memory_jobs: int  # jobs one worker runs while its RSS is sampled (bench.memory)
    min_window: float = 10.0  # a capped system's prefill covers at least this long
    # False: a system's configurations after its defaults measure one process's rate only
    # (the smoke test: every step still runs, each configuration still starts its workers)
    every_config_in_full: bool = True


# Issue 17: >= 100,000 jobs or >= 10 s of processing per figure, >= 5 runs, interleaved.
FULL = Plan(
    runs=5,
    single_jobs=30_000,  # >= 10 s of calls at the fastest single-call enqueue seen here
    bulk_jobs=100_000,
    throughput_jobs=100_000,
    cap=20.0,
    latency_jobs=500,
    latency_rate=50.0,
    concurrency=32,
    limit_jobs=20_000,
    limit_single=1000,
    limit_cap=8.0,
    scale_rows=1_000_000,
    scale_jobs=20_000,
    scale_runs=3,
    memory_jobs=memory.JOBS,
)
QUICK = Plan(
    runs=1,
    single_jobs=200,
    bulk_jobs=2000,
    throughput_jobs=3000,
    cap=3.0,
    latency_jobs=100,
    latency_rate=50.0,
    concurrency=32,
    limit_jobs=3000,
    limit_single=200,
    limit_cap=3.0,
    scale_rows=100_000,
    scale_jobs=3000,
    scale_runs=1,
    memory_jobs=10_000,
)
# The suite's smoke test (tests/bench): every step runs and records a figure; no figure
# from it means anything.
SMOKE = Plan(
    runs=1,
    single_jobs=50,
    bulk_jobs=500,
    throughput_jobs=600,
    cap=2.0,
    latency_jobs=20,
    latency_rate=50.0,
    concurrency=8,
    limit_jobs=600,
    limit_single=50,
    limit_cap=2.0,
    scale_rows=10_000,
    scale_jobs=600,
    scale_runs=1,
    memory_jobs=800,
    min_window=1.0,
    every_config_in_full=False,
)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- stores ----------------------------------------------------------------------------


class Postgres:
    """The harness's databases on one server. Their names start with ``bench_``, or with
    ``$BENCH_DB_PREFIX`` instead, so two runs on one server (two checkouts' test suites)
    never drop each other's databases."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.prefix = os.environ.get("BENCH_DB_PREFIX", "bench_")

    def name(self, db: str) -> str:
        if db.startswith(self.prefix) or not db.startswith("bench_"):
            return db
        return self.prefix + db.removeprefix("bench_")

    def url(self, db: str) -> str:
        parts = urlsplit(self.base)
        return urlunsplit(parts._replace(path=f"/{self.name(db)}", query=""))

    def _admin(self) -> Any:
        import psycopg

        return psycopg.connect(self.base, autocommit=True, connect_timeout=10)

    def recreate(self, db: str, template: str | None = None) -> None:
        db, template = self.name(db), template and self.name(template)
        with self._admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
            conn.execute(
                f'CREATE DATABASE "{db}"' + (f' TEMPLATE "{template}"' if template else "")
            )

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Until the server accepts connections again (another test may restart it)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._admin().close()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    def drop(self, db: str) -> None:
        db = self.name(db)
        with self._admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


def redis_url(base: str, db: int) -> str:
    parts = urlsplit(base)
    return urlunsplit(parts._replace(path=f"/{db}"))


# -- running adapters -------------------------------------------------------------------


class Runner:
    def __init__(self, args: argparse.Namespace, plan: Plan) -> None:
        self.args = args
        self.plan = plan
        self.pg = Postgres(args.pg_url)
        self.pythons: dict[str, str] = {}
        self.templates: set[str] = set()

    def db(self, system: System) -> str:
        return self.pg.name("bench_" + system.name.replace("-", "_"))

    def store_url(self, system: System) -> str:
        if system.store == "postgres":
            return self.pg.url(self.db(system))
        if system.store == "redis":
            return redis_url(self.args.redis_url, REDIS_DB[system.name])
        path = str(WORK / f"{system.name}.db")
        return f"sqlite:///{path}" if system.is_errands else path

    def adapter(
        self, system: System, scenario: str, spec: dict[str, Any], url: str | None = None
    ) -> dict[str, Any]:
        python = self.pythons[system.name]
        spec = {"url": url or self.store_url(system), "cwd": str(PEERS), **spec}
        return run_adapter(
            [python, str(PEERS / system.adapter), scenario, json.dumps(spec)],
            self.args.scenario_timeout,
        )

    def prepare(self, system: System) -> None:
        """Install the venv; on PostgreSQL, a migrated template database to clone."""
        self.pythons[system.name] = python_for(system)
        if system.store != "postgres":
            return
        template = self.db(system) + "_tpl"
        for attempt in range(1, ATTEMPTS + 1):
            try:
                self.pg.recreate(template)
                self.adapter(system, "migrate", {}, url=self.pg.url(template))
                break
            except Exception as exc:
                if attempt == ATTEMPTS:
                    raise
                log(f"  {system.name} migrate: attempt {attempt} failed: {str(exc)[:300]}")
                time.sleep(2)
                self.pg.wait_ready()
        self.templates.add(template)

    def fresh(self, system: System) -> None:
        if system.store == "postgres":
            self.pg.recreate(self.db(system), template=self.db(system) + "_tpl")
        elif system.store == "sqlite":
            WORK.mkdir(parents=True, exist_ok=True)
            path = str(WORK / f"{system.name}.db")
            for suffix in ("", "-wal", "-shm"):
                if os.path.exists(path + suffix):
                    os.remove(path + suffix)

    def scenario(self, system: System, scenario: str, spec: dict[str, Any]) -> dict[str, Any]:
        error = ""
        for attempt in range(1, ATTEMPTS + 1):
            try:
                self.fresh(system)
                return self.adapter(system, scenario, spec)
            except Exception as exc:
                error = str(exc)
                log(f"  {system.name} {scenario}: attempt {attempt} failed: {error[:300]}")
                time.sleep(2)
                if system.store == "postgres":
                    self.pg.wait_ready()
        raise RuntimeError(error)

    def cleanup(self) -> None:
        for system in SYSTEMS:
            if system.store == "postgres" and system.name in self.pythons:
                try:
                    self.pg.drop(self.db(system))
                    self.pg.drop(self.db(system) + "_tpl")
                except Exception:
                    pass


def run_adapter(argv: list[str], timeout: float) -> dict[str, Any]:
    """Run one adapter scenario; its last JSON line is the result.

    On a timeout (or if this harness is stopped) the adapter gets SIGTERM first, so it
    can stop the worker processes it started, and is killed only after that.
    """
    proc = subprocess.Popen(
        argv,
        cwd=PEERS,
        env={**os.environ, "PYTHONPATH": str(PEERS)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException:
        proc.terminate()
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (stderr or stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{argv[2]} exited {proc.returncode}: " + " | ".join(tail))
    return json.loads(lines[-1])


def scenarios_of(system: System, plan: Plan) -> list[tuple[str, str, dict[str, Any]]]:
    """(figure key, adapter scenario, spec) in the order one run measures them.

    Enqueue figures do not depend on how the workers run; processing and pickup latency
    are measured for every configuration of the system (``KEY@LABEL``), its defaults
    first (in the smoke plan the others measure one process's rate only).
    """
    out: list[tuple[str, str, dict[str, Any]]] = [
        ("enqueue_single", "enqueue_single", {"jobs": plan.single_jobs}),
    ]
    if system.is_errands:  # issue 20: await aenqueue(...), beside the peers' async loops
        out.append(("enqueue_async", "enqueue_async", {"jobs": plan.single_jobs}))
    if system.name != "huey":  # huey has no bulk enqueue
        out.append(("enqueue_bulk", "enqueue_bulk", {"jobs": plan.bulk_jobs}))
    for index, config in enumerate(system.configs):
        in_full = index == 0 or plan.every_config_in_full
        for procs in (1, 2) if in_full else (1,):
            out.append(
                (
                    f"throughput_{procs}@{config.label}",
                    "throughput",
                    {
                        "jobs": plan.throughput_jobs,
                        "procs": procs,
                        "cap": plan.cap,
                        "timeout": plan.cap + 120,
                        "config": config.options,
                    },
                )
            )
        if not in_full:
            continue
        out.append(
            (
                f"latency@{config.label}",
                "latency",
                {
                    "jobs": plan.latency_jobs,
                    "rate": plan.latency_rate,
                    "procs": 1,
                    "config": config.options,
                },
            )
        )
    return out


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _spread(values: list[Any]) -> dict[str, Any]:
    v = [x for x in values if x is not None]
    if not v:
        return {}
    return {
        "min": min(v),
        "max": max(v),
        "n": len(v),
        "spread": max(v) / min(v) if min(v) else None,
    }


def summarise_config(raw: dict[str, list[dict[str, Any]]], label: str) -> dict[str, Any]:
    """One configuration's figures: the median over the runs, and each one's spread."""

    def mem_mb(r: dict[str, Any], key: str, field: str) -> float | None:
        values = [m[field] for m in r.get(key, {}).values() if m.get(field)]
        return max(values) / 1024 if values else None

    fig: dict[str, Any] = {}
    spread: dict[str, Any] = {}
    for procs in (1, 2):
        runs = raw.get(f"throughput_{procs}@{label}", [])
        rates = [r["rate"] for r in runs]
        fig[f"throughput_{procs}"] = median(rates)
        fig[f"throughput_{procs}_capped"] = any(r.get("capped") for r in runs)
        fig[f"throughput_{procs}_done"] = median([r["done"] for r in runs])
        fig[f"throughput_{procs}_window_s"] = median([r.get("window_s") for r in runs])
        fig[f"cpu_us_per_job_{procs}"] = median([r.get("cpu_us_per_job") for r in runs])
        spread[f"throughput_{procs}"] = _spread(rates)
    lat = raw.get(f"latency@{label}", [])
    for q in ("p50", "p95", "p99"):
        fig[f"latency_{q}"] = median([r[f"{q}_ms"] for r in lat])
        spread[f"latency_{q}"] = _spread([r[f"{q}_ms"] for r in lat])
    fig["memory_mb"] = median(
        [mem_mb(r, "memory", "hwm_kb") for r in raw.get(f"throughput_1@{label}", [])]
    )
    fig["memory_2_mb"] = median(
        [mem_mb(r, "memory", "hwm_kb") for r in raw.get(f"throughput_2@{label}", [])]
    )
    fig["idle_rss_mb"] = median([mem_mb(r, "idle_memory", "rss_kb") for r in lat])
    fig["spread"] = spread
    return fig


def summarise(raw: dict[str, list[dict[str, Any]]], system: System | None = None) -> dict[str, Any]:
    """The figures of a system: enqueue, then the best configuration's processing and
    latency under the plain keys (``throughput_1`` ...), so the limit's shares and the
    targets read errands' best; each configuration's own figures are in ``configs``."""
    fig: dict[str, Any] = {}
    single = raw.get("enqueue_single", [])
    fig["enqueue_single"] = median([r["rate"] for r in single])
    # errands' adapter also times the raw insert-and-commit in rounds alternating with its
    # own enqueues (peers do not): the share of each run, then their median.
    fig["enqueue_single_raw"] = median([r["raw_rate"] for r in single if "raw_rate" in r])
    fig["enqueue_single_vs_raw"] = median([r["vs_raw"] for r in single if "vs_raw" in r])
    bulk = raw.get("enqueue_bulk", [])
    fig["enqueue_bulk"] = median([r["rate"] for r in bulk])
    # ... and, on PostgreSQL, the raw COPY in rounds alternating with its bulk enqueue
    fig["enqueue_bulk_raw"] = median([r["raw_rate"] for r in bulk if "raw_rate" in r])
    fig["enqueue_bulk_vs_raw"] = median([r["vs_raw"] for r in bulk if "vs_raw" in r])
    if raw.get("enqueue_async"):  # errands' adapter: await aenqueue, one at a time and 64 at once
        fig["enqueue_async"] = median([r["rate"] for r in raw["enqueue_async"]])
        fig["enqueue_async_concurrent"] = median(
            [r["rate_concurrent"] for r in raw["enqueue_async"]]
        )
    fig["enqueue_spread"] = {
        "enqueue_single": _spread([r["rate"] for r in single]),
        "enqueue_bulk": _spread([r["rate"] for r in bulk]),
        "enqueue_bulk_vs_raw": _spread([r["vs_raw"] for r in bulk if "vs_raw" in r]),
    }
    labels = (
        [c.label for c in system.configs]
        if system
        else sorted({k.split("@", 1)[1] for k in raw if "@" in k})
    )
    configs = {label: summarise_config(raw, label) for label in labels}
    fig["configs"] = configs
    default = system.default.label if system else "default"
    best_labels = (
        [c.label for c in system.best] if system else [lb for lb in labels if lb != default]
    )
    best = pick_best(configs, best_labels) or default
    fig["best_config"] = best
    fig["default_config"] = default
    for key, value in configs.get(best, {}).items():
        fig[key] = value
    return fig


def pick_best(configs: dict[str, dict[str, Any]], labels: list[str]) -> str | None:
    """The tuned configuration with the highest processing rate (2 processes, else 1)."""

    def score(label: str) -> float:
        c = configs.get(label, {})
        return c.get("throughput_2") or c.get("throughput_1") or 0.0

    present = [lb for lb in labels if score(lb)]
    return max(present, key=score) if present else (labels[0] if labels else None)


def prefill_size(plan: Plan, previous: list[dict[str, Any]]) -> int:
    """Jobs to pre-fill: the plan's count, or for a system whose last run of this figure
    hit the cap, enough for ``cap`` seconds at 1.5 x its rate (at least ``min_window``
    seconds' worth and 5,000): a slow peer is not made to enqueue 100,000 jobs it
    cannot reach. The count is recorded with each run."""
    last = previous[-1] if previous else None
    if not last or not last.get("capped") or not last.get("rate"):
        return plan.throughput_jobs
    wanted = max(last["rate"] * max(plan.cap, plan.min_window) * 1.5, 5000)
    return int(min(plan.throughput_jobs, wanted))


# -- the run ----------------------------------------------------------------------------


def wanted(only: list[str]) -> tuple[list[System], bool, bool, bool]:
    """The systems, and whether the limit, the scale and the memory sections run."""
    if not only:
        return list(SYSTEMS), True, True, True
    names = {n.strip() for item in only for n in item.split(",") if n.strip()}
    known = {s.name for s in SYSTEMS} | {"errands", "limit", "scale", "memory", "peers"}
    unknown = names - known
    if unknown:
        raise SystemExit(
            f"--only: unknown {', '.join(sorted(unknown))}; choose from {', '.join(sorted(known))}"
        )
    systems = [
        s
        for s in SYSTEMS
        if s.name in names
        or ("errands" in names and s.is_errands)
        or ("peers" in names and not s.is_errands)
    ]
    with_limit = "limit" in names or "errands" in names
    with_scale = "scale" in names or "errands" in names
    with_memory = "memory" in names or "errands" in names
    return systems, with_limit, with_scale, with_memory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 run with small counts")
    parser.add_argument(
        "--smoke", action="store_true", help="1 run with tiny counts: proves every step runs"
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="a system (errands-pg, pgqueuer, ...), 'errands', 'peers', 'limit', 'scale' or "
        "'memory'; repeat or comma-separate",
    )
    parser.add_argument("--runs", type=int, help="runs per figure (default 5, --quick 1)")
    parser.add_argument("--no-scale", action="store_true", help="skip the 1M-row scale test")
    parser.add_argument("--no-limit", action="store_true", help="skip the raw SQL limit")
    parser.add_argument(
        "--no-memory", action="store_true", help="skip the long-run memory test (100,000 jobs)"
    )
    parser.add_argument("--pg-url", default=os.environ.get("BENCH_PG_URL", PG_URL_DEFAULT))
    parser.add_argument("--redis-url", default=os.environ.get("BENCH_REDIS_URL", REDIS_URL_DEFAULT))
    parser.add_argument("--scenario-timeout", type=float, default=600.0)
    parser.add_argument(
        "--results", metavar="DIR", help="write the JSON there (default bench/results)"
    )
    parser.add_argument(
        "--no-systems",
        action="store_true",
        help="skip the side-by-side figures (run only the steps named by other options)",
    )
    steps = parser.add_argument_group("storage, finished rows and scenarios (issue 17)")
    steps.add_argument(
        "--storage",
        action="store_true",
        help="WAL bytes per job, bytes per 1M finished jobs and dead tuples, every "
        "PostgreSQL system and configuration (on its own cluster: see --scratch-pg)",
    )
    steps.add_argument("--storage-jobs", type=int, default=20_000, help="jobs per system")
    steps.add_argument(
        "--finished-rows",
        type=int,
        metavar="N",
        help="claims with N finished rows (10000000 for the lead's run) against an empty "
        "table, every PostgreSQL system that keeps finished rows: slow, opt-in",
    )
    steps.add_argument(
        "--finished-jobs", type=int, default=20_000, help="jobs per finished-rows figure"
    )
    steps.add_argument(
        "--scenarios",
        nargs="?",
        const="all",
        metavar="NAMES",
        help="the third-party chaos and pressure scenarios for errands-pg, pgqueuer and "
        "awa-pg (comma-separated names, or all): "
        + ", ".join(scenarios.CHAOS + scenarios.PRESSURE),
    )
    steps.add_argument("--scenario-rate", type=float, default=500.0, help="jobs/s offered")
    steps.add_argument(
        "--scenario-scale",
        type=float,
        default=1.0,
        help="multiply the scenarios' phase durations (0.25 for a quick check)",
    )
    steps.add_argument(
        "--pressure-seconds",
        type=float,
        default=600.0,
        help="how long the reader pins the xmin horizon (600 in the lead's run, 30 in CI)",
    )
    steps.add_argument("--drain-seconds", type=float, default=120.0)
    steps.add_argument(
        "--scenario-work-ms",
        type=float,
        default=1.0,
        help="synthetic work per job in the scenarios (the third-party JOB_WORK_MS, 1 ms)",
    )
    steps.add_argument(
        "--scratch-pg",
        action="store_true",
        help="run storage, finished rows and scenarios on a throw-away PostgreSQL cluster "
        "the harness makes (initdb, port 55432) and deletes: WAL nobody else writes, and "
        "a server the chaos scenarios may restart",
    )
    steps.add_argument(
        "--storage-pg-url", help="a PostgreSQL the storage and scenario steps use instead"
    )
    steps.add_argument("--pg-stop-cmd", help="with --pg-start-cmd: how to stop the server")
    steps.add_argument("--pg-start-cmd", help="(postgres_restart on a server not the harness's)")
    fair = parser.add_argument_group("fair queues (issue 19)")
    fair.add_argument(
        "--fairness",
        action="store_true",
        help="the noisy-neighbour benchmark (bench/fairness.py), fair queue and FIFO, on "
        "SQLite and PostgreSQL (part of every full run)",
    )
    fair.add_argument("--no-fairness", action="store_true", help="skip it in a full run")
    fair.add_argument(
        "--fairness-args",
        default="",
        help="arguments for bench/fairness.py (default: its own, a 100,000-job backlog), "
        "as in --fairness-args='--backlog 20000 --seconds 30'",
    )
    parser.add_argument(
        "--update",
        action="store_true",
        help="with --only: put this run's sections (systems, limit, scale, memory) into "
        "bench/results/latest.json and docs/benchmarks.md, marked as re-measured",
    )
    args = parser.parse_args(argv)

    args.quick = args.quick or args.smoke
    plan = SMOKE if args.smoke else QUICK if args.quick else FULL
    if args.runs:
        plan = Plan(**{**plan.__dict__, "runs": args.runs, "scale_runs": args.runs})
    systems, with_limit, with_scale, with_memory = wanted(args.only)
    step_systems = [s for s in systems if s.store == "postgres"]
    if args.no_systems:
        systems, with_limit, with_scale, with_memory = [], False, False, False
    with_limit = with_limit and not args.no_limit
    with_scale = with_scale and not args.no_scale
    with_memory = with_memory and not args.no_memory
    complete = (
        not args.only
        and not args.no_systems
        and not args.quick
        and not args.no_scale
        and not args.no_limit
        and not args.no_memory
        and not args.no_fairness
    )
    with_fairness = args.fairness or complete

    started = time.time()
    runner = Runner(args, plan)
    results: dict[str, Any] = {
        "mode": "smoke" if args.smoke else "quick" if args.quick else "full",
        "complete": complete,
        "plan": plan.__dict__,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "load_before": os.getloadavg(),
        "machine": machine.describe(args.pg_url, args.redis_url),
        "systems": {},
    }
    log(
        f"bench: {results['mode']} run, {plan.runs} run(s) per figure, systems: "
        + ", ".join(s.name for s in systems)
    )

    ready: list[System] = []
    for system in systems:
        entry = results["systems"][system.name] = {
            "store": system.store,
            "settings": system.settings,
            "configs": {
                c.label: {
                    "kind": c.kind,
                    "settings": c.settings,
                    "source": c.source,
                    "options": c.options,
                }
                for c in system.configs
            },
            "compare_to": system.compare_to,
            "error": None,
            "failures": [],
            "raw": {},
        }
        try:
            log(f"{system.name}: preparing (venv, schema)")
            runner.prepare(system)
            entry["versions"] = versions(runner.pythons[system.name], system.packages)
            ready.append(system)
        except Exception as exc:
            entry["error"] = f"could not install or set up: {exc}"
            log(f"{system.name}: SKIPPED: {entry['error'][:400]}")

    limit_runs: dict[str, list[dict[str, float]]] = {"postgres": [], "sqlite": []}
    limit_errors: dict[str, str] = {}
    for run in range(1, plan.runs + 1):
        # Interleaved: within a run, every system's enqueue figures, then every system's
        # default configuration, then the tuned ones, the systems' order rotated each
        # run, so drift on the machine (and a neighbour's load) hits all of them alike.
        order = ready[(run - 1) % len(ready) :] + ready[: (run - 1) % len(ready)] if ready else []
        for phase in ("enqueue", "default", "best"):
            for system in order:
                for key, scenario, spec in scenarios_of(system, plan):
                    label = key.split("@", 1)[1] if "@" in key else None
                    kind = "enqueue" if label is None else system.config(label).kind
                    if kind != phase:
                        continue
                    measure(runner, system, run, key, scenario, spec, results)

        if with_limit:  # in every run, beside the systems, so drift hits both alike
            run_limit(runner, plan, run, limit_runs, limit_errors)

    for name, entry in results["systems"].items():
        entry["figures"] = summarise(entry["raw"], by_name(name))
        if entry["error"] is None and not entry["raw"]:
            entry["error"] = "every scenario failed: " + "; ".join(entry["failures"][-2:])

    errands_pg = next((s for s in SYSTEMS if s.name == "errands-pg"), None)
    if with_limit:
        results["limit"] = {}
        for store, runs in limit_runs.items():
            summary: dict[str, Any] = {"runs": runs}
            if runs:
                summary["figures"] = {k: median([r[k] for r in runs]) for k in runs[0]}
            if store in limit_errors:
                summary["error"] = limit_errors[store]
            results["limit"][store] = summary
    if with_scale and errands_pg is not None:
        results["scale"] = run_scale(runner, plan, errands_pg)
    if with_memory and errands_pg is not None:
        results["memory"] = run_memory(runner, plan, errands_pg)

    if args.storage or args.finished_rows or args.scenarios:
        results.update(run_steps(args, plan, step_systems))
    if with_fairness:
        results["fairness"] = run_fairness(runner, args.fairness_args)

    results["load_after"] = os.getloadavg()
    results["duration_s"] = time.time() - started
    results["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    results["shares"] = report.shares(results)
    results["targets"] = report.targets(results)
    runner.cleanup()
    shutil.rmtree(WORK, ignore_errors=True)

    out_dir = Path(args.results) if args.results else RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    latest = out_dir / "latest.json"
    took = results["duration_s"]  # this run's (merging keeps the base run's duration_s)
    if args.update and not complete and not args.quick and latest.exists():
        results = merge_into(
            json.loads(latest.read_text()), results, with_limit, with_scale, with_memory
        )
        complete = True
    out_path = out_dir / ("latest.json" if complete else "partial.json")
    profile_path = RESULTS / "profile.json"
    profile = json.loads(profile_path.read_text()) if profile_path.exists() else None
    tmp = out_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str) + "\n")
    tmp.replace(out_path)
    report.print_tables(results)
    if complete:
        docs = BENCH.parent / "docs" / "benchmarks.md"
        docs.write_text(report.markdown(results, profile))
        log(f"wrote {_shown(out_path)} and docs/benchmarks.md")
    else:
        log(f"wrote {_shown(out_path)} (partial or quick: docs untouched)")
    log(f"bench took {took / 60:.1f} min")
    return 0


def measure(
    runner: Runner,
    system: System,
    run: int,
    key: str,
    scenario: str,
    spec: dict[str, Any],
    results: dict[str, Any],
) -> None:
    """One scenario of one system in one run, recorded with the machine's load."""
    entry = results["systems"][system.name]
    plan = runner.plan
    spec = dict(spec)
    if scenario == "throughput":
        spec["jobs"] = prefill_size(plan, entry["raw"].get(key, []))
        if system.store == "postgres":
            url = runner.store_url(system)
            spec["after_prefill"] = [sys.executable, str(BENCH / "pgstats.py"), "analyze", url]
    t = time.time()
    cpu = machine.cpu_times()
    try:
        out = runner.scenario(system, scenario, spec)
    except Exception as exc:
        entry["failures"].append(f"run {run} {key}: {exc}")
        log(f"{system.name} {key}: FAILED: {str(exc)[:300]}")
        return
    out["run"] = run
    out["load1"] = os.getloadavg()[0]
    out["cpu"] = machine.cpu_share(cpu, machine.cpu_times())
    if scenario == "throughput":
        out["prefilled"] = spec["jobs"]
    entry["raw"].setdefault(key, []).append(out)
    log(
        f"run {run}/{plan.runs} {system.name} {key}: {report.brief(key, out)} "
        f"({time.time() - t:.0f} s, load {out['load1']:.1f}, "
        f"busy {out['cpu'].get('busy', 0):.0%}, steal {out['cpu'].get('steal', 0):.1%})"
    )


def _shown(path: Path) -> Path:
    return path.relative_to(BENCH.parent) if path.is_relative_to(BENCH.parent) else path


def merge_into(
    base: dict[str, Any],
    part: dict[str, Any],
    with_limit: bool,
    with_scale: bool,
    with_memory: bool = False,
) -> dict[str, Any]:
    """A full run's results with the sections a later partial run measured again."""
    sections = list(part["systems"])
    base["systems"].update(part["systems"])
    if with_limit and "limit" in part:
        base["limit"] = part["limit"]
        sections.append("limit")
    if with_scale and "scale" in part:
        base["scale"] = part["scale"]
        sections.append("scale")
    if with_memory and "memory" in part:
        base["memory"] = part["memory"]
        sections.append("memory")
    for step in ("storage", "finished", "scenarios", "fairness"):
        if step in part:
            if step == "scenarios" and "scenarios" in base:
                # cell by cell: a run of the pressure cells keeps the chaos cells measured
                # before it (each cell records its own rate, work and phases)
                cells = {**base["scenarios"].get("cells", {}), **part[step].get("cells", {})}
                base[step] = {**base[step], **part[step], "cells": cells}
            else:
                base[step] = part[step]
            sections.append(step)
    base.setdefault("updates", []).append(
        {
            "at": part["finished_at"],
            "sections": sections,
            "duration_s": part["duration_s"],
            "load_before": part["load_before"],
            "load_after": part["load_after"],
        }
    )
    base["shares"] = report.shares(base)
    base["targets"] = report.targets(base)
    return base


def run_steps(args: argparse.Namespace, plan: Plan, systems: list[System]) -> dict[str, Any]:
    """Storage cost, finished rows and the scenarios, on the PostgreSQL they should use."""
    from .cluster import ScratchCluster, ServiceRestarter

    out: dict[str, Any] = {}
    cluster: ScratchCluster | None = None
    if args.scratch_pg:
        cluster = ScratchCluster()
        cluster.up()
        url = cluster.url
        log(f"scratch PostgreSQL cluster at {cluster.dir} (port {cluster.port})")
    else:
        url = args.storage_pg_url or args.pg_url
    restarter: Any = cluster
    if restarter is None and args.pg_stop_cmd and args.pg_start_cmd:
        restarter = ServiceRestarter(args.pg_stop_cmd, args.pg_start_cmd)
    step_args = argparse.Namespace(**{**vars(args), "pg_url": url})
    runner = Runner(step_args, plan)
    where = "scratch cluster" if cluster else _safe_url(url)
    try:
        ready = []
        for system in systems:
            try:
                runner.prepare(system)
                ready.append(system)
            except Exception as exc:
                log(f"{system.name}: SKIPPED for the storage steps: {str(exc)[:300]}")
        if args.storage:
            out["storage"] = storage.run_storage(runner, ready, args.storage_jobs, log)
            out["storage"]["where"] = where
        if args.finished_rows:
            fin: dict[str, Any] = {"rows": args.finished_rows, "jobs": args.finished_jobs,
                                   "where": where, "systems": {}}  # fmt: skip
            for system in ready:
                try:
                    fin["systems"][system.name] = storage.finished_scale(
                        runner, system, args.finished_rows, args.finished_jobs,
                        plan.scale_runs, log,
                    )  # fmt: skip
                except Exception as exc:
                    fin["systems"][system.name] = {"error": str(exc)[:500]}
                    log(f"finished rows {system.name}: FAILED: {str(exc)[:300]}")
            out["finished"] = fin
        if args.scenarios:
            names = (
                list(scenarios.CHAOS + scenarios.PRESSURE)
                if args.scenarios == "all"
                else [n.strip() for n in args.scenarios.split(",") if n.strip()]
            )
            unknown = set(names) - set(scenarios.CHAOS + scenarios.PRESSURE)
            if unknown:
                raise SystemExit(f"--scenarios: unknown {', '.join(sorted(unknown))}")
            cells = [s for s in ready if s.name in ("errands-pg", "pgqueuer", "awa-pg")]
            out["scenarios"] = scenarios.run_scenarios(
                runner, cells, names, args.scenario_rate, args.scenario_scale,
                args.pressure_seconds, args.drain_seconds, restarter, log,
                args.scenario_work_ms,
            )  # fmt: skip
            out["scenarios"]["where"] = where
    finally:
        runner.cleanup()
        if cluster is not None:
            cluster.__exit__(None, None, None)
    return out


def run_fairness(runner: Runner, extra: str) -> dict[str, Any]:
    """bench/fairness.py on SQLite (a fresh file) and on PostgreSQL (a fresh database):
    the fair queue and the FIFO one (errands without fairness) side by side, and on
    PostgreSQL a peer without fair claiming (pgqueuer) behind the same backlog."""
    import shlex

    from . import fairness

    out: dict[str, Any] = {}
    WORK.mkdir(parents=True, exist_ok=True)
    db = "errands_bench_fairness"
    for store in ("sqlite", "postgres"):
        if store == "sqlite":
            path = WORK / "fairness.db"
            for leftover in WORK.glob("fairness.db*"):
                leftover.unlink()
            url = f"sqlite:///{path}"
        else:
            runner.pg.recreate(db)
            url = runner.pg.url(db)
        log(f"fairness: noisy-neighbour benchmark on {store}")
        load = os.getloadavg()[0]
        try:
            peer = ["--peer", "pgqueuer"] if store == "postgres" else []
            argv = ["--url", url, *peer, *shlex.split(extra)]
            out[store] = fairness.main(argv, echo=False)
            out[store]["load1_before"] = load
            out[store]["load1_after"] = os.getloadavg()[0]
        except Exception as exc:
            out[store] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
            log(f"fairness on {store}: FAILED: {str(exc)[:300]}")
        finally:
            if store == "postgres":
                runner.pg.drop(db)
    return out


def _safe_url(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port or 5432}"


def run_limit(
    runner: Runner,
    plan: Plan,
    run: int,
    runs: dict[str, list[dict[str, float]]],
    errors: dict[str, str],
) -> None:
    db, template = "bench_limit", "bench_errands_pg_tpl"
    try:
        if template not in runner.templates:
            runner.prepare(next(s for s in SYSTEMS if s.name == "errands-pg"))
        for attempt in range(1, ATTEMPTS + 1):
            try:
                runner.pg.recreate(db, template=template)
                figures = limit.pg_limit(
                    runner.pg.url(db), plan.limit_jobs, plan.limit_single, plan.limit_cap
                )
                break
            except Exception as exc:
                log(f"limit postgres: attempt {attempt} failed: {exc}")
                time.sleep(2)
                runner.pg.wait_ready()
        else:
            raise RuntimeError("the PostgreSQL limit failed 3 times")
        runs["postgres"].append(figures)
        log(f"run {run}/{plan.runs} limit postgres: " + report.brief_limit(figures))
        runner.pg.drop(db)
    except Exception as exc:
        errors["postgres"] = str(exc)
        log(f"limit postgres: FAILED: {exc}")
    WORK.mkdir(parents=True, exist_ok=True)
    try:
        figures = limit.sqlite_limit(
            str(WORK / "limit.db"), plan.limit_jobs, plan.limit_single, plan.limit_cap
        )
        runs["sqlite"].append(figures)
        log(f"run {run}/{plan.runs} limit sqlite: " + report.brief_limit(figures))
    except Exception as exc:
        errors["sqlite"] = str(exc)
        log(f"limit sqlite: FAILED: {exc}")


def run_scale(runner: Runner, plan: Plan, errands_pg: System) -> dict[str, Any]:
    out: dict[str, Any] = {}
    template = "bench_errands_pg_tpl"
    try:
        if template not in runner.templates:
            runner.prepare(errands_pg)

        def worker(url: str) -> float:
            spec = {
                "url": url,
                "cwd": str(PEERS),
                "jobs": plan.scale_jobs,
                "procs": 1,
                "concurrency": plan.concurrency,
                "cap": plan.cap,
            }
            python = runner.pythons[errands_pg.name]
            argv = [python, str(PEERS / errands_pg.adapter), "throughput", json.dumps(spec)]
            return float(run_adapter(argv, runner.args.scenario_timeout)["rate"])

        out["postgres"] = _twice(
            runner,
            "scale postgres",
            lambda: scale.pg_scale(
                runner.pg.url,
                lambda db: runner.pg.recreate(db, template=template),
                plan.scale_jobs,
                plan.scale_runs,
                plan.scale_rows,
                worker,
                log,
            ),
        )
        for label in ("empty", "full"):
            runner.pg.drop(f"bench_scale_{label}")
    except Exception as exc:
        out["postgres"] = {"error": str(exc)}
        log(f"scale postgres: FAILED: {exc}")
    try:
        WORK.mkdir(parents=True, exist_ok=True)
        out["sqlite"] = scale.sqlite_scale(
            str(WORK), plan.scale_jobs, plan.scale_runs, plan.scale_rows, log
        )
    except Exception as exc:
        out["sqlite"] = {"error": str(exc)}
        log(f"scale sqlite: FAILED: {exc}")
    return out


def _twice(runner: Runner, label: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()``, tried once more if it fails (PostgreSQL restarted under it, say)."""
    try:
        return fn()
    except Exception as exc:
        log(f"{label}: attempt 1 failed: {exc}")
        runner.pg.wait_ready()
        return fn()


def run_memory(runner: Runner, plan: Plan, errands_pg: System) -> dict[str, Any]:
    """One worker through ``plan.memory_jobs`` jobs on each store, its RSS sampled."""
    out: dict[str, Any] = {}
    db, template = "bench_memory", "bench_errands_pg_tpl"
    try:
        if template not in runner.templates:
            runner.prepare(errands_pg)
        python = runner.pythons[errands_pg.name]

        def measure() -> dict[str, Any]:
            runner.pg.recreate(db, template=template)
            return memory.measure(
                runner.pg.url(db),
                plan.memory_jobs,
                python=python,
                concurrency=plan.concurrency,
                log=log,
            )

        out["postgres"] = _twice(runner, "memory postgres", measure)
    except Exception as exc:
        out["postgres"] = {"error": str(exc)}
        log(f"memory postgres: FAILED: {exc}")
    with contextlib.suppress(Exception):  # also after a failure: no database left behind
        runner.pg.drop(db)
    try:
        WORK.mkdir(parents=True, exist_ok=True)
        out["sqlite"] = memory.sqlite_memory(
            str(WORK / "memory.db"),
            plan.memory_jobs,
            python=runner.pythons.get("errands-sqlite", sys.executable),
            concurrency=plan.concurrency,
            log=log,
        )
    except Exception as exc:
        out["sqlite"] = {"error": str(exc)}
        log(f"memory sqlite: FAILED: {exc}")
    return out


if __name__ == "__main__":
    sys.exit(main())
