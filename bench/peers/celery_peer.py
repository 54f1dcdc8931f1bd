"""Celery on the local Redis (prefork pool), as a reference outside PostgreSQL."""

from __future__ import annotations

import os
import sys
from typing import Any

import _probe

CHUNK = 1000


def _mod(spec: dict[str, Any]) -> Any:
    os.environ["BENCH_REDIS_URL"] = spec["url"]
    import celery_app
    import redis

    redis.Redis.from_url(spec["url"]).flushdb()
    return celery_app


def _bulk(mod: Any, n: int) -> float:
    from celery import group

    def go() -> None:
        for start in range(0, n, CHUNK):
            group(mod.noop.s(i) for i in range(start, min(n, start + CHUNK))).apply_async()

    return _probe.timed(go)


def migrate(spec: dict[str, Any]) -> dict[str, Any]:
    return {}


def enqueue_single(spec: dict[str, Any]) -> dict[str, Any]:
    mod, n = _mod(spec), spec["jobs"]
    mod.noop.delay(0)

    def go() -> None:
        for i in range(n):
            mod.noop.delay(i)

    return {"rate": n / _probe.timed(go)}


def enqueue_bulk(spec: dict[str, Any]) -> dict[str, Any]:
    mod = _mod(spec)
    mod.noop.delay(0)
    return {"rate": spec["jobs"] / _bulk(mod, spec["jobs"])}


def _commands(spec: dict[str, Any]) -> Any:
    def commands(procs: int) -> list[list[str]]:
        exe = os.path.join(os.path.dirname(sys.executable), "celery")
        config = spec.get("config", {})
        base = [exe, "-A", "celery_app", "worker", "-Q", "bench"]
        base += ["-l", "warning", "--without-gossip", "--without-mingle", "--without-heartbeat"]
        if config.get("pool") == "threads":  # one node of -c threads per "process"
            return [
                [*base, "-P", "threads", "-c", str(config["threads"]), "-n", f"bench{i}@%h"]
                for i in range(procs)
            ]
        argv = [*base, "-P", "prefork", "-c", str(procs)]
        if "prefetch" in config:
            argv += ["--prefetch-multiplier", str(config["prefetch"])]
        return [argv]

    return commands


def throughput(spec: dict[str, Any]) -> dict[str, Any]:
    mod = _mod(spec)
    return _probe.throughput(spec, lambda n: _bulk(mod, n), _commands(spec))


def latency(spec: dict[str, Any]) -> dict[str, Any]:
    mod = _mod(spec)
    return _probe.latency(spec, lambda i: mod.noop.delay(i), _commands(spec))


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
