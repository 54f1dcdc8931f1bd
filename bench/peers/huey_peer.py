"""huey with its SQLite storage (``huey_consumer``, worker processes)."""

from __future__ import annotations

import os
import sys
from typing import Any

import _probe


def _mod(spec: dict[str, Any]) -> Any:
    path = spec["url"]
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.remove(path + suffix)
    os.environ["BENCH_SQLITE_PATH"] = path
    import huey_app

    return huey_app


def _loop(mod: Any, n: int) -> float:
    def go() -> None:
        for i in range(n):
            mod.noop(i)

    return _probe.timed(go)


def migrate(spec: dict[str, Any]) -> dict[str, Any]:
    return {}


def enqueue_single(spec: dict[str, Any]) -> dict[str, Any]:
    mod = _mod(spec)
    mod.noop(0)
    return {"rate": spec["jobs"] / _loop(mod, spec["jobs"])}


def _commands(spec: dict[str, Any]) -> Any:
    def commands(procs: int) -> list[list[str]]:
        exe = os.path.join(os.path.dirname(sys.executable), "huey_consumer")
        kind = spec.get("config", {}).get("kind", "thread")
        return [[exe, "huey_app.huey", "-k", kind, "-w", str(procs), "-q"]]

    return commands


def throughput(spec: dict[str, Any]) -> dict[str, Any]:
    # huey has no bulk enqueue: the queue is filled one call per job (not timed as bulk).
    mod = _mod(spec)
    result = _probe.throughput(spec, lambda n: _loop(mod, n), _commands(spec))
    result["bulk_rate"] = None
    return result


def latency(spec: dict[str, Any]) -> dict[str, Any]:
    mod = _mod(spec)
    return _probe.latency(spec, lambda i: mod.noop(i), _commands(spec))


if __name__ == "__main__":
    _probe.main(
        {
            "migrate": migrate,
            "enqueue_single": enqueue_single,
            "throughput": throughput,
            "latency": latency,
        }
    )
