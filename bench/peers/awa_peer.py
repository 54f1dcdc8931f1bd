"""awa-pg (Rust core, Python SDK) on PostgreSQL, with its queue-storage engine active."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import _probe
import awa
from awa_app import SCHEMA, Noop

CHUNK = 1000


def _client(spec: dict[str, Any]) -> awa.AsyncClient:
    return awa.AsyncClient(spec["url"], max_connections=20)


async def _bulk(client: awa.AsyncClient, n: int) -> None:
    for start in range(0, n, CHUNK):
        jobs = [Noop(n=i) for i in range(start, min(n, start + CHUNK))]
        await client.enqueue_many_copy(jobs, queue="bench")


def migrate(spec: dict[str, Any]) -> dict[str, Any]:
    async def go() -> None:
        client = _client(spec)
        await client.migrate()
        await client.install_queue_storage(schema=SCHEMA, reset=True)
        await client.close()

    asyncio.run(go())
    return {}


def _timed(spec: dict[str, Any], body: Any) -> float:
    async def go() -> float:
        client = _client(spec)
        await client.insert(Noop(n=0), queue="bench")
        t = asyncio.get_running_loop().time()
        await body(client)
        elapsed = asyncio.get_running_loop().time() - t
        await client.close()
        return elapsed

    return asyncio.run(go())


def enqueue_single(spec: dict[str, Any]) -> dict[str, Any]:
    n = spec["jobs"]

    async def body(client: awa.AsyncClient) -> None:
        for i in range(n):
            await client.insert(Noop(n=i), queue="bench")

    return {"rate": n / _timed(spec, body)}


def enqueue_bulk(spec: dict[str, Any]) -> dict[str, Any]:
    n = spec["jobs"]
    return {"rate": n / _timed(spec, lambda c: _bulk(c, n))}


def _commands(spec: dict[str, Any]) -> Any:
    os.environ["BENCH_PG_URL"] = spec["url"]

    def commands(procs: int) -> list[list[str]]:
        config = spec.get("config", {})
        os.environ["BENCH_AWA_CONNECTIONS"] = str(config.get("max_connections", 10))
        argv = [sys.executable, "-m", "awa_app", str(config.get("workers", 50))]
        return [argv for _ in range(procs)]

    return commands


def throughput(spec: dict[str, Any]) -> dict[str, Any]:
    def prefill(n: int) -> float:
        return _timed(spec, lambda c: _bulk(c, n))

    return _probe.throughput(spec, prefill, _commands(spec))


def latency(spec: dict[str, Any]) -> dict[str, Any]:
    loop = asyncio.new_event_loop()
    client = _client(spec)
    loop.run_until_complete(client.queue_stats())  # connect before the clock starts
    try:
        return _probe.latency(
            spec,
            lambda i: loop.run_until_complete(client.insert(Noop(n=i), queue="bench")),
            _commands(spec),
        )
    finally:
        loop.run_until_complete(client.close())
        loop.close()


def produce(spec: dict[str, Any]) -> dict[str, Any]:
    loop = asyncio.new_event_loop()

    def connect() -> Any:
        client = _client(spec)
        loop.run_until_complete(client.queue_stats())
        return lambda i: loop.run_until_complete(client.insert(Noop(n=i), queue="bench"))

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
            "enqueue_bulk": enqueue_bulk,
            "throughput": throughput,
            "latency": latency,
        }
    )
