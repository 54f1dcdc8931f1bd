"""oban (oban-py, the Python port of Oban) on PostgreSQL, ``oban start``."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import _probe
from oban import Oban
from oban.schema import install
from oban_app import Noop

CHUNK = 1000


async def _client(spec: dict[str, Any]) -> tuple[Any, Oban]:
    pool = await Oban.create_pool(spec["url"])
    oban = Oban(pool=pool)
    await oban.start()
    return pool, oban


async def _close(pool: Any, oban: Oban) -> None:
    await oban.stop()
    await pool.close()


async def _bulk(oban: Oban, n: int) -> None:
    for start in range(0, n, CHUNK):
        await oban.enqueue_many([Noop.new({"n": i}) for i in range(start, min(n, start + CHUNK))])


def migrate(spec: dict[str, Any]) -> dict[str, Any]:
    async def go() -> None:
        pool = await Oban.create_pool(spec["url"])
        await install(pool)
        await pool.close()

    asyncio.run(go())
    return {}


def _timed(spec: dict[str, Any], body: Any) -> float:
    async def go() -> float:
        pool, oban = await _client(spec)
        await oban.enqueue(Noop.new({"n": 0}))
        t = asyncio.get_running_loop().time()
        await body(oban)
        elapsed = asyncio.get_running_loop().time() - t
        await _close(pool, oban)
        return elapsed

    return asyncio.run(go())


def enqueue_single(spec: dict[str, Any]) -> dict[str, Any]:
    n = spec["jobs"]

    async def body(oban: Oban) -> None:
        for i in range(n):
            await oban.enqueue(Noop.new({"n": i}))

    return {"rate": n / _timed(spec, body)}


def enqueue_bulk(spec: dict[str, Any]) -> dict[str, Any]:
    n = spec["jobs"]
    return {"rate": n / _timed(spec, lambda oban: _bulk(oban, n))}


def _commands(spec: dict[str, Any]) -> Any:
    def commands(procs: int) -> list[list[str]]:
        exe = os.path.join(os.path.dirname(sys.executable), "oban")
        config = spec.get("config", {})
        argv = [exe, "start", "--dsn", spec["url"], "--queues", f"bench:{config.get('limit', 10)}"]
        if "log_level" in config:
            argv += ["--log-level", config["log_level"]]
        return [argv for _ in range(procs)]

    return commands


def throughput(spec: dict[str, Any]) -> dict[str, Any]:
    def prefill(n: int) -> float:
        async def go() -> float:
            pool, oban = await _client(spec)
            t = asyncio.get_running_loop().time()
            await _bulk(oban, n)
            elapsed = asyncio.get_running_loop().time() - t
            await _close(pool, oban)
            return elapsed

        return asyncio.run(go())

    return _probe.throughput(spec, prefill, _commands(spec))


def latency(spec: dict[str, Any]) -> dict[str, Any]:
    loop = asyncio.new_event_loop()
    pool, oban = loop.run_until_complete(_client(spec))
    try:
        return _probe.latency(
            spec,
            lambda i: loop.run_until_complete(oban.enqueue(Noop.new({"n": i}))),
            _commands(spec),
        )
    finally:
        loop.run_until_complete(_close(pool, oban))
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
