"""What the benchmark ran on: cores, memory, CPU, and the versions of everything."""

from __future__ import annotations

import os
import platform
import socket
import sqlite3
import sys
from typing import Any


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return None


def redis_version(url: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379), 3) as s:
            s.sendall(b"INFO server\r\n")
            data = b""
            while b"redis_version" not in data or not data.endswith(b"\r\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
                if len(data) > 200_000:
                    break
        for line in data.decode(errors="replace").splitlines():
            if line.startswith("redis_version:"):
                return line.split(":", 1)[1].strip()
    except OSError as exc:
        return f"unreachable ({exc})"
    return "?"


def postgres_version(url: str) -> str:
    try:
        import psycopg

        with psycopg.connect(url, connect_timeout=5) as conn:
            row = conn.execute("SHOW server_version").fetchone()
            return str(row[0]) if row else "?"
    except Exception as exc:
        return f"unreachable ({exc})"


# The server settings that move these figures; each with where it was set.
PG_SETTINGS = ("autovacuum", "fsync", "synchronous_commit", "shared_buffers", "max_wal_size")


def postgres_settings(url: str) -> dict[str, str]:
    """PG_SETTINGS as the server runs them: value (and unit), and the file that set one
    away from its default (this machine's server runs with autovacuum off: every system
    is measured alike, and the harness ANALYZEs after each prefill)."""
    try:
        import psycopg

        with psycopg.connect(url, connect_timeout=5) as conn:
            rows = conn.execute(
                "SELECT name, current_setting(name), source, sourcefile FROM pg_settings "
                "WHERE name = ANY(%s)",
                (list(PG_SETTINGS),),
            ).fetchall()
    except Exception:
        return {}
    out = {}
    for name, setting, source, sourcefile in rows:
        value = str(setting)
        if source != "default":
            value += f" (set in {sourcefile or source})"
        out[str(name)] = value
    return out


def cpu_times() -> list[int]:
    """The machine's CPU time counters (/proc/stat, first line): user nice system idle
    iowait irq softirq steal."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return []


def cpu_share(before: list[int], after: list[int]) -> dict[str, float]:
    """Between two :func:`cpu_times`: the share of CPU time busy, in iowait and stolen by
    the hypervisor (steal: another guest had our core; figures taken then are low)."""
    if len(before) < 8 or len(after) < 8:
        return {}
    d = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(d)
    if total <= 0:
        return {}
    idle = d[3] + d[4]
    return {"busy": (total - idle) / total, "iowait": d[4] / total, "steal": d[7] / total}


def describe(pg_url: str, redis_url: str) -> dict[str, Any]:
    return {
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "cpu": _cpu_model(),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "postgresql": postgres_version(pg_url),
        "postgresql_settings": postgres_settings(pg_url),
        "sqlite": sqlite3.sqlite_version,
        "redis": redis_version(redis_url),
    }
