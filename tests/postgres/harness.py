"""Real ``errands`` processes on a real PostgreSQL: start, signal, fault, check, clean up.

A :class:`PgCluster` owns one fresh schema (from the ``pg_url`` fixture) holding the job
tables and the handlers' ``effects`` table, plus one temporary folder with a stdout and a
stderr file per process. Worker processes connect with their own ``application_name``
(:attr:`PgCluster.tag`), so a test can terminate exactly their sessions and nobody
else's. Every process is killed when the test ends, pass or fail, and on Linux also when
the test process dies (``PR_SET_PDEATHSIG``).

Tests wait on conditions with deadlines (:func:`wait_until`), never on fixed sleeps.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pgacc_support
import psycopg

import errands
from errands.backends.postgres.config import parse_postgres_url
from tests.pg import (  # noqa: F401  (re-exported for the suites)
    pg_base_url,
    wait_pg_ready,
    with_params,
)

APPS_DIR = Path(__file__).resolve().parent / "apps"

# Lost leases are rescued within seconds: App(lease=2) in the apps, and a leader that
# looks for expired leases every 0.2 s. The maintenance leader's own lease is at least
# 5 s (Maintenance.ttl), so when the leader itself dies, a successor takes over within ~5 s.
WORKER_FLAGS = ("--poll-interval", "0.05", "--maintenance-tick", "0.2")
LEADER_TTL = 5.0

_STARTED = re.compile(r"worker (w-[0-9a-f]+) started")

_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: SIGKILL this child if the test process dies (never leave workers behind)."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def wait_until(
    predicate: Callable[[], Any],
    timeout: float,
    what: str,
    *,
    interval: float = 0.05,
    describe: Callable[[], str] | None = None,
) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            extra = f"\n{describe()}" if describe else ""
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}{extra}")
        time.sleep(interval)


# -- processes ------------------------------------------------------------------------------
@dataclass(eq=False)
class Proc:
    """One ``python -m errands ...`` process with its output in files."""

    label: str
    args: list[str]
    popen: subprocess.Popen[bytes]
    stdout_path: Path
    stderr_path: Path
    _files: list[IO[bytes]] = field(default_factory=list, repr=False)
    worker_id: str | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.label} (pid {self.pid}) still runs {timeout:g} s later\n"
                f"--- its stderr ---\n{self.stderr()[-4000:]}"
            ) from None

    def wait_log(self, pattern: str, timeout: float, *, count: int = 1) -> str:
        """Wait until ``pattern`` (a regex) occurs ``count`` times in this process's stderr."""
        regex = re.compile(pattern)

        def seen() -> str | None:
            text = self.stderr()
            if len(regex.findall(text)) >= count:
                return text
            if not self.alive and len(regex.findall(self.stderr())) < count:
                raise AssertionError(
                    f"{self.label} exited with {self.returncode} before logging {pattern!r}\n"
                    f"--- its stderr ---\n{text[-4000:]}"
                )
            return None

        return str(
            wait_until(
                seen,
                timeout,
                f"{pattern!r} in the stderr of {self.label}",
                describe=lambda: self.stderr()[-4000:],
            )
        )

    def kill(self) -> None:
        """SIGKILL (resuming it first if it was stopped) and reap."""
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGCONT)
                self.popen.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)

    def close(self) -> None:
        for f in self._files:
            f.close()
        self._files.clear()


@dataclass
class CliResult:
    args: list[str]
    code: int
    stdout: str
    stderr: str

    def __str__(self) -> str:
        return (
            f"$ errands {' '.join(self.args)}\nexit {self.code}\n"
            f"--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}"
        )


class PgCluster:
    """One schema on the test PostgreSQL, and the worker and CLI processes around it."""

    def __init__(self, folder: Path, url: str) -> None:
        self.folder = folder
        self.url = url  # the pg_url fixture's: fresh schema, auto_migrate=true
        self.config = parse_postgres_url(url)
        self.schema = self.config.schema
        self.tag = f"errands_pgacc_{self.schema}"  # application_name of the workers
        # Small pools: several workers plus the test stay far below max_connections.
        self.worker_url = with_params(url, pool_size="5", application_name=self.tag)
        pgacc_support.create(url)
        self.procs: list[Proc] = []
        self._counter = 0
        self._apps: list[errands.App] = []
        self._conn: psycopg.Connection[Any] | None = None

    def app(self, module: str = "pgacc_basic") -> errands.App:
        """The test process's handle on an app module's ``app``, pointed at this schema
        (whose tables it creates on first use: auto_migrate)."""
        application = importlib.import_module(module).app
        assert isinstance(application, errands.App)
        application.close()
        application.url = self.url
        self._apps.append(application)
        return application

    # -- processes -------------------------------------------------------------------
    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ERRANDS_")}
        env.update(
            ERRANDS_URL=self.worker_url,
            PYTHONPATH=os.pathsep.join(p for p in [str(APPS_DIR), env.get("PYTHONPATH", "")] if p),
            PYTHONUNBUFFERED="1",
            PYTHONDONTWRITEBYTECODE="1",
            COLUMNS="200",
        )
        env.update(extra)
        return env

    def spawn(self, args: Sequence[str], label: str | None = None, **env: str) -> Proc:
        self._counter += 1
        label = label or f"proc{self._counter}"
        stem = f"{self._counter:02d}-{label}"
        out_path = self.folder / f"{stem}.stdout"
        err_path = self.folder / f"{stem}.stderr"
        out, err = out_path.open("wb"), err_path.open("wb")
        popen = subprocess.Popen(
            [sys.executable, "-m", "errands", *args],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            cwd=self.folder,
            env=self.env(**env),
            preexec_fn=_die_with_parent,
        )
        proc = Proc(label, list(args), popen, out_path, err_path, [out, err])
        self.procs.append(proc)
        return proc

    def start_worker(
        self,
        *options: str,
        app: str = "pgacc_basic:app",
        label: str = "worker",
        ready: bool = True,
        flags: Sequence[str] = WORKER_FLAGS,
        **env: str,
    ) -> Proc:
        """``errands worker APP --poll-interval 0.05 --maintenance-tick 0.2 *options``;
        with ``ready`` wait until it logs that it started (and note its worker id)."""
        proc = self.spawn(["worker", app, *flags, *options], label, **env)
        if ready:
            self.wait_started(proc)
        return proc

    def wait_started(self, proc: Proc, timeout: float = 30) -> str:
        text = proc.wait_log(_STARTED.pattern, timeout=timeout)
        match = _STARTED.search(text)
        assert match is not None
        proc.worker_id = match.group(1)
        return proc.worker_id

    def cli(self, *args: str, timeout: float = 60, **env: str) -> CliResult:
        """Run one CLI command to completion and capture its output."""
        done = subprocess.run(
            [sys.executable, "-m", "errands", *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            cwd=self.folder,
            env=self.env(**env),
            timeout=timeout,
            preexec_fn=_die_with_parent,
        )
        return CliResult(
            list(args),
            done.returncode,
            done.stdout.decode(errors="replace"),
            done.stderr.decode(errors="replace"),
        )

    def stop_all(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.close()
        for application in self._apps:
            with contextlib.suppress(Exception):
                application.close()
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None

    def report(self, tail: int = 150) -> str:
        """Every process's command, exit code and the tail of its stderr (for failures)."""
        parts = []
        for proc in self.procs:
            lines = proc.stderr().splitlines()
            shown = "\n".join(lines[-tail:])
            parts.append(
                f"=== {proc.label} pid {proc.pid} exit {proc.returncode}: "
                f"errands {' '.join(proc.args)}\n{shown}"
            )
        return "\n".join(parts) or "(no processes started)"

    # -- the database -------------------------------------------------------------------
    def query(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[tuple[Any, ...]]:
        """Run one statement; ``{s}`` in it is this test's (quoted) schema. Reconnects
        once when the server went away under the cached connection (restart tests)."""
        text = sql.replace("{s}", f'"{self.schema}"')
        for tries_left in (1, 0):
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = psycopg.connect(self.config.conninfo, autocommit=True)
                cur = self._conn.execute(text.encode(), params)
                return cur.fetchall() if cur.description else []
            except psycopg.OperationalError:
                if self._conn is not None:
                    self._conn.close()
                self._conn = None
                if not tries_left:
                    raise
        raise AssertionError("unreachable")

    def db_now(self) -> float:
        return float(self.query("SELECT extract(epoch FROM clock_timestamp())::float8")[0][0])

    def states(self) -> Counter[str]:
        return Counter(
            {s: n for s, n in self.query("SELECT state, count(*) FROM {s}.errands_jobs GROUP BY 1")}
        )

    def state_of(self, job_id: int) -> str | None:
        rows = self.query("SELECT state FROM {s}.errands_jobs WHERE id = %s", (job_id,))
        return rows[0][0] if rows else None

    def errors_of(self, job_id: int) -> list[dict[str, Any]]:
        (raw,) = self.query("SELECT errors FROM {s}.errands_jobs WHERE id = %s", (job_id,))[0]
        return list(raw)

    def result_of(self, job_id: int) -> Any:
        return self.query("SELECT result FROM {s}.errands_jobs WHERE id = %s", (job_id,))[0][0]

    def leader(self) -> str | None:
        rows = self.query(
            "SELECT owner FROM {s}.errands_leaders WHERE name = 'maintenance' "
            "AND expires_at > now()"
        )
        return rows[0][0] if rows else None

    def effects(self, job_id: int | None = None) -> list[tuple[int, int, int, str]]:
        """(job_id, attempt, pid, worker) of every recorded execution, in order."""
        if job_id is None:
            return [
                tuple(r)  # type: ignore[misc]
                for r in self.query(
                    "SELECT job_id, attempt, pid, worker FROM {s}.effects ORDER BY id"
                )
            ]
        return [
            tuple(r)  # type: ignore[misc]
            for r in self.query(
                "SELECT job_id, attempt, pid, worker FROM {s}.effects WHERE job_id = %s "
                "ORDER BY id",
                (job_id,),
            )
        ]

    def effect_count(self) -> int:
        return int(self.query("SELECT count(*) FROM {s}.effects")[0][0])

    def terminate_backends(self) -> int:
        """``pg_terminate_backend`` every session of this test's workers (their pools and
        LISTEN connections: application_name = :attr:`tag`), in this database only."""
        rows = self.query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND application_name = %s",
            (self.tag,),
        )
        return sum(1 for (ok,) in rows if ok)

    # -- invariants -----------------------------------------------------------------------
    def check_accounted(self, job_ids: Sequence[int]) -> dict[str, int]:
        """Every job completed (I1) with executions accounted for (I4); returns figures.

        An execution is one ``effects`` row. Rows of attempts that *failed* (the handler
        raised, e.g. its effect write hit the restarting server) are explained by that
        recorded error; every other row must be the completing attempt or be matched by a
        recorded lease loss or release: rows ≤ 1 + WorkerLost + released entries. The
        completing attempt itself ran exactly once, or once more for each release of its
        attempt number (a release does not charge the attempt: the next run reuses it).
        """
        wanted = set(job_ids)
        jobs = {
            job_id: (state, attempt, errors)
            for job_id, state, attempt, errors in self.query(
                "SELECT id, state, attempt, errors FROM {s}.errands_jobs"
            )
            if job_id in wanted
        }
        missing = wanted - set(jobs)
        assert not missing, f"{len(missing)} job(s) lost: {sorted(missing)[:20]}"
        not_done = {j: s for j, (s, _, _) in jobs.items() if s != "completed"}
        assert not not_done, (
            f"{len(not_done)} job(s) not completed: {dict(list(not_done.items())[:20])}"
        )
        runs: dict[int, list[int]] = {}
        for job_id, attempt, _pid, _worker in self.effects():
            runs.setdefault(job_id, []).append(attempt)
        figures = Counter[str]()
        problems = []
        for job_id, (_state, final_attempt, errors) in jobs.items():
            attempts = runs.get(job_id, [])
            lost = sum(1 for e in errors if e.get("type") == "WorkerLost")
            # A release (graceful stop, self-fencing) gives the attempt back uncharged:
            # the next run reuses its number.
            released = Counter(e.get("attempt") for e in errors if e.get("kind") == "released")
            failed = {
                e["attempt"]
                for e in errors
                if e.get("type") != "WorkerLost" and e.get("kind") != "released"
            }
            counted = [a for a in attempts if a not in failed]
            if not 1 <= attempts.count(final_attempt) <= 1 + released[final_attempt]:
                problems.append(
                    f"job {job_id}: its completing attempt {final_attempt} ran "
                    f"{attempts.count(final_attempt)} times (effects {attempts}, errors "
                    f"{brief(errors)})"
                )
            if len(counted) > 1 + lost + released.total():
                problems.append(
                    f"job {job_id}: {len(counted)} unexplained executions, only {lost} lease "
                    f"loss(es) recorded (effects {attempts}, errors {brief(errors)})"
                )
            figures["executions"] += len(attempts)
            figures["duplicates"] += max(0, len(counted) - 1)
            figures["worker_lost"] += lost
            figures["failed_attempts"] += len(failed)
            figures["jobs_with_errors"] += bool(errors)
            for e in errors:
                figures[f"error {e.get('type')}"] += 1
        assert not problems, "\n".join(problems[:20])
        return dict(figures)


def brief(errors: list[dict[str, Any]]) -> str:
    return json.dumps([(e.get("attempt"), e.get("type"), e.get("worker")) for e in errors])
