"""Real ``errands worker`` processes of ``effects_app`` under a supervisor loop."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tests.acceptance.harness import Proc, _die_with_parent

HERE = Path(__file__).resolve().parent
APPS_DIR = HERE / "apps"
T = TypeVar("T")

# -- real worker processes under a supervisor ----------------------------------------------
WORKER_FLAGS = ("--poll-interval", "0.05", "--maintenance-tick", "0.2")
FAULT_LINE = "errands fault point "
LEADER = ("-q", "idle", "--log-level", "info")


class Storm:
    """Worker processes of ``effects_app:app`` that a supervisor loop keeps alive.

    One extra worker serves only an idle queue and is never killed: it holds the
    maintenance leadership, so rescues of the killed workers' jobs never wait for a new
    leader's election (leader loss is RELIABILITY F17's subject, tested elsewhere).
    """

    def __init__(self, folder: Path, store_url: str, effects_url: str, faults: str = "") -> None:
        self.folder = folder
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("ERRANDS_")}
        self.env.update(
            ERRANDS_URL=store_url,
            EFFECTS_URL=effects_url,
            PYTHONPATH=os.pathsep.join(
                p for p in [str(APPS_DIR), str(HERE.parents[1]), self.env.get("PYTHONPATH")] if p
            ),
            PYTHONUNBUFFERED="1",
        )
        self.faults = faults
        self.procs: list[Proc] = []
        self.exits: Counter[int] = Counter()
        self.kills = 0
        self._count = 0

    def spawn(self, *args: str, faults: bool = True, label: str = "worker") -> Proc:
        self._count += 1
        stem = f"{self._count:03d}-{label}"
        out, err = self.folder / f"{stem}.out", self.folder / f"{stem}.err"
        env = dict(self.env)
        if faults and self.faults:
            env["ERRANDS_FAULT_POINTS"] = self.faults
            tickets = self.folder / "fault-tickets"  # for points armed with a crash budget
            tickets.mkdir(exist_ok=True)
            env["ERRANDS_FAULT_DIR"] = str(tickets)
        argv = ["worker", "effects_app:app", *WORKER_FLAGS, *args]
        out_file, err_file = out.open("wb"), err.open("wb")
        popen = subprocess.Popen(
            [sys.executable, "-m", "errands", *argv],
            stdin=subprocess.DEVNULL,
            stdout=out_file,
            stderr=err_file,
            cwd=self.folder,
            env=env,
            preexec_fn=_die_with_parent,
        )
        proc = Proc(label, argv, popen, out, err, [out_file, err_file])
        self.procs.append(proc)
        return proc

    def run(
        self,
        done: Callable[[], bool],
        *,
        workers: int = 2,
        concurrency: int = 8,
        kill_every: tuple[float, float] | None = None,
        max_kills: int = 12,
        timeout: float = 240.0,
        describe: Callable[[], str] = lambda: "",
    ) -> None:
        """Keep ``workers`` job workers alive (restarting the dead), SIGKILL a random one
        every ``kill_every`` seconds, ``max_kills`` times at most, until ``done()``; fail
        after ``timeout`` s. The kills are counted, not timed: on a loaded machine a worker
        may need seconds to start, and a storm paced by the clock alone would kill each
        one before it ran anything (the jobs would never finish)."""
        leader = self._start_leader()
        job_worker = ("-c", str(concurrency), "--no-maintenance", "--log-level", "warning")
        slots: list[Proc] = [self.spawn(*job_worker) for _ in range(workers)]
        deadline = time.monotonic() + timeout
        next_kill = time.monotonic() + random.uniform(0.2, 1.0) if kill_every else None
        next_check = 0.0
        while True:
            now = time.monotonic()
            if now >= next_check:
                if _quietly(done):
                    break
                next_check = now + 0.25
            if now >= deadline:
                raise AssertionError(
                    f"the storm did not finish within {timeout:g} s ({self.kills} kills, exits "
                    f"{dict(self.exits)})\n{describe()}\n{self.report()}"
                )
            if not leader.alive:  # never killed by us: the database restarted under it
                self.exits[leader.returncode or 0] += 1
                leader.close()
                leader = self.spawn(*LEADER, faults=False, label="leader")
            for i, proc in enumerate(slots):
                if not proc.alive:
                    self.exits[proc.returncode or 0] += 1
                    proc.close()
                    slots[i] = self.spawn(*job_worker)
            storming = self.kills < max_kills
            if storming and next_kill is not None and kill_every is not None and now >= next_kill:
                victim = random.choice(slots)
                if victim.alive:
                    victim.signal(signal.SIGKILL)
                    self.kills += 1
                next_kill = now + random.uniform(*kill_every)
            time.sleep(0.02)

    def _start_leader(self) -> Proc:
        """The idle-queue worker that holds the maintenance leadership; retried while the
        database is away (another suite's restart test)."""
        for attempt in range(3):
            leader = self.spawn(*LEADER, faults=False, label="leader")
            try:
                leader.wait_log(r"is now the maintenance leader", timeout=60)
                return leader
            except AssertionError:
                if leader.alive or attempt == 2:
                    raise
                if "postgres" in self.env["ERRANDS_URL"]:
                    wait_for_postgres()
        raise AssertionError("unreachable")

    def fault_crashes(self) -> Counter[str]:
        """How many times each fault point crashed a worker (from the workers' stderr)."""
        found: Counter[str] = Counter()
        for proc in self.procs:
            for line in proc.stderr().splitlines():
                if line.startswith(FAULT_LINE):
                    found[line[len(FAULT_LINE) :].split(":", 1)[0]] += 1
        return found

    def report(self, tail: int = 30) -> str:
        parts = []
        for proc in self.procs[-6:]:
            lines = proc.stderr().splitlines()[-tail:]
            parts.append(
                f"=== {proc.label} pid {proc.pid} exit {proc.returncode}\n" + "\n".join(lines)
            )
        return "\n".join(parts)

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.close()


def _quietly(check: Callable[[], bool]) -> bool:
    """A check that fails while the database restarts (another suite's fault test) is
    simply not done yet."""
    try:
        return check()
    except Exception as exc:
        if not is_connection_error(exc):
            raise
        return False


def is_connection_error(exc: BaseException) -> bool:
    return type(exc).__module__.startswith("psycopg") and "Operational" in "".join(
        c.__name__ for c in type(exc).__mro__
    )


def settled(check: Callable[[], T], attempts: int = 3) -> T:
    """Run ``check``; if PostgreSQL restarted under it, wait for the server and run it again."""
    for attempt in range(attempts):
        try:
            return check()
        except Exception as exc:
            if not is_connection_error(exc) or attempt == attempts - 1:
                raise
            wait_for_postgres()
    raise AssertionError("unreachable")


_pg = {"seen": False}
RESTARTING = ("starting up", "shutting down", "not yet accepting", "recovery")


def wait_for_postgres(timeout: float = 120.0) -> None:
    """Another suite may be restarting the server (its fault tests): wait until it accepts
    connections again, rather than skipping or failing. A server that is not there at all
    (refused, never seen in this session) is left to ``tests.pg.require_pg``: skipped
    outside CI, failed in CI."""
    from tests import pg

    try:
        import psycopg
    except ImportError:
        pg.require_pg()
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            psycopg.connect(pg.pg_base_url(), connect_timeout=3).close()
            break
        except psycopg.OperationalError as exc:
            restarting = _pg["seen"] or any(word in str(exc) for word in RESTARTING)
            if not restarting or time.monotonic() >= deadline:
                break
            time.sleep(0.25)
    pg._checked.pop(pg.pg_base_url(), None)  # a restart is not an absent server: ask again
    pg.require_pg()
    _pg["seen"] = True
