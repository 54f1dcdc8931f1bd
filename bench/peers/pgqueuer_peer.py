"""pgqueuer on PostgreSQL (asyncpg driver, ``pgq run``)."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import _probe
import asyncpg
from pgqueuer.db import AsyncpgDriver
from pgqueuer.queries import Queries

CHUNK = 1000


async def _queries(spec: dict[str, Any]) -> tuple[Any, Queries]:
    conn = await asyncpg.connect(spec["url"])
    return conn, Queries(AsyncpgDriver(conn))


async def _bulk(q: Queries, n: int) -> None:
    for start in range(0, n, CHUNK):
        k = min(n, start + CHUNK) - start
        await q.enqueue(["noop"] * k, [str(i).encode() for i in range(start, start + k)], [0] * k)


def migrate(spec: dict[str, Any]) -> dict[str, Any]:
    async def go() -> None:
        conn, q = await _queries(spec)
        await q.install()
        await conn.close()

    asyncio.run(go())
    return {}


def enqueue_single(spec: dict[str, Any]) -> dict[str, Any]:
    n = spec["jobs"]

    async def go() -> float:
        conn, q = await _queries(spec)
        await q.enqueue("noop", b"0")
        t = asyncio.get_running_loop().time()
        for i in range(n):
            await q.enqueue("noop", str(i).encode())
        elapsed = asyncio.get_running_loop().time() - t
        await conn.close()
        return elapsed

    return {"rate": n / asyncio.run(go())}


def enqueue_bulk(spec: dict[str, Any]) -> dict[str, Any]:
    n = spec["jobs"]

    async def go() -> float:
        conn, q = await _queries(spec)
        await q.enqueue("noop", b"0")
        t = asyncio.get_running_loop().time()
        await _bulk(q, n)
        elapsed = asyncio.get_running_loop().time() - t
        await conn.close()
        return elapsed

    return {"rate": n / asyncio.run(go())}


def _commands(spec: dict[str, Any]) -> Any:
    os.environ["BENCH_PG_URL"] = spec["url"]

    def commands(procs: int) -> list[list[str]]:
        batch = spec.get("config", {}).get("batch_size", 10)
        argv = [sys.executable, "-m", "pgqueuer_app", str(batch)]
        return [argv for _ in range(procs)]

    return commands


async def _autovac(spec: dict[str, Any], conn: Any) -> None:
    """``pgq autovac``: the autovacuum settings pgqueuer's performance guide recommends."""
    if not spec.get("config", {}).get("autovac"):
        return
    from pgqueuer.adapters.cli.sql_cmd import render_autovac

    await conn.execute(render_autovac(False))


def throughput(spec: dict[str, Any]) -> dict[str, Any]:
    def prefill(n: int) -> float:
        async def go() -> float:
            conn, q = await _queries(spec)
            await _autovac(spec, conn)
            t = asyncio.get_running_loop().time()
            await _bulk(q, n)
            elapsed = asyncio.get_running_loop().time() - t
            await conn.close()
            return elapsed

        return asyncio.run(go())

    return _probe.throughput(spec, prefill, _commands(spec))


def latency(spec: dict[str, Any]) -> dict[str, Any]:
    loop = asyncio.new_event_loop()
    conn, q = loop.run_until_complete(_queries(spec))
    try:
        return _probe.latency(
            spec,
            lambda i: loop.run_until_complete(q.enqueue("noop", str(i).encode())),
            _commands(spec),
        )
    finally:
        loop.run_until_complete(conn.close())
        loop.close()


def produce(spec: dict[str, Any]) -> dict[str, Any]:
    loop = asyncio.new_event_loop()

    def connect() -> Any:
        _conn, q = loop.run_until_complete(_queries(spec))
        return lambda i: loop.run_until_complete(q.enqueue("noop", str(i).encode()))

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
