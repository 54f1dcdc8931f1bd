"""``errands worker --processes N``: N worker processes under one supervisor.

Each child is a full worker (its own id, pool and leases), started as a fresh interpreter
running the same command without ``--processes``, so nothing is shared by fork. The
supervisor forwards SIGTERM/SIGINT to every child and waits for them (each honours its
own ``--grace``); a second signal is forwarded too, and the children exit at once; a
SIGHUP is forwarded as SIGTERM. The children run in sessions of their own, so that a
terminal's Ctrl-C reaches them once, through the supervisor. A
child that dies on its own (crash, OOM kill) is restarted after a short backoff, so
capacity comes back; its running jobs are rescued after their leases expire. The backoff
starts afresh once a child has run HEALTHY_AFTER seconds. Children that keep failing
before that (a bad option or app, checked only in the child) are given up on after
GIVE_UP_AFTER failures in a row with none running healthily: the supervisor stops the
others and exits 1, so a service manager shows the failure (it restarted them for ever,
"running").
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .signals import STOP_SIGNALS, SignalRelay

if TYPE_CHECKING:
    from .worker import Worker

log = logging.getLogger("errands.supervisor")

RESTART_BACKOFF_MAX = 30.0
HEALTHY_AFTER = 60.0  # seconds a child runs before its exit counts as a fresh failure
GIVE_UP_AFTER = 5  # failures in a row, each before HEALTHY_AFTER, with none healthy
# Set in the environment of each child worker: "<supervisor pid>:<lifeline fd>" (the pid
# alone where there is no pass_fds: Windows).
SUPERVISOR_ENV = "ERRANDS_SUPERVISOR"
SUPERVISOR_WATCH_EVERY = 0.5  # seconds between a child's looks for its supervisor
HANGUP = getattr(signal, "SIGHUP", None)  # POSIX only
HANGUP_SIGNALS = () if HANGUP is None else (HANGUP,)


class Supervisor:
    def __init__(self, command: Sequence[str], processes: int) -> None:
        self.command = list(command)
        self.processes = processes
        self.children: dict[int, subprocess.Popen[bytes]] = {}
        self._stopping = False
        self._restarts: dict[int, int] = {}
        self._started: dict[int, float] = {}  # slot -> when its child started (monotonic)
        self._early_failures = 0  # children that failed before HEALTHY_AFTER, in a row
        # slot -> the write end of its child's lifeline, never written: the child reads
        # EOF once this process is gone, however it went (see supervisor_link)
        self._lifelines: dict[int, int] = {}
        self.gave_up = False
        # Spawning and forwarding a signal take turns: a child started while a signal was
        # forwarded would never get it, and the supervisor would wait for it for ever.
        self._lock = threading.Lock()

    def _spawn(self, slot: int) -> None:
        with self._lock:
            if self._stopping:
                return
            # In a session of its own: a terminal's Ctrl-C (sent to the whole foreground
            # process group) reaches the supervisor only, which forwards it once; sent to
            # the children too, each saw two signals and exited at once, skipping --grace.
            if os.name == "posix":
                read_end, write_end = os.pipe()  # neither inherited but as passed below
                env = {**os.environ, SUPERVISOR_ENV: f"{os.getpid()}:{read_end}"}
                try:
                    child = subprocess.Popen(
                        self.command, start_new_session=True, env=env, pass_fds=(read_end,)
                    )
                except BaseException:
                    os.close(write_end)
                    raise
                finally:
                    os.close(read_end)
                previous = self._lifelines.pop(slot, None)
                if previous is not None:
                    os.close(previous)
                self._lifelines[slot] = write_end
            else:
                env = {**os.environ, SUPERVISOR_ENV: str(os.getpid())}
                child = subprocess.Popen(self.command, start_new_session=True, env=env)
            self.children[slot] = child
            self._started[slot] = time.monotonic()
        log.info("started worker process %d (pid %d)", slot, child.pid)

    def _on_signal(self, signum: int, count: int) -> None:
        """A SIGTERM or SIGINT, on the signal relay's thread (errands.worker.signals):
        forwarded to every child (each stops gracefully; at a second, at once)."""
        with self._lock:
            stopping, self._stopping = self._stopping, True
            children = list(self.children.values())
        if signum == HANGUP:  # the terminal closed: its children, in their own sessions,
            if stopping:  # got no SIGHUP of their own; they stop gracefully, once (a hangup
                return  # can come twice, and a second SIGTERM would skip the grace period)
            signum = signal.SIGTERM
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    def run(self) -> int:
        # A hangup stops the workers unless it is ignored (nohup): then it stays ignored.
        hangup = [s for s in HANGUP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN]
        relay = SignalRelay(self._on_signal, signals=(*STOP_SIGNALS, *hangup))
        relay.install()
        try:
            return self._supervise()
        finally:
            relay.uninstall()

    def _supervise(self) -> int:
        for slot in range(self.processes):
            self._spawn(slot)
        pending_restart: dict[int, float] = {}
        while True:
            alive = 0
            for slot, child in list(self.children.items()):
                code = child.poll()
                ran = time.monotonic() - self._started.get(slot, 0.0)
                if code is None:
                    alive += 1
                    if ran >= HEALTHY_AFTER:  # a healthy child: the failures are not a loop
                        self._early_failures = 0
                    continue
                if self._stopping or slot in pending_restart:
                    continue
                if ran >= HEALTHY_AFTER:
                    self._restarts[slot] = 0  # it ran well: its backoff starts afresh
                elif code != 0:
                    self._early_failures += 1
                    if self._early_failures >= GIVE_UP_AFTER:
                        self._give_up(slot, child.pid, code)
                        continue
                count = self._restarts[slot] = self._restarts.get(slot, 0) + 1
                delay = min(0.5 * 2 ** (count - 1), RESTART_BACKOFF_MAX)
                log.error(
                    "worker process %d (pid %d) exited with %s; restarting in %.1f s",
                    slot,
                    child.pid,
                    code,
                    delay,
                )
                pending_restart[slot] = time.monotonic() + delay
            if self._stopping:
                if alive == 0:
                    break
            else:
                for slot, at in list(pending_restart.items()):
                    if time.monotonic() >= at:
                        del pending_restart[slot]
                        self._spawn(slot)
            time.sleep(0.1)
        for write_end in self._lifelines.values():
            os.close(write_end)
        self._lifelines.clear()
        codes = [child.returncode for child in self.children.values()]
        return 0 if all(c == 0 for c in codes) and not self.gave_up else 1

    def _give_up(self, slot: int, pid: int, code: int) -> None:
        """Children keep failing as they start: stop the others (gracefully) and exit 1."""
        log.error(
            "worker process %d (pid %d) exited with %s: %d worker processes in a row "
            "failed within %.0f s of starting (see their errors above); stopping",
            slot, pid, code, self._early_failures, HEALTHY_AFTER,
        )  # fmt: skip
        self.gave_up = True
        self._on_signal(signal.SIGTERM, 1)


def child_command(argv: Sequence[str]) -> list[str]:
    """This process's command line without ``--processes N`` (or ``--processes=N``).

    It ends with ``--processes 1`` (the last value wins), so a spelling the filter misses,
    such as ``-p2``, can never make a child a supervisor of its own children in turn.
    """
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in ("--processes", "-p"):
            skip = True
            continue
        if arg.startswith("--processes="):
            continue
        out.append(arg)
    return [sys.executable, "-m", "errands", *out, "--processes", "1"]


@dataclass(frozen=True)
class SupervisorLink:
    """How a worker started by a supervisor knows it is gone: ``lifeline``, the read end
    of a pipe whose write end only the supervisor holds (EOF once it is gone, however it
    went), or, without one (Windows), its pid no longer being this process's parent."""

    pid: int
    lifeline: int | None

    def wait_gone(self) -> None:
        """Block until the supervisor is gone."""
        if self.lifeline is None:
            while os.getppid() == self.pid:
                time.sleep(SUPERVISOR_WATCH_EVERY)
            return
        while True:
            try:
                if not os.read(self.lifeline, 1):
                    return  # EOF: every write end closed
            except OSError:
                return


def supervisor_link() -> SupervisorLink | None:
    """The link to the supervisor that started this worker (``--processes N``), taken out
    of the environment (so that nothing this worker starts inherits it); None when it was
    not started by one. Call it before the app is imported.

    A lifeline is trusted as the supervisor's when the descriptor named is a pipe. A
    worker judged by its parent's pid (asked at import's end: a supervisor SIGKILLed
    while its children imported the app looked like a stale variable, and they ran on
    with no one to stop them) is now judged so only without one, and then only when its
    parent is that pid: a stale variable in a shell or a wrapper that forked must not
    stop a worker nobody asked to stop."""
    value = os.environ.pop(SUPERVISOR_ENV, None) or ""
    pid_text, _, fd_text = value.partition(":")
    if not pid_text.isdigit():
        return None
    pid = int(pid_text)
    if fd_text.isdigit():
        fd = int(fd_text)
        try:
            is_pipe = stat.S_ISFIFO(os.fstat(fd).st_mode)
        except OSError:
            is_pipe = False
        if is_pipe:
            os.set_inheritable(fd, False)  # the worker's own subprocesses do not get it
            return SupervisorLink(pid, fd)
    return SupervisorLink(pid, None) if os.getppid() == pid else None


def stop_with_supervisor(worker: Worker, link: SupervisorLink | None) -> None:
    """In a worker started by a supervisor: stop gracefully once the supervisor is gone
    (SIGKILLed, or killed with its process group by a tool that kills groups: the children
    run in sessions of their own), rather than claim jobs on with no one to stop them; at
    once when it went while the app was imported."""
    if link is None:
        return

    def watch() -> None:
        link.wait_gone()
        log.warning("the supervisor (pid %s) is gone: stopping gracefully", link.pid)
        worker.stop()

    threading.Thread(target=watch, name="errands-supervisor-watch", daemon=True).start()
