"""Dramatiq on the local Redis (worker processes x threads), as a reference."""

from __future__ import annotations

import os
import sys
from typing import Any

import _probe

CHUNK = 1000


def _mod(spec: dict[str, Any]) -> Any:
    os.environ["BENCH_REDIS_URL"] = spec["url"]
    import dramatiq_app
    import redis

    redis.Redis.from_url(spec["url"]).flushdb()
    return dramatiq_app


def _bulk(mod: Any, n: int) -> float:
    from dramatiq import group

    def go() -> None:
        for start in range(0, n, CHUNK):
            group(mod.noop.message(i) for i in range(start, min(n, start + CHUNK))).run()

    return _probe.timed(go)


def migrate(spec: dict[str, Any]) -> dict[str, Any]:
    return {}


def enqueue_single(spec: dict[str, Any]) -> dict[str, Any]:
    mod, n = _mod(spec), spec["jobs"]
    mod.noop.send(0)

    def go() -> None:
        for i in range(n):
            mod.noop.send(i)

    return {"rate": n / _probe.timed(go)}


def enqueue_bulk(spec: dict[str, Any]) -> dict[str, Any]:
    mod = _mod(spec)
    mod.noop.send(0)
    return {"rate": spec["jobs"] / _bulk(mod, spec["jobs"])}


def _commands(spec: dict[str, Any]) -> Any:
    def commands(procs: int) -> list[list[str]]:
        exe = os.path.join(os.path.dirname(sys.executable), "dramatiq")
        threads = spec.get("config", {}).get("threads", 8)
        argv = [exe, "dramatiq_app", "--processes", str(procs), "--threads", str(threads)]
        argv += ["-Q", "bench"]
        return [argv]

    return commands


def throughput(spec: dict[str, Any]) -> dict[str, Any]:
    mod = _mod(spec)
    return _probe.throughput(spec, lambda n: _bulk(mod, n), _commands(spec))


def latency(spec: dict[str, Any]) -> dict[str, Any]:
    mod = _mod(spec)
    return _probe.latency(spec, lambda i: mod.noop.send(i), _commands(spec))


if __name__ == "__main__":
    _probe.main(
        {
            "migrate": migrate,
            "enqueue_single": enqueue_single,
            "enqueue_bulk": enqueue_bulk,
            "throughput": throughput,
            "latency": latency,
        }
    )
