"""procrastinate on PostgreSQL (psycopg 3, async tasks, ``procrastinate worker``)."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import _probe

CHUNK = 1000


def _mod(spec: dict[str, Any]) -> Any:
    os.environ["BENCH_PG_URL"] = spec["url"]
    import procrastinate_app

    return procrastinate_app


async def _bulk(mod: Any, n: int) -> None:
    for start in range(0, n, CHUNK):
        await mod.noop.batch_defer_async(*({"n": i} for i in range(start, min(n, start + CHUNK))))


def migrate(spec: dict[str, Any]) -> dict[str, Any]:
    mod = _mod(spec)

    async def go() -> None:
        async with mod.app.open_async():
            await mod.app.schema_manager.apply_schema_async()

    asyncio.run(go())
    return {}


def enqueue_single(spec: dict[str, Any]) -> dict[str, Any]:
    mod, n = _mod(spec), spec["jobs"]

    async def go() -> float:
        async with mod.app.open_async():
            await mod.noop.defer_async(n=0)
            t = asyncio.get_running_loop().time()
            for i in range(n):
                await mod.noop.defer_async(n=i)
            return asyncio.get_running_loop().time() - t

    return {"rate": n / asyncio.run(go())}


def enqueue_bulk(spec: dict[str, Any]) -> dict[str, Any]:
    mod, n = _mod(spec), spec["jobs"]

    async def go() -> float:
        async with mod.app.open_async():
            await mod.noop.defer_async(n=0)
            t = asyncio.get_running_loop().time()
            await _bulk(mod, n)
            return asyncio.get_running_loop().time() - t

    return {"rate": n / asyncio.run(go())}


def _commands(spec: dict[str, Any]) -> Any:
    def commands(procs: int) -> list[list[str]]:
        exe = os.path.join(os.path.dirname(sys.executable), "procrastinate")
        argv = [exe, "--app=procrastinate_app.app", "worker", "-q", "bench"]
        if "concurrency" in spec.get("config", {}):
            argv += ["-c", str(spec["config"]["concurrency"])]
        return [argv for _ in range(procs)]

    return commands


def throughput(spec: dict[str, Any]) -> dict[str, Any]:
    mod = _mod(spec)

    def prefill(n: int) -> float:
        async def go() -> float:
            async with mod.app.open_async():
                t = asyncio.get_running_loop().time()
                await _bulk(mod, n)
                return asyncio.get_running_loop().time() - t

        return asyncio.run(go())

    return _probe.throughput(spec, prefill, _commands(spec))


def latency(spec: dict[str, Any]) -> dict[str, Any]:
    mod = _mod(spec)
    loop = asyncio.new_event_loop()
    opened = mod.app.open_async()
    loop.run_until_complete(opened.__aenter__())
    try:
        return _probe.latency(
            spec,
            lambda i: loop.run_until_complete(mod.noop.defer_async(n=i)),
            _commands(spec),
        )
    finally:
        loop.run_until_complete(opened.__aexit__(None, None, None))
        loop.close()


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
