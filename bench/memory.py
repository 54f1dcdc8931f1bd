"""Issue 8's memory target over a long run: one worker's resident memory stays flat
across 100,000 jobs (a benchmark, never a timed test).

One real ``errands worker errands_app:app -q bench -c 32`` process (the app of
``bench/peers/errands_app.py``) runs on a fresh store while this process feeds it no-op
jobs with ``app.enqueue_many`` in chunks of 1,000, keeping at most ~20,000 waiting so it
never idles. About every 0.5 s the worker's VmRSS (``/proc/PID/status``) is read together
with the number of completed rows (a count on the jobs table's state index), until every
job is completed; then the worker gets SIGTERM. The figures: RSS when 10 %, 25 %, 50 %,
75 % and 100 % of the jobs were completed (10,000 ... 100,000 in a full run), VmHWM at
the end, and the growth from the 10 % mark to the end: the first 10 % are the warm-up
(imports, connection pool, thread stacks, allocator arenas), after that memory should
not move.

    python -m bench.memory                    # both stores, 100,000 jobs each
    python -m bench.memory --jobs 10000 --store sqlite
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from .systems import PEERS

JOBS = 100_000
CHUNK = 1000  # jobs per enqueue_many call
BACKLOG = 20_000  # at most this many enqueued and not completed: never idle, never a flood
CONCURRENCY = 32
SAMPLE_EVERY = 0.5  # seconds between samples of RSS and completed jobs
MARKS = (0.10, 0.25, 0.50, 0.75, 1.00)  # checkpoints, as shares of the run's jobs
# "Flat": from the 10 % mark (after the warm-up) to the end, the RSS trend (least-squares
# slope over jobs) adds at most 5 MB and at most 10 % per 100,000 jobs. Both must hold:
# 5 MB keeps a small process honest, 10 % a large one; below them it is allocator and
# sampling noise, not a leak per job (a leak of 64 bytes a job would be ~6 MB/100,000).
FLAT_MB = 5.0
FLAT_SHARE = 0.10


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _probe() -> ModuleType:
    """``bench/peers/_probe.py`` (worker processes, /proc readers), without touching sys.path."""
    mod = sys.modules.get("_probe")
    if mod is None:
        spec = importlib.util.spec_from_file_location("_probe", PEERS / "_probe.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["_probe"] = mod
        spec.loader.exec_module(mod)
    return mod


def worker_command(python: str, url: str, concurrency: int = CONCURRENCY) -> list[str]:
    """The worker command line, as ``bench/peers/errands_peer.py`` builds it."""
    return [
        python, "-m", "errands", "worker", "errands_app:app", "--url", url,
        "-q", "bench", "-c", str(concurrency), "--log-level", "warning",
    ]  # fmt: skip


def _feeder(url: str) -> tuple[Any, Any]:
    """An app with the job of ``errands_app`` (same name and queue) to enqueue from here."""
    import errands

    app = errands.App(url)

    @app.job(name="bench.noop", queue="bench")
    def noop(n: int) -> None:  # runs in the worker (errands_app.noop), never here
        del n

    return app, noop


def _completed_counter(url: str) -> tuple[Callable[[], int], Callable[[], None]]:
    """A count of completed jobs (on PostgreSQL through errands_jobs_finished or a scan of
    the table: since schema version 12 no index holds completed rows by state alone)."""
    sql = "SELECT count(*) FROM errands_jobs WHERE state = 'completed'"
    if url.startswith("sqlite:///"):
        from . import limit

        conn: Any = limit.sqlite_connect(url[len("sqlite:///") :])
    else:
        import psycopg

        conn = psycopg.connect(url, autocommit=True)

    def count() -> int:
        row = conn.execute(sql).fetchone()
        return int(row[0]) if row else 0

    return count, conn.close


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM to this process unwinds like Ctrl-C, so the worker is stopped on the way."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


STATUS_FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")  # kB; VmRSS is their sum


def _status(pid: int) -> dict[str, int] | None:
    """The resident-memory lines of /proc/PID/status in one read (None: the process is gone)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in STATUS_FIELDS:
                    out[name] = int(rest.split()[0])
    except (OSError, ValueError):
        return None
    return out if "VmRSS" in out else None


def _mb(kb: int | None) -> float | None:
    return None if kb is None else kb / 1024


def measure(
    url: str,
    jobs: int = JOBS,
    *,
    python: str | None = None,
    concurrency: int = CONCURRENCY,
    timeout: float | None = None,
    sample_every: float = SAMPLE_EVERY,
    log: Callable[[str], None] = _log,
) -> dict[str, Any]:
    """Run one worker through ``jobs`` no-op jobs on the fresh, migrated store at ``url``.

    The store must be empty; on a timeout, a dead worker or an interrupt the worker is
    stopped all the same (SIGTERM, SIGKILL after 10 s) and the error raised.
    """
    probe_mod = _probe()
    label = "sqlite" if url.startswith("sqlite:") else "postgres"
    timeout = timeout if timeout is not None else max(120.0, jobs / 200)  # 200 jobs/s at worst
    # A run shorter than a chunk enqueues in one call (with a 1,000-job chunk, 800 jobs
    # never passed the backlog test below: nothing was enqueued, the run timed out).
    chunk = min(CHUNK, jobs)
    backlog = min(BACKLOG, jobs)
    marks = sorted({max(1, round(jobs * share)) for share in MARKS})
    samples: list[tuple[float, int, int, dict[str, int]]] = []  # (s, completed, enqueued, kB)
    reached: dict[int, tuple[int, int]] = {}  # mark -> (completed, VmRSS kB) at first sample
    app, noop = _feeder(url)
    count, close_count = _completed_counter(url)
    probe = probe_mod.Probe(slots=0)  # only to learn which process ran the jobs
    workers = None
    stopped_cleanly = None
    try:
        with _sigterm_unwinds():
            workers = probe_mod.Workers(
                [worker_command(python or sys.executable, url, concurrency)],
                {**probe.env(), "ERRANDS_URL": url},
                str(PEERS),
            )
            proc = workers.procs[0]
            pid = proc.pid
            started = time.monotonic()
            deadline = started + timeout
            next_sample = started
            enqueued = done = 0
            while True:
                now = time.monotonic()
                if now >= next_sample:
                    done = count()
                    status = _status(pid)
                    workers.check_alive()
                    if status is None:
                        raise RuntimeError(f"worker {pid} vanished: " + workers.log_tail())
                    samples.append((now - started, done, enqueued, status))
                    for mark in marks:
                        if mark not in reached and done >= mark:
                            reached[mark] = (done, status["VmRSS"])
                    if done >= jobs:
                        break
                    if now > deadline:
                        raise RuntimeError(
                            f"{label}: only {done:,} of {jobs:,} jobs completed in "
                            f"{timeout:.0f} s: " + workers.log_tail()
                        )
                    next_sample = max(next_sample + sample_every, now + sample_every / 2)
                if enqueued < jobs and enqueued - done <= backlog - chunk:
                    end = min(jobs, enqueued + chunk)
                    app.enqueue_many([noop.bind(n=i) for i in range(enqueued, end)])
                    enqueued = end
                else:
                    time.sleep(max(0.0, min(next_sample - time.monotonic(), 0.05)))
            elapsed = time.monotonic() - started
            hwm = probe_mod.proc_status(pid, "VmHWM")
            job_pids = probe.pids()
            tree = probe_mod.memory(workers.tree())
            workers.stop()
            stopped_cleanly = proc.returncode == 0
    finally:
        if workers is not None and stopped_cleanly is None:
            workers.stop()
        probe.cleanup()
        close_count()
        app.close()
    if job_pids and job_pids != [pid]:
        log(f"memory {label}: jobs ran in {job_pids}, sampled {pid} (the worker process)")
    first, last = reached[marks[0]][1], reached[marks[-1]][1]
    growth_kb = last - first
    growth_mb = growth_kb / 1024
    share = growth_kb / first if first else None
    # The verdict uses the least-squares slope of RSS over jobs completed after the first
    # mark: a leak per job shows as a steady slope, while allocator ups and downs (heap
    # spikes of 10-20 MB that fall back, seen on SQLite under write contention) barely
    # move it. The two-reading growth above can land on such a spike: reported beside it.
    tail = [(d, st["VmRSS"]) for _, d, _, st in samples if d >= marks[0]]
    trend = None
    if len(tail) >= 3 and len({d for d, _ in tail}) > 1:
        fit = statistics.linear_regression([d for d, _ in tail], [r for _, r in tail])
        trend = fit.slope * 100_000 / 1024
    flat = None  # too few samples to tell (a tiny run)
    if trend is not None:
        flat = trend <= FLAT_MB and trend * 1024 <= FLAT_SHARE * first
    out: dict[str, Any] = {
        "jobs": jobs,
        "chunk": chunk,
        "backlog": backlog,
        "concurrency": concurrency,
        "pid": pid,
        "job_pids": job_pids,
        "seconds": elapsed,
        "rate": jobs / elapsed if elapsed else None,
        "checkpoints": [
            {"jobs": mark, "completed": reached[mark][0], "rss_mb": reached[mark][1] / 1024}
            for mark in marks
        ],
        "hwm_mb": _mb(hwm),
        "growth_mb": growth_mb,
        "growth_share": share,
        "flat": flat,
        "flat_limits": {"mb": FLAT_MB, "share": FLAT_SHARE},
        "trend_mb_per_100k": trend,
        "stopped_cleanly": stopped_cleanly,  # exited 0 on SIGTERM
        "tree_memory": tree,
        "sample_every": sample_every,
        # [seconds, completed, enqueued, VmRSS, RssAnon, RssFile, RssShmem (kB)]; enqueued -
        # completed is the backlog; anonymous memory is the heap, file/shmem are mappings
        "samples": [
            [round(t, 2), d, e, *(st.get(k) for k in STATUS_FIELDS)] for t, d, e, st in samples
        ],
    }
    log(f"memory {label}: " + brief(out))
    return out


def brief(out: dict[str, Any]) -> str:
    marks = ", ".join(f"{c['jobs']:,}: {c['rss_mb']:.1f}" for c in out["checkpoints"])
    share = out["growth_share"]
    slope = out.get("trend_mb_per_100k")
    trend = "—" if slope is None else f"{slope:+.1f} MB per 100,000 jobs"
    return (
        f"RSS MB at {marks}; peak {out['hwm_mb']:.1f} MB; growth {out['growth_mb']:+.1f} MB "
        f"({share * 100:+.1f} %), {'flat' if out['flat'] else 'NOT flat'}; trend {trend}; "
        f"{out['rate']:,.0f} jobs/s"
    )


def sqlite_memory(path: str, jobs: int = JOBS, **kwargs: Any) -> dict[str, Any]:
    """On a new SQLite file at ``path`` (removed afterwards)."""
    from . import limit

    limit.sqlite_fresh(path)
    try:
        return measure(f"sqlite:///{path}", jobs, **kwargs)
    finally:
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path + suffix)


def main(argv: list[str] | None = None) -> int:
    from . import report
    from .run import PG_URL_DEFAULT, WORK, Postgres

    parser = argparse.ArgumentParser(
        prog="python -m bench.memory", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--jobs", type=int, default=JOBS, help="jobs per store (default 100,000)")
    parser.add_argument(
        "--store", action="append", choices=("postgres", "sqlite"), help="default: both"
    )
    parser.add_argument("--pg-url", default=os.environ.get("BENCH_PG_URL", PG_URL_DEFAULT))
    args = parser.parse_args(argv)
    stores = args.store or ["postgres", "sqlite"]
    results: dict[str, Any] = {}
    if "postgres" in stores:
        pg, db = Postgres(args.pg_url), "bench_memory"
        try:
            pg.recreate(db)
            app, _ = _feeder(pg.url(db))
            try:
                app.migrate()
            finally:
                app.close()
            results["postgres"] = measure(pg.url(db), args.jobs)
        except Exception as exc:
            results["postgres"] = {"error": str(exc)}
            _log(f"memory postgres: FAILED: {exc}")
        finally:
            with contextlib.suppress(Exception):
                pg.drop(db)
    if "sqlite" in stores:
        WORK.mkdir(parents=True, exist_ok=True)
        try:
            results["sqlite"] = sqlite_memory(str(WORK / "memory.db"), args.jobs)
        except Exception as exc:
            results["sqlite"] = {"error": str(exc)}
            _log(f"memory sqlite: FAILED: {exc}")
    with contextlib.suppress(OSError):
        WORK.rmdir()  # only when empty: `make bench` may be using it
    report.print_memory(results)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
