"""The soak's worker processes, their proxies, and the PostgreSQL server they share.

A :class:`Cluster` keeps ``workers`` slots; each slot runs one real ``errands worker``
process at a time (restarted when it dies), on PostgreSQL behind the slot's own
:class:`~tests.soak.proxy.FaultProxy`. Every process is killed when the run ends, pass
or fail, and on Linux also when the test process dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .proxy import FaultProxy, ProxyLoop
from .store import Store

APPS_DIR = Path(__file__).resolve().parent / "apps"
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
PR_SET_PDEATHSIG = 1

# Lines of the workers' stderr the report counts (warning level and above).
LOG_PATTERNS = {
    "stale writes rejected": re.compile(r"stale write rejected"),
    "leases lost (seen by heartbeat)": re.compile(r"lease of job \d+ \(attempt \d+\) is lost"),
    "self-fenced handlers": re.compile(r"cannot renew the lease of job"),
    "failed heartbeats": re.compile(r"heartbeat failed"),
    "failed claims": re.compile(r"claim failed"),
    "failed outcome writes": re.compile(r"could not record \d+ outcome"),
    "claims paused for unwritten outcomes": re.compile(r"outcome\(s\) wait to be written"),
    "maintenance errors": re.compile(r"maintenance tick failed"),
    "fault points fired": re.compile(r"^errands fault point ", re.M),
    "tracebacks": re.compile(r"^Traceback", re.M),
}


# A worker that dies while starting (before it claims) on a transient database error: a
# traceback through Worker.run's set-up calls ending in a connection or lock error (a
# violation: Worker._at_startup retries those).
STARTUP_DB_ERROR = re.compile(
    r"in run\n\s+self\.(?:_at_startup|_declare|_refresh_settings|app\.backend\.schema_check)\(.*"
    r"(?:OperationalError|AdminShutdown|DatabaseBusy|database is locked)",
    re.S,
)


def _tail(proc: Proc, lines: int = 12) -> str:
    tail = " | ".join(proc.stderr().strip().splitlines()[-lines:])
    return f"{proc.label} pid {proc.pid} exit {proc.popen.returncode}: {tail}"


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def with_query(url: str, **params: str) -> str:
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    query.update(params)
    return urlunsplit(parts._replace(query=urlencode(query)))


def with_port(url: str, port: int) -> str:
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    user = f"{parts.username}@" if parts.username else ""
    return urlunsplit(parts._replace(netloc=f"{user}{host}:{port}"))


@dataclass(eq=False)
class Proc:
    label: str
    popen: subprocess.Popen[bytes]
    stderr_path: Path
    files: list[IO[bytes]] = field(default_factory=list)
    worker_id: str | None = None
    stopped: bool = False  # SIGSTOPped by the driver
    expected_exit: bool = False  # the driver killed it

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.popen.send_signal(sig)

    def kill(self, dump_stacks: bool = False) -> None:
        """SIGKILL the worker; with ``dump_stacks`` (a worker that did not stop in time)
        SIGABRT it first, so Python's faulthandler (PYTHONFAULTHANDLER, set for every
        worker) writes every thread's stack to its stderr file: where the stop hung."""
        for sig, wait in [(signal.SIGABRT, 5.0)] * dump_stacks + [(signal.SIGKILL, 10.0)]:
            if self.alive:
                self.signal(signal.SIGCONT)
                self.signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=wait)
        self.close()

    def close(self) -> None:
        for f in self.files:
            f.close()
        self.files.clear()


@dataclass(eq=False)
class Slot:
    index: int
    proxy: FaultProxy | None = None
    proc: Proc | None = None
    spawned: int = 0


class Cluster:
    def __init__(
        self,
        folder: Path,
        store: Store,
        *,
        workers: int = 3,
        concurrency: int = 8,
        poll_interval: float = 0.05,
        maintenance_tick: float = 0.2,
        lease: float = 2.0,
        fault_points: str = "",
    ) -> None:
        self.folder = folder
        self.store = store
        self.sqlite = store.sqlite
        self.concurrency = concurrency
        self.poll_interval = poll_interval
        self.maintenance_tick = maintenance_tick
        self.lease = lease
        self.fault_points = fault_points
        self.tag = "" if self.sqlite else f"errands_soak_{store.schema}"
        self.proxies: ProxyLoop | None = None
        self.slots = [Slot(i) for i in range(workers)]
        self.procs: list[Proc] = []
        self.exits: Counter[str] = Counter()  # unexpected exits by code
        self.exit_tails: list[str] = []  # the last stderr lines of those processes
        self.refused = 0  # workers that refused to start: the database was away (by design)
        # workers that died starting up on a transient database error, with a traceback
        self.startup_crashes: list[str] = []
        self._count = 0
        if not self.sqlite:
            parts = urlsplit(store.url)
            self.proxies = ProxyLoop()
            for slot in self.slots:
                host = parts.hostname or "127.0.0.1"
                slot.proxy = FaultProxy(self.proxies, host, parts.port or 5432)

    # -- processes -------------------------------------------------------------------------
    def worker_url(self, slot: Slot) -> str:
        if self.sqlite:
            return self.store.url
        assert slot.proxy is not None
        url = with_port(self.store.url, slot.proxy.port)
        return with_query(url, application_name=self.tag, pool_size="6")

    def env(self, slot: Slot) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ERRANDS_", "SOAK_"))}
        env.update(
            ERRANDS_URL=self.worker_url(slot),
            SOAK_EFFECTS_URL=self.store.url,
            SOAK_LEASE=str(self.lease),
            PYTHONPATH=os.pathsep.join(p for p in [str(APPS_DIR), env.get("PYTHONPATH", "")] if p),
            PYTHONUNBUFFERED="1",
            PYTHONDONTWRITEBYTECODE="1",
            PYTHONFAULTHANDLER="1",  # a hung worker's stacks, on the SIGABRT of Proc.kill
        )
        if self.fault_points:
            env["ERRANDS_FAULT_POINTS"] = self.fault_points
        return env

    def spawn(self, slot: Slot) -> Proc:
        self._count += 1
        slot.spawned += 1
        stem = f"{self._count:04d}-worker{slot.index}"
        err_path = self.folder / f"{stem}.stderr"
        out_file, err_file = (self.folder / f"{stem}.stdout").open("wb"), err_path.open("wb")
        argv = [
            sys.executable, "-m", "errands", "worker", "soak_app:app",
            "-c", str(self.concurrency),
            "--poll-interval", str(self.poll_interval),
            "--maintenance-tick", str(self.maintenance_tick),
            "--grace", "5",
            "--log-level", "warning",
        ]  # fmt: skip
        popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out_file,
            stderr=err_file,
            cwd=self.folder,
            env=self.env(slot),
            preexec_fn=_die_with_parent,
        )
        proc = Proc(f"worker{slot.index}", popen, err_path, [out_file, err_file])
        slot.proc = proc
        self.procs.append(proc)
        return proc

    def start(self, timeout: float = 60.0) -> None:
        for slot in self.slots:
            self.spawn(slot)
        for slot in self.slots:
            self.worker_id(slot, timeout)

    def worker_id(self, slot: Slot, timeout: float = 60.0) -> str:
        """The errands worker id of the slot's process (from the registry, by pid)."""
        proc = slot.proc
        assert proc is not None
        if proc.worker_id:
            return proc.worker_id
        deadline = time.monotonic() + timeout
        while True:
            rows = self.store.query("SELECT id FROM {s}errands_workers WHERE pid = %s", (proc.pid,))
            if rows:
                proc.worker_id = str(rows[0][0])
                return proc.worker_id
            if not proc.alive:
                raise AssertionError(
                    f"worker{slot.index} exited with {proc.popen.returncode} before it "
                    f"registered:\n{proc.stderr()[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"worker{slot.index} did not register in {timeout:g} s")
            time.sleep(0.05)

    def supervise(self) -> int:
        """Restart every dead worker; returns how many were restarted."""
        restarted = 0
        for slot in self.slots:
            proc = slot.proc
            if proc is not None and not proc.alive:
                code = proc.popen.returncode
                text = proc.stderr()
                if code == 1 and "error: cannot connect to PostgreSQL" in text:
                    self.refused += 1  # DESIGN §11: one clear line, exit 1; restarted here
                elif code == 1 and STARTUP_DB_ERROR.search(text):
                    self.startup_crashes.append(_tail(proc))
                elif not proc.expected_exit:
                    self.exits[str(code)] += 1
                    if code != 86:  # 86: a fault point's planned crash
                        self.exit_tails.append(_tail(proc))
                proc.close()
                self.spawn(slot)
                restarted += 1
        return restarted

    def live_ids(self) -> dict[str, Slot]:
        """Worker id -> slot, for the slots whose process registered."""
        found = {}
        for slot in self.slots:
            if slot.proc is not None and slot.proc.alive:
                with contextlib.suppress(AssertionError):
                    found[self.worker_id(slot, timeout=20)] = slot
        return found

    def sigkill(self, slot: Slot) -> None:
        proc = slot.proc
        assert proc is not None
        proc.expected_exit = True
        proc.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=10)

    def stop(self, slot: Slot, timeout: float) -> int | None:
        """SIGTERM the slot's worker (a graceful stop) and wait for it to exit; its exit
        code (None: still alive after ``timeout``, then killed)."""
        proc = slot.proc
        assert proc is not None
        proc.expected_exit = True
        proc.signal(signal.SIGTERM)
        try:
            return proc.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill(dump_stacks=True)
            return None
        finally:
            proc.close()

    def sigstop(self, slot: Slot) -> None:
        assert slot.proc is not None
        slot.proc.stopped = True
        slot.proc.signal(signal.SIGSTOP)

    def sigcont(self, slot: Slot) -> None:
        assert slot.proc is not None
        slot.proc.signal(signal.SIGCONT)
        slot.proc.stopped = False

    def terminate_backends(self) -> int:
        """``pg_terminate_backend`` every session of the soak's workers (their errands
        pools and LISTEN connections: application_name = :attr:`tag`) — nobody else's."""
        rows = self.store.query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND application_name = %s",
            (self.tag,),
        )
        return sum(1 for (ok,) in rows if ok)

    def stop_all(self, graceful: bool) -> dict[str, int | None]:
        """SIGTERM (or SIGKILL) every worker; returns exit codes by label.

        A worker the last supervision round restarted may still be starting Python, before
        errands' signal handlers exist: SIGTERMed then it died of the signal (exit -15,
        judged an unclean stop). Each is signalled once it has registered (handlers first)."""
        codes: dict[str, int | None] = {}
        if graceful:
            for slot in self.slots:
                if slot.proc is not None and slot.proc.alive:
                    with contextlib.suppress(AssertionError):  # judged by its exit code
                        self.worker_id(slot, timeout=30)
        live = [s.proc for s in self.slots if s.proc is not None and s.proc.alive]
        for proc in live:
            proc.signal(signal.SIGCONT)
            proc.signal(signal.SIGTERM if graceful else signal.SIGKILL)
        for proc in live:
            try:
                codes[proc.label] = proc.popen.wait(timeout=60)  # grace 5 s, hooks 5 s, load
            except subprocess.TimeoutExpired:
                codes[proc.label] = None
                proc.kill(dump_stacks=True)
        return codes

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
        for slot in self.slots:
            if slot.proxy is not None:
                slot.proxy.close()
        if self.proxies is not None:
            self.proxies.close()

    # -- logs --------------------------------------------------------------------------------
    def log_counts(self) -> Counter[str]:
        counts: Counter[str] = Counter()
        for proc in self.procs:
            text = proc.stderr()
            for label, pattern in LOG_PATTERNS.items():
                counts[label] += len(pattern.findall(text))
        return counts

    def log_tail(self, lines: int = 40) -> str:
        parts = []
        for proc in self.procs[-6:]:
            tail = "\n".join(proc.stderr().splitlines()[-lines:])
            parts.append(f"=== {proc.label} pid {proc.pid} exit {proc.popen.poll()}\n{tail}")
        return "\n".join(parts)
