"""Real ``errands`` processes for the acceptance tests: start, signal, watch, clean up.

A :class:`Cluster` owns one temporary folder: the job store (a real SQLite file), the
effects file the handlers append to, and one stderr/stdout file per process. Every
process it starts is killed when the test ends, pass or fail (the ``cluster`` fixture),
and on Linux also when the test process itself dies (``PR_SET_PDEATHSIG``).

Tests wait on conditions with deadlines (:func:`wait_until` polls the database or a log
file), never on fixed sleeps.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import acc_support

import errands

APPS_DIR = Path(__file__).resolve().parent / "apps"

# Fast enough that lost leases are rescued within seconds; see App(lease=2) in the apps.
WORKER_FLAGS = ("--poll-interval", "0.05", "--maintenance-tick", "0.2")

_STARTED = re.compile(r"worker (w-[0-9a-f]+) started")


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: SIGKILL this child if the test process dies (never leave workers behind).
    SIGHUP back to its default action, as under a terminal: a test run started with
    nohup (SIGHUP ignored, inherited) ran every child with it ignored, and a worker keeps
    an ignored SIGHUP ignored (the hangup tests then saw nothing happen)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
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


def _children() -> dict[int, list[int]]:
    """Live processes by parent pid (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            stat = entry.read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        children.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    return children


def children_of(pid: int) -> list[int]:
    """The live processes ``pid`` started itself (not theirs: a worker's own children)."""
    return _children().get(pid, [])


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc; empty elsewhere)."""
    children = _children()
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def pid_running(pid: int) -> bool:
    """Whether ``pid`` is a live process (an exited one not yet reaped is not, once all
    its threads have exited: a killed process's main thread is a zombie while the others,
    which hold its open files, may still be on their way out)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        threads = len(os.listdir(f"/proc/{pid}/task"))
    except (FileNotFoundError, ProcessLookupError):  # (gone between the open and the read)
        return False
    return "\nState:\tZ" not in status or threads > 1


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
            found = regex.findall(text)
            if len(found) >= count:
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
        """SIGKILL it and its descendants (resuming it first if it was stopped) and reap."""
        if self.alive:
            for pid in descendants(self.pid):  # e.g. the children of --processes N
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
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

    def json(self) -> Any:
        return json.loads(self.stdout)

    def __str__(self) -> str:
        return (
            f"$ errands {' '.join(self.args)}\nexit {self.code}\n"
            f"--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}"
        )


class Cluster:
    """A job store on a real SQLite file, and the worker and CLI processes around it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.db_path = folder / "errands.db"
        self.url = f"sqlite:///{self.db_path}"
        self.effects_path = folder / "effects.db"
        acc_support.create(str(self.effects_path))
        self.procs: list[Proc] = []
        self._counter = 0
        self._apps: list[errands.App] = []

    def effects_in_store(self) -> None:
        """Write the effects table into the job store's own file (before starting workers):
        the handlers' writes then compete with errands' own for the one SQLite lock."""
        self.effects_path = self.db_path
        acc_support.create(str(self.effects_path))

    def app(self, module: str = "acc_basic") -> errands.App:
        """The test process's handle on an app module's ``app``, pointed at this store.

        Workers import the same module (job names are explicit), so a job enqueued here
        runs there. Opening the store here also creates its schema.
        """
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
            ERRANDS_URL=self.url,
            ERRANDS_TEST_EFFECTS=str(self.effects_path),
            PYTHONPATH=os.pathsep.join(p for p in [str(APPS_DIR), env.get("PYTHONPATH", "")] if p),
            PYTHONUNBUFFERED="1",
            PYTHONDONTWRITEBYTECODE="1",
            COLUMNS="200",
        )
        env.update(extra)
        return env

    def spawn(
        self,
        args: Sequence[str],
        label: str | None = None,
        env: dict[str, str] | None = None,
        *,
        own_group: bool = False,
    ) -> Proc:
        """``errands *args``; with ``own_group``, in a process group of its own (a terminal's
        foreground group, which its Ctrl-C reaches as a whole)."""
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
            env=self.env(**(env or {})),
            preexec_fn=_die_with_parent,
            process_group=0 if own_group else None,
        )
        proc = Proc(label, list(args), popen, out_path, err_path, [out, err])
        self.procs.append(proc)
        return proc

    def start_worker(
        self,
        *options: str,
        app: str = "acc_basic:app",
        label: str = "worker",
        ready: bool = True,
        leader: bool = False,
        env: dict[str, str] | None = None,
    ) -> Proc:
        """``errands worker APP --poll-interval 0.05 --maintenance-tick 0.2 *options``.

        With ``ready`` wait until it logs that it started (and learn its worker id), so
        the test knows it claims from now on; with ``leader`` also until the leaders table
        names it the maintenance leader.
        """
        proc = self.spawn(["worker", app, *WORKER_FLAGS, *options], label, env)
        if ready:
            text = proc.wait_log(_STARTED.pattern, timeout=60)
            match = _STARTED.search(text)
            proc.worker_id = match.group(1) if match else None
        if leader:
            wait_until(
                lambda: self.leader() == proc.worker_id,
                20,
                f"{label} to become the maintenance leader",
                describe=lambda: f"leaders: {self.query('SELECT * FROM errands_leaders')}",
            )
        return proc

    def cli(self, *args: str, timeout: float = 30) -> CliResult:
        """Run one CLI command to completion and capture its output."""
        done = subprocess.run(
            [sys.executable, "-m", "errands", *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            cwd=self.folder,
            env=self.env(),
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
            application.close()

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

    # -- the store ---------------------------------------------------------------------
    @contextlib.contextmanager
    def _connect(self, path: Path) -> Iterator[sqlite3.Connection]:
        conn = sqlite3.connect(path, timeout=30)
        try:
            yield conn
        finally:
            conn.close()

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._connect(self.db_path) as conn:
            return conn.execute(sql, params).fetchall()

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """One write statement on the store (TEST-ONLY time warps); returns the rowcount."""
        with self._connect(self.db_path) as conn:
            count = conn.execute(sql, params).rowcount
            conn.commit()
            return int(count)

    def leader(self) -> str | None:
        """The worker id holding the maintenance leadership (while its lease is valid)."""
        rows = self.query(
            "SELECT owner FROM errands_leaders WHERE name = 'maintenance' "
            "AND expires_at > (julianday('now') - 2440587.5) * 86400.0"
        )
        return rows[0][0] if rows else None

    def states(self) -> Counter[str]:
        return Counter(dict(self.query("SELECT state, count(*) FROM errands_jobs GROUP BY state")))

    def state_of(self, job_id: int) -> str | None:
        rows = self.query("SELECT state FROM errands_jobs WHERE id = ?", (job_id,))
        return rows[0][0] if rows else None

    def effects(self, job_id: int | None = None) -> list[tuple[int, int, int, str]]:
        """(job_id, attempt, pid, worker) for every recorded execution, in order."""
        sql = "SELECT job_id, attempt, pid, worker FROM effects WHERE kind = 'run'"
        params: tuple[Any, ...] = ()
        if job_id is not None:
            sql += " AND job_id = ?"
            params = (job_id,)
        with self._connect(self.effects_path) as conn:
            return conn.execute(sql + " ORDER BY id", params).fetchall()

    def executions(self) -> Counter[int]:
        return Counter(job_id for job_id, *_ in self.effects())

    def integrity(self) -> str:
        return str(self.query("PRAGMA integrity_check")[0][0])
