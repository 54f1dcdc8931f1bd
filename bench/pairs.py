"""Alternated throughput runs of a few systems: a quick A/B beside the full harness.

    python -m bench.pairs --procs 2 --pairs 5 --system errands-pg:tuned --system pgqueuer:tuned
    python -m bench.pairs --system 'errands-pg:tuned:{"concurrency": 4}' --system errands-pg:tuned
    python -m bench.pairs --no-analyze ...   # as a table no ANALYZE has seen yet

Each round runs every system once, in the order given, with the full harness's
throughput scenario (``bench.run``: 100,000 no-op jobs pre-filled in bulk, ANALYZE on
PostgreSQL unless ``--no-analyze``, the rate from the first handler start to the last).
The machine's speed drifts by 20-50 % over minutes here, so only what ran in the same
round compares: the ratio of each system to the first one is taken per round, and its
median reported. A configuration's options may be overridden with a JSON object after
its label. The JSON written with ``--results`` keeps every run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from . import run as harness
from .systems import SYSTEMS, System


def parse_system(text: str) -> tuple[str, System, dict[str, Any]]:
    """``NAME:LABEL[:JSON]`` as (the text, the system, its configuration's options)."""
    name, _, rest = text.partition(":")
    label, _, overrides = rest.partition(":")
    system = next((s for s in SYSTEMS if s.name == name), None)
    if system is None:
        known = ", ".join(s.name for s in SYSTEMS)
        raise SystemExit(f"--system {text!r}: no system {name!r}; choose one of: {known}")
    config = next((c for c in system.configs if c.label == (label or "default")), None)
    if config is None:
        labels = ", ".join(c.label for c in system.configs)
        raise SystemExit(f"--system {text!r}: {name} has no configuration {label!r}: {labels}")
    options = dict(config.options)
    if overrides:
        try:
            options.update(json.loads(overrides))
        except (ValueError, TypeError):
            raise SystemExit(f"--system {text!r}: the overrides must be a JSON object") from None
    return text, system, options


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pairs", description=__doc__)
    parser.add_argument("--system", action="append", required=True, metavar="NAME:LABEL[:JSON]")
    parser.add_argument("--pairs", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--procs", type=int, default=1, choices=[1, 2])
    parser.add_argument("--jobs", type=int, default=harness.FULL.throughput_jobs)
    parser.add_argument("--no-analyze", action="store_true", help="no ANALYZE after prefill")
    parser.add_argument("--pg-url", default=harness.PG_URL_DEFAULT)
    parser.add_argument("--redis-url", default=harness.REDIS_URL_DEFAULT)
    parser.add_argument("--results", type=Path, help="write every run here (JSON)")
    args = parser.parse_args(argv)
    picks = [parse_system(text) for text in args.system]
    ns = argparse.Namespace(pg_url=args.pg_url, redis_url=args.redis_url, scenario_timeout=600)
    runner = harness.Runner(ns, harness.FULL)
    runs: dict[str, list[dict[str, Any]]] = {text: [] for text, _, _ in picks}
    try:
        for system in {s.name: s for _, s, _ in picks}.values():
            runner.prepare(system)
        for round_ in range(1, args.pairs + 1):
            for text, system, options in picks:
                spec: dict[str, Any] = {
                    "jobs": args.jobs,
                    "procs": args.procs,
                    "cap": harness.FULL.cap,
                    "timeout": harness.FULL.cap + 120,
                    "config": options,
                }
                if system.store == "postgres" and not args.no_analyze:
                    url = runner.store_url(system)
                    analyze = [sys.executable, str(harness.BENCH / "pgstats.py"), "analyze", url]
                    spec["after_prefill"] = analyze
                out = runner.scenario(system, "throughput", spec)
                out["round"] = round_
                out["at"] = time.strftime("%H:%M:%S")
                runs[text].append(out)
                capped = " (capped)" if out.get("capped") else ""
                harness.log(
                    f"round {round_} {text}: {out['rate']:,.0f} jobs/s{capped}, "
                    f"CPU a job: workers {_us(out.get('cpu_us_per_job'))}, "
                    f"server {_us(out.get('server_cpu_us_per_job'))}, "
                    f"machine {_us(out.get('machine_cpu_us_per_job'))}"
                )
    finally:
        runner.cleanup()
    first = picks[0][0]
    summary: dict[str, Any] = {}
    for text, _, _ in picks:
        rates = [r["rate"] for r in runs[text]]
        ratios = [r["rate"] / f["rate"] for r, f in zip(runs[text], runs[first], strict=False)]
        summary[text] = {
            "median_rate": statistics.median(rates) if rates else None,
            "rates": [round(r) for r in rates],
            f"ratio_to_{first}": statistics.median(ratios) if ratios else None,
            "ratios": [round(x, 2) for x in ratios],
            "worker_cpu_us_per_job": _median(runs[text], "cpu_us_per_job"),
            "server_cpu_us_per_job": _median(runs[text], "server_cpu_us_per_job"),
            "machine_cpu_us_per_job": _median(runs[text], "machine_cpu_us_per_job"),
        }
        print(f"{text}: median {summary[text]['median_rate']:,.0f} jobs/s, rates "
              f"{summary[text]['rates']}, x {first}: {summary[text]['ratios']}; CPU a job "
              f"(medians): workers {_us(summary[text]['worker_cpu_us_per_job'])}, "
              f"server {_us(summary[text]['server_cpu_us_per_job'])}, "
              f"machine {_us(summary[text]['machine_cpu_us_per_job'])}")  # fmt: skip
    if args.results:
        record = {"procs": args.procs, "analyze": not args.no_analyze, "summary": summary}
        args.results.write_text(json.dumps({**record, "runs": runs}, indent=1) + "\n")
    return 0


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} µs"


if __name__ == "__main__":
    sys.exit(main())
