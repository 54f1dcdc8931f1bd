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
        argv = [exe, "-A", "celery_app", "worker", "-P", "prefork", "-c", str(procs)]
        argv += ["-Q", "bench", "-l", "warning", "--without-gossip", "--without-mingle"]
        argv += ["--without-heartbeat"]
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
