"""errands, on SQLite or PostgreSQL (the URL says which); run with the project's venv."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import _probe

CHUNK = 1000
# enqueue_single alternates errands and the raw insert-and-commit in this many rounds, on
# the same database at the same minutes: a commit's fsync rate drifts by 20-30 % over a
# run here, so a raw figure measured elsewhere in the run is no fair yardstick.
ROUNDS = 5


def _app(spec: dict[str, Any]) -> Any:
    os.environ["ERRANDS_URL"] = spec["url"]
    import errands_app

    return errands_app


def _reset(spec: dict[str, Any]) -> None:
    url = spec["url"]
    if url.startswith("sqlite:///"):
        path = url[len("sqlite:///") :]
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(path + suffix):
                os.remove(path + suffix)


def migrate(spec: dict[str, Any]) -> dict[str, Any]:
    _reset(spec)
    mod = _app(spec)
    mod.app.migrate()
    mod.app.close()
    return {}


def _fresh(spec: dict[str, Any]) -> Any:
    _reset(spec)
    mod = _app(spec)
    mod.app.migrate()
    return mod


def _bulk(mod: Any, n: int) -> float:
    def go() -> None:
        for start in range(0, n, CHUNK):
            mod.app.enqueue_many([mod.noop.bind(n=i) for i in range(start, min(n, start + CHUNK))])

    return _probe.timed(go)


def _raw_single(url: str) -> Any:
    """The limit's raw single-row insert-and-commit on this database: n -> seconds."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench import limit

    if url.startswith("sqlite:///"):
        path = url[len("sqlite:///") :]
        return lambda n: n / limit.sqlite_single_insert(path, n)
    return lambda n: n / limit.pg_single_insert(url, n)


def enqueue_single(spec: dict[str, Any]) -> dict[str, Any]:
    mod = _fresh(spec)
    n = spec["jobs"]
    raw = _raw_single(spec["url"])
    mod.noop.enqueue(n=0)  # connect and warm up outside the timing
    ours = theirs = 0.0
    done = 0
    for r in range(ROUNDS):
        k = (n - done) // (ROUNDS - r)
        t = time.perf_counter()
        for i in range(done, done + k):
            mod.noop.enqueue(n=i)
        ours += time.perf_counter() - t
        theirs += raw(k)
        done += k
    return {"rate": n / ours, "raw_rate": n / theirs, "vs_raw": theirs / ours}


def enqueue_async(spec: dict[str, Any]) -> dict[str, Any]:
    """``await noop.aenqueue(...)`` from one event loop: one at a time (the shape of
    procrastinate's ``defer_async`` and pgqueuer's ``enqueue`` loops in enqueue_single),
    and 64 in flight."""
    import asyncio

    mod = _fresh(spec)
    n = spec["jobs"]

    async def go() -> tuple[float, float]:
        await mod.noop.aenqueue(n=0)  # warm up outside the timing
        t = time.perf_counter()
        for i in range(n):
            await mod.noop.aenqueue(n=i)
        one = time.perf_counter() - t
        gate = asyncio.Semaphore(64)

        async def bounded(i: int) -> None:
            async with gate:
                await mod.noop.aenqueue(n=i)

        t = time.perf_counter()
        await asyncio.gather(*(bounded(i) for i in range(n)))
        return one, time.perf_counter() - t

    one, many = asyncio.run(go())
    return {"rate": n / one, "rate_concurrent": n / many}


def enqueue_bulk(spec: dict[str, Any]) -> dict[str, Any]:
    """On PostgreSQL, alternating with the raw COPY committed every CHUNK rows (the limit's
    ``copy_chunked``) in ROUNDS rounds on the same table, as enqueue_single alternates
    with its raw insert: the bulk target is a share of COPY, and a COPY timed minutes away
    meets another load on the machine (the limit's runs of one commit spread 1.13 x)."""
    mod = _fresh(spec)
    n = spec["jobs"]
    mod.noop.enqueue(n=0)
    if spec["url"].startswith("sqlite:///"):
        return {"rate": n / _bulk(mod, n)}
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench import limit

    ours = theirs = 0.0
    done = 0
    for r in range(ROUNDS):
        k = (n - done) // (ROUNDS - r)
        ours += _bulk(mod, k)
        theirs += limit.pg_copy_available(spec["url"], k, chunk=CHUNK)
        done += k
    return {"rate": n / ours, "raw_rate": n / theirs, "vs_raw": theirs / ours}


def _commands(spec: dict[str, Any]) -> Any:
    def commands(procs: int) -> list[list[str]]:
        # As a user starts it: `errands worker module:app`, the URL from ERRANDS_URL (the
        # app reads it), then only what the configuration names.
        os.environ["ERRANDS_URL"] = spec["url"]
        config = spec.get("config", {})
        if config.get("handler") == "async":  # errands_app defines the job `async def`
            os.environ["BENCH_ASYNC"] = "1"
        argv = [sys.executable, "-m", "errands", "worker", "errands_app:app"]
        if "concurrency" in config:
            argv += ["-c", str(config["concurrency"])]
        if "prefetch" in config:
            argv += ["--prefetch", str(config["prefetch"])]
        if "log_level" in config:
            argv += ["--log-level", config["log_level"]]
        if procs > 1:
            argv += ["--processes", str(procs)]
        return [argv]

    return commands


def throughput(spec: dict[str, Any]) -> dict[str, Any]:
    mod = _fresh(spec)
    return _probe.throughput(spec, lambda n: _bulk(mod, n), _commands(spec))


def latency(spec: dict[str, Any]) -> dict[str, Any]:
    mod = _fresh(spec)
    mod.app.backend.db_now()  # connect before the clock starts
    return _probe.latency(spec, lambda i: mod.noop.enqueue(n=i), _commands(spec))


def produce(spec: dict[str, Any]) -> dict[str, Any]:
    mod = _app(spec)

    def connect() -> Any:
        mod.app.backend.db_now()
        return lambda i: mod.noop.enqueue(n=i)

    return _probe.produce(spec, connect)


def commands(spec: dict[str, Any]) -> dict[str, Any]:
    return _probe.commands_scenario(_commands(spec))(spec)


if __name__ == "__main__":
    _probe.main(
        {
            "migrate": migrate,
            "produce": produce,
            "commands": commands,
            "enqueue_single": enqueue_single,
            "enqueue_async": enqueue_async,
            "enqueue_bulk": enqueue_bulk,
            "throughput": throughput,
            "latency": latency,
        }
    )
