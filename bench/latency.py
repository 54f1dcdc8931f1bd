"""Idle pickup latency: from enqueue to the handler's first line, with and without wake-ups.

A separate ``errands worker`` process serves a probe job whose argument is the time it was
enqueued; the handler returns how long it waited. Jobs arrive one at a time at a steady
rate (default 300 jobs at 50/s), so the worker is idle when each arrives: this measures
how fast an idle worker notices new work, not throughput.

On PostgreSQL it runs twice: with LISTEN/NOTIFY wake-ups (the default), then with
``listen=false`` in the URL (polling alone, as behind PgBouncer in transaction mode), where
pickup waits for the next poll. On SQLite the worker is woken by ``PRAGMA data_version``
(there is no switch to turn that off), so it runs once.

::

    python bench/latency.py                                   # PostgreSQL on 127.0.0.1
    python bench/latency.py --url postgresql://user@host/db   # a schema is made and dropped
    python bench/latency.py --url sqlite:///tmp/bench.db
    python bench/latency.py --jobs 300 --rate 50 --poll-interval 1.0

Both processes run on this machine, so their clocks agree; the figures include the
enqueue's own commit.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import errands

ROOT = Path(__file__).resolve().parent.parent
PG_URL_DEFAULT = "postgresql://postgres@127.0.0.1:5432/errands_test"

app = errands.App()  # the worker gets its URL from --url; this process sets app.url


@app.job(name="bench.probe", retries=0)
def probe(enqueued_at: float) -> float:
    """Seconds between the enqueue and this handler starting."""
    return time.time() - enqueued_at


def _with_params(url: str, **params: str) -> str:
    sep = "&" if "?" in url else "?"
    return url + sep + "&".join(f"{k}={v}" for k, v in params.items())


def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    rank = max(1, round(pct / 100 * len(ordered) + 0.5 - 1e-9))
    return ordered[min(rank, len(ordered)) - 1]


def _wait_started(stderr: Path, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if re.search(r"worker w-[0-9a-f]+ started", stderr.read_text(errors="replace")):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise SystemExit(f"the worker did not start:\n{stderr.read_text(errors='replace')[-3000:]}")


def measure(url: str, jobs: int, rate: float, poll_interval: float, folder: Path) -> list[float]:
    """Start a worker on ``url``, enqueue ``jobs`` probes at ``rate``/s, return the waits."""
    stderr_path = folder / f"worker-{secrets.token_hex(3)}.stderr"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ERRANDS_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p)
    with stderr_path.open("wb") as err:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "errands",
                "worker",
                "bench.latency:app",
                "--url",
                url,
                "--poll-interval",
                str(poll_interval),
                "-c",
                "4",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            cwd=ROOT,
            env=env,
        )
    try:
        _wait_started(stderr_path, worker)
        for _ in range(3):  # warm up: connections open, the LISTEN session is up
            probe.enqueue(enqueued_at=time.time()).result(timeout=poll_interval + 30)
        handles = []
        start = time.monotonic()
        for i in range(jobs):
            pause = start + i / rate - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            handles.append(probe.enqueue(enqueued_at=time.time()))
        return [float(h.result(timeout=poll_interval + 60)) for h in handles]
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--url",
        default=os.environ.get("ERRANDS_BENCH_URL", PG_URL_DEFAULT),
        help="postgresql://... (a fresh schema is made unless schema= is given) or sqlite:///...",
    )
    parser.add_argument("--jobs", type=int, default=300, help="probes per mode (default 300)")
    parser.add_argument("--rate", type=float, default=50.0, help="probes per second (default 50)")
    parser.add_argument(
        "--poll-interval", type=float, default=1.0, help="the worker's poll interval (default 1)"
    )
    args = parser.parse_args(argv)

    scheme = urlsplit(args.url).scheme
    own_schema: str | None = None
    if scheme.startswith("postgres"):
        options = dict(parse_qsl(urlsplit(args.url).query))
        url = args.url
        if "schema" not in options:
            own_schema = f"bench_{secrets.token_hex(4)}"
            url = _with_params(url, schema=own_schema)
        if "auto_migrate" not in options:
            url = _with_params(url, auto_migrate="true")
        store = "PostgreSQL"
        modes = [
            ("LISTEN/NOTIFY wake-ups", url),
            ("polling only (listen=false)", _with_params(url, listen="false")),
        ]
    elif scheme == "sqlite":
        url = args.url
        store = "SQLite"
        modes = [("data_version wake-ups", url)]
    else:
        parser.error(f"unsupported URL {args.url!r}: postgresql://... or sqlite:///...")

    rows = []
    with tempfile.TemporaryDirectory(prefix="errands-bench-") as tmp:
        app.url = url
        try:
            app.migrate()
            for label, mode_url in modes:
                waits = measure(mode_url, args.jobs, args.rate, args.poll_interval, Path(tmp))
                rows.append((label, waits))
        finally:
            app.close()
            if own_schema is not None:
                import psycopg

                from errands.backends.postgres.config import parse_postgres_url

                with (
                    contextlib.suppress(Exception),
                    psycopg.connect(parse_postgres_url(url).conninfo, autocommit=True) as conn,
                ):
                    conn.execute(f'DROP SCHEMA IF EXISTS "{own_schema}" CASCADE')

    print(
        f"errands idle pickup latency on {store} (enqueue -> handler start): "
        f"{args.jobs} jobs at {args.rate:g}/s, worker poll interval {args.poll_interval:g} s"
    )
    print(f"{'mode':<30}{'p50':>10}{'p95':>10}{'p99':>10}{'max':>10}")
    for label, waits in rows:
        cells = [percentile(waits, p) for p in (50, 95, 99)] + [max(waits)]
        print(f"{label:<30}" + "".join(f"{c * 1000:>8.1f}ms" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
