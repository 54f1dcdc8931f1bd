"""Profile errands' hot path with py-spy while one worker drains 20,000 no-op jobs.

    python -m bench.profile              # PostgreSQL and SQLite
    python -m bench.profile --jobs 5000 --store sqlite

The queue is pre-filled, then ``errands worker -c 32`` (one process) runs under
``py-spy record --gil``: only the thread holding the GIL is sampled, so the samples are
the Python CPU the worker spends, which is what bounds one process. Time inside the
database or waiting on the network is not in them (psycopg releases the GIL). The raw
stacks go to ``bench/results/profile-STORE.txt`` and a summary (own time per function,
time per area of the hot path, both in µs per job) to ``bench/results/profile.json``,
which ``docs/benchmarks.md`` shows under "Profile".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from .systems import BENCH, PEERS

RESULTS = BENCH / "results"
HZ = 1000

# Areas of the hot path, in priority order: a stack belongs to the first area whose
# function appears anywhere in it (so the lifecycle events emitted from Dispatcher.prepare count
# as events, not dispatch). Names are matched on their qualified suffix.
AREAS = [
    ("events: EventBus.emit (lifecycle-log subscriber)", ("EventBus.emit",)),
    ("claim: backend job_claim (SQL, rows -> JobRow)", ("job_claim",)),
    ("complete: backend job_finish_many (SQL)", ("job_finish_many",)),
    ("heartbeat: LeaseKeeper / worker registry", ("LeaseKeeper._run", "registry_beat")),
    (
        "wake-ups: SQLite data_version watcher / PG listener",
        ("DataVersionWatcher._run", "Notifier._run"),
    ),
    (
        "dispatch: Worker._start_all / Dispatcher.dispatch (Attempt, submit)",
        ("Worker._start_all", "Dispatcher.dispatch"),
    ),
    ("handler thread: ThreadRunner._step (call, Future)", ("ThreadRunner._step",)),
    (
        "outcome: OutcomeRecorder.handler_returned / decided",
        ("OutcomeRecorder.handler_returned", "OutcomeRecorder.decided"),
    ),
    ("after write: OutcomeRecorder.on_written", ("OutcomeRecorder.on_written",)),
    ("completer loop: Completer._run", ("Completer._run",)),
    ("producer loop: Worker._produce", ("Worker._produce",)),
]


def _matches(name: str, keys: tuple[str, ...]) -> bool:
    return any(name == k or name.endswith("." + k) for k in keys)


def _func(frame: str) -> str:
    """``name (path/file.py:12)`` -> ``name (file.py)``."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    parts = path.split("/")
    short = "/".join(parts[-2:]) if "errands" in parts else parts[-1]
    return f"{name} ({short})"


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far (all its threads), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summarise(raw: Path, jobs: int, rate: float) -> dict[str, Any]:
    own: Counter[str] = Counter()
    area: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        own[_func(frames[-1])] += count
        names = [f.partition(" (")[0] for f in frames]
        for label, keys in AREAS:
            if any(_matches(n, keys) for n in names):
                area[label] += count
                break
        else:
            area["other"] += count
    us_per_sample = 1e6 / HZ

    def per_job(n: int) -> float:
        return n * us_per_sample / jobs

    return {
        "jobs": jobs,
        "rate": rate,
        "hz": HZ,
        "samples": total,
        "cpu_us_per_job": per_job(total),
        "top_self": [
            {"function": f, "us_per_job": per_job(n), "share": n / total}
            for f, n in own.most_common(25)
        ],
        "areas": [
            {"area": a, "us_per_job": per_job(n), "share": n / total} for a, n in area.most_common()
        ],
    }


def profile(store: str, jobs: int, pg_base: str, concurrency: int) -> dict[str, Any]:
    from . import run as bench_run

    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not os.path.exists(py_spy):
        raise SystemExit("py-spy is not installed: .venv/bin/pip install py-spy")
    sys.path.insert(0, str(PEERS))
    import _probe

    if store == "postgres":
        pg = bench_run.Postgres(pg_base)
        pg.recreate("bench_profile")
        url = pg.url("bench_profile")
    else:
        bench_run.WORK.mkdir(parents=True, exist_ok=True)
        path = bench_run.WORK / "profile.db"
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(f"{path}{suffix}"):
                os.remove(f"{path}{suffix}")
        url = f"sqlite:///{path}"
    os.environ["ERRANDS_URL"] = url
    import errands_app

    errands_app.app.url = url
    errands_app.app.close()
    errands_app.app.migrate()
    for start in range(0, jobs, 1000):
        errands_app.app.enqueue_many(
            [errands_app.noop.bind(n=i) for i in range(start, min(jobs, start + 1000))]
        )
    errands_app.app.close()

    probe = _probe.Probe(slots=0)
    argv = [sys.executable, "-m", "errands", "worker", "errands_app:app", "--url", url]
    argv += ["-q", "bench", "-c", str(concurrency), "--log-level", "warning"]
    workers = _probe.Workers([argv], probe.env(), str(PEERS))
    pid = workers.procs[0].pid
    RESULTS.mkdir(parents=True, exist_ok=True)
    raw = RESULTS / f"profile-{store}.txt"
    spy = None
    try:
        # Attach once the worker has started and run its first jobs, so that start-up
        # (imports, connections) stays out of the profile.
        probe.wait(200, timeout=120)
        spy = subprocess.Popen(
            [py_spy, "record", "--pid", str(pid), "--gil", "-r", str(HZ), "-f", "raw",
             "-o", str(raw), "--nonblocking"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        time.sleep(0.5)  # py-spy attaching
        mid = probe.totals()
        cpu_start = cpu_seconds(pid)
        count, first, last = probe.wait(jobs, timeout=300)
        cpu = cpu_seconds(pid) - cpu_start
        rate = (count - 1) / (last - first) if last > first else 0.0
        profiled = count - mid[0]
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                spy.kill()
        workers.stop()
        probe.cleanup()
    if store == "postgres":
        bench_run.Postgres(pg_base).drop("bench_profile")
    summary = summarise(raw, profiled, rate)
    summary["process_cpu_us_per_job"] = cpu * 1e6 / max(profiled, 1)
    print(f"{store}: {profiled:,} jobs profiled at {rate:,.0f}/s under py-spy; "
          f"{summary['cpu_us_per_job']:.0f} µs Python (GIL) per job, "
          f"{summary['process_cpu_us_per_job']:.0f} µs process CPU per job")  # fmt: skip
    for row in summary["areas"]:
        print(f"  {row['us_per_job']:7.1f} µs/job {row['share'] * 100:5.1f} %  {row['area']}")
    for row in summary["top_self"][:12]:
        print(f"  {row['us_per_job']:7.1f} µs/job {row['share'] * 100:5.1f} %  {row['function']}")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile")
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--store", choices=["postgres", "sqlite", "both"], default="both")
    parser.add_argument("-c", "--concurrency", type=int, default=32)
    parser.add_argument(
        "--resummarise",
        action="store_true",
        help="only rebuild profile.json's tables from the raw stacks already recorded",
    )
    parser.add_argument(
        "--pg-url",
        default=os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres"),
    )
    args = parser.parse_args()
    stores = ["postgres", "sqlite"] if args.store == "both" else [args.store]
    out_path = RESULTS / "profile.json"
    results = json.loads(out_path.read_text()) if out_path.exists() else {}
    for store in stores:
        if args.resummarise:
            old = results[store]
            fresh = summarise(RESULTS / f"profile-{store}.txt", old["jobs"], old["rate"])
            results[store] = {**old, **fresh}
            continue
        results[store] = profile(store, args.jobs, args.pg_url, args.concurrency)
        results[store]["at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    out_path.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
