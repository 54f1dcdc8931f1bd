"""Helpers shared by the bad-input (tests/fuzz) and security (tests/security) tests.

* :func:`run_cli_many` runs many ``python -m errands`` commands at once, each its own
  process (as an operator would run it), and returns their exit codes and output.
* :func:`module_pg_url` yields a URL on a fresh, migrated PostgreSQL schema for a whole
  test module (creating a schema per test would dominate the runtime).
* :func:`raw_request` builds a job row as the backend stores it, bypassing every check
  ``enqueue`` makes: the way to plant corrupted or oversized rows.
"""

from __future__ import annotations

import os
import pty
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import errands
from errands.jobs import EnqueueRequest

T = TypeVar("T")
TERMINAL_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
APPS_DIR = Path(__file__).resolve().parent / "apps"
PASSWORD = "hunter2-Sw0rdfish"  # planted in URLs: it must never be printed
INJECTIONS = (
    "'; DROP TABLE errands_jobs; --",
    '" OR 1=1 --',
    "' OR '1'='1",
    "%s",
    "%(x)s",
    "{schema}",
    "{0}",
    "\\",
    "default' --",
    "x" * 5000,
)
"""Strings that break SQL built by formatting. Every one must be bound, never spliced in.
(``\\x00`` is checked separately: neither a command line nor PostgreSQL text can hold it.)"""


@dataclass
class CliResult:
    args: Sequence[str | bytes]
    code: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.lower().startswith("error:")]

    def __repr__(self) -> str:
        return (
            f"errands {' '.join(map(repr, self.args))} -> exit {self.code}\n"
            f"--- stdout\n{self.stdout}--- stderr\n{self.stderr}"
        )


def cli_env(url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ERRANDS_")}
    env.update(
        ERRANDS_URL=url,
        PYTHONPATH=os.pathsep.join(p for p in [str(APPS_DIR), env.get("PYTHONPATH", "")] if p),
        PYTHONDONTWRITEBYTECODE="1",
        COLUMNS="200",
    )
    env.update(extra)
    return env


def run_cli(
    args: Sequence[str | bytes], env: dict[str, str], cwd: Path, timeout: float = 60
) -> CliResult:
    done = subprocess.run(
        [sys.executable, "-m", "errands", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
    )
    return CliResult(
        args,
        done.returncode,
        done.stdout.decode(errors="replace"),
        done.stderr.decode(errors="replace"),
    )


def run_cli_on_terminal(
    args: Sequence[str], env: dict[str, str], cwd: Path, timeout: float = 60
) -> CliResult:
    """:func:`run_cli` with stdout and stderr on a pseudo-terminal, as at a shell: what the
    terminal showed is ``stdout`` (colours and other escapes removed), ``stderr`` is empty."""
    master, slave = pty.openpty()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "errands", *args],
            stdin=subprocess.DEVNULL,
            stdout=slave,
            stderr=slave,
            cwd=cwd,
            env={"TERM": "xterm", "LINES": "50", **env},
        )
    finally:
        os.close(slave)
    chunks = []
    try:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the process closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
    code = process.wait(timeout=timeout)
    shown = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
    return CliResult(args, code, TERMINAL_ESCAPE.sub("", shown), "")


def run_cli_many(
    commands: dict[str, Sequence[str | bytes]], env: dict[str, str], cwd: Path
) -> dict[str, CliResult]:
    """Run every command at once (each is mostly interpreter start-up); results by key."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = {key: pool.submit(run_cli, args, env, cwd) for key, args in commands.items()}
        return {key: future.result() for key, future in futures.items()}


def closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def module_pg_url() -> Iterator[str]:
    """A URL on a fresh PostgreSQL schema, migrated on first use; dropped afterwards."""
    from tests.pg import fresh_pg_url

    yield from fresh_pg_url()


def raw_request(
    name: str, args_json: str, *, queue: str = "default", max_attempts: int = 1, **meta: object
) -> EnqueueRequest:
    return EnqueueRequest(
        name=name,
        queue=queue,
        args_json=args_json,
        priority=0,
        max_attempts=max_attempts,
        delay=0.0,
        run_at=None,
        key=None,
        timeout=None,
        lease_seconds=None,
        meta=dict(meta),
    )


def insert_raw(app: errands.App, *requests: EnqueueRequest) -> list[int]:
    """Store rows exactly as given, through the backend (no validation on the way)."""
    return [r.id for r in app.backend.job_insert_many(list(requests))]


def job_count(app: errands.App) -> int:
    return sum(sum(s.counts.values()) for s in app.queue_stats())


def wait_until(predicate: Callable[[], T], timeout: float = 20.0, what: str = "") -> T:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout:g} s waiting for {what} (last: {value!r})"
            )
        time.sleep(0.02)
