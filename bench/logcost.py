"""What the default worker's log lines cost (issue 17, item 2).

    python -m bench.logcost micro                    # CPU per lifecycle line, in-process
    python -m bench.logcost throughput --store postgres --jobs 20000 --runs 3
    python -m bench.logcost throughput --store sqlite --baseline-src /tmp/base/src

``micro`` emits the ``completed`` event of ``--lines`` jobs the way the worker's completer
does (``events.wants``, the fields, ``events.emit``, the lifecycle-log subscriber) into
the handler ``configure_logging("text", LEVEL)`` installs, writing to a file on tmpfs, and
reports the CPU per line of the emitting thread (the worker's hot path) and of the whole
process (any writer thread included, until every line is written), at INFO and at
WARNING (the line disabled).

``throughput`` runs the errands peer adapter's ``throughput`` scenario (pre-fill, ANALYZE
on PostgreSQL, one ``errands worker errands_app:app`` process, handlers timed from the
first to the last) for each variant, interleaved run by run so drift hits every variant
alike: ``default`` (as a user starts it: -c default, --log-level info) and ``warning``
(``--log-level warning``), each with this checkout's code and, with ``--baseline-src``,
with another source tree (``git archive main src | tar -x -C /tmp/base``) put first on
the worker's ``PYTHONPATH``. One JSON line per run, then the medians and the spread; the
load average is printed with each run (the machine is shared: compare only figures of
one invocation).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
PEERS = BENCH / "peers"


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# -- micro ------------------------------------------------------------------------------


def micro(lines: int, level: str, fmt: str, sync: bool, pipe: bool) -> dict[str, Any]:
    import logging

    from errands.observability.events import EventBus
    from errands.observability.lifecycle_log import log_event
    from errands.observability.logcontext import configure_logging

    out = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed below
        "w", dir="/dev/shm" if os.path.isdir("/dev/shm") else None, suffix=".log", delete=False
    )
    out.close()
    real_stderr = sys.stderr
    reader = None
    if pipe:  # stderr a pipe, read by another process (systemd, docker), as in production
        with open(out.name, "w") as sink:
            reader = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=sink, text=True)
        assert reader.stdin is not None
        sys.stderr = reader.stdin
        reader.stdin.reconfigure(line_buffering=True)
    else:
        sys.stderr = open(out.name, "w", buffering=1)  # noqa: SIM115 - line-buffered, as stderr
    try:
        if sync:
            configure_logging(fmt, level, background=False)  # type: ignore[call-arg]
        else:
            configure_logging(fmt, level)
        bus = EventBus()
        bus.subscribe(log_event, inline=True)
        name = "errands.job.completed"
        for i in range(200):  # warm-up (not counted)
            if bus.wants(name):
                bus.emit(name, job_id=i, job_name="bench.noop", queue="bench", attempt=1,
                         max_attempts=3, duration=0.000123)  # fmt: skip
        for handler in logging.getLogger().handlers:
            handler.flush()
        p0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
        for i in range(lines):
            if bus.wants(name):
                fields = {"job_id": i, "job_name": "bench.noop", "queue": "bench",
                          "attempt": 1, "max_attempts": 3}  # fmt: skip
                fields["duration"] = 0.000123
                bus.emit(name, **fields)
        t1 = time.thread_time()
        for handler in logging.getLogger().handlers:
            handler.flush()
        p1, w1 = time.process_time(), time.perf_counter()
        logging.shutdown()
    finally:
        sys.stderr.close()
        sys.stderr = real_stderr
        if reader is not None:
            reader.wait(timeout=60)
    with open(out.name) as f:
        written = sum(1 for line in f if "completed in" in line)
    os.unlink(out.name)
    return {
        "level": level,
        "format": fmt,
        "writer": "sync" if sync else "default",
        "stream": "pipe" if pipe else "file",
        "lines": lines,
        "written": written,
        "hot_thread_us": (t1 - t0) / lines * 1e6,
        "process_us": (p1 - p0) / lines * 1e6,
        "wall_us": (w1 - w0) / lines * 1e6,
    }


# -- throughput -------------------------------------------------------------------------


def pg_fresh(admin_url: str, db: str) -> str:
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{db}"')
    base = admin_url.rsplit("/", 1)[0]
    return f"{base}/{db}"


def one_run(store_url: str, jobs: int, config: dict[str, Any], src: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "url": store_url,
        "cwd": str(PEERS),
        "jobs": jobs,
        "procs": 1,
        "timeout": 300,
        "config": config,
    }
    if store_url.startswith("postgresql"):
        spec["after_prefill"] = [sys.executable, str(BENCH / "pgstats.py"), "analyze", store_url]
    path = [str(PEERS)] if src is None else [src, str(PEERS)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    argv = [sys.executable, str(PEERS / "errands_peer.py"), "throughput", json.dumps(spec)]
    proc = subprocess.run(argv, cwd=PEERS, env=env, capture_output=True, text=True, timeout=600)
    found = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"throughput run failed: {proc.stderr.strip()[-800:]}")
    return dict(json.loads(found[-1]))


def throughput(args: argparse.Namespace) -> None:
    variants: list[tuple[str, str | None, dict[str, Any]]] = [
        ("default", None, {}),
        ("warning", None, {"log_level": "warning"}),
    ]
    if args.baseline_src:
        variants = [
            ("base-default", args.baseline_src, {}),
            ("base-warning", args.baseline_src, {"log_level": "warning"}),
            *variants,
        ]
    if args.only:
        variants = [v for v in variants if v[0] in args.only.split(",")]
    rates: dict[str, list[float]] = {v[0]: [] for v in variants}
    cpus: dict[str, list[float]] = {v[0]: [] for v in variants}
    for run in range(args.runs):
        shift = run % len(variants)
        for label, src, config in variants[shift:] + variants[:shift]:
            if args.store == "postgres":
                url = pg_fresh(args.pg_admin, args.pg_db)
            else:
                os.makedirs(args.sqlite_dir, exist_ok=True)
                url = f"sqlite:///{args.sqlite_dir}/logcost.db"
            result = one_run(url, args.jobs, config, src)
            rates[label].append(result["rate"])
            cpus[label].append(result.get("cpu_us_per_job") or float("nan"))
            print(
                json.dumps(
                    {
                        "store": args.store,
                        "run": run,
                        "variant": label,
                        "rate": round(result["rate"]),
                        "cpu_us_per_job": round(result.get("cpu_us_per_job") or 0, 1),
                        "window_s": round(result["window_s"], 2),
                        "load": load(),
                    }
                ),
                flush=True,
            )
    print(f"# {args.store}, {args.jobs:,} jobs, {args.runs} runs, load now {load()}")
    for label in rates:
        r, c = rates[label], cpus[label]
        print(
            f"{label:>14}: median {statistics.median(r):8,.0f} jobs/s "
            f"(min {min(r):,.0f}, max {max(r):,.0f}); CPU {statistics.median(c):.1f} us/job"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.logcost")
    sub = parser.add_subparsers(dest="what", required=True)
    m = sub.add_parser("micro")
    m.add_argument("--lines", type=int, default=100_000)
    m.add_argument("--format", default="text", choices=["text", "json"])
    m.add_argument("--sync", action="store_true", help="configure_logging(background=False)")
    m.add_argument("--pipe", action="store_true", help="stderr a pipe (read by cat)")
    t = sub.add_parser("throughput")
    t.add_argument("--store", choices=["postgres", "sqlite"], default="postgres")
    t.add_argument("--jobs", type=int, default=20_000)
    t.add_argument("--runs", type=int, default=3)
    t.add_argument("--baseline-src", help="a source tree (its src/) for the base-* variants")
    t.add_argument("--only", help="comma-separated variant labels")
    t.add_argument("--pg-admin", default="postgresql://postgres@127.0.0.1:5432/postgres")
    t.add_argument("--pg-db", default="errands_test_logs_bench")
    t.add_argument("--sqlite-dir", default=str(BENCH / ".work"))
    args = parser.parse_args(argv)
    if args.what == "micro":
        for level in ("WARNING", "INFO", "WARNING", "INFO"):
            result = micro(args.lines, level, args.format, args.sync, args.pipe)
            print(json.dumps({**result, "load": load()}))
        return 0
    throughput(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
