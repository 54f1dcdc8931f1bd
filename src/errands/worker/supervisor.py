"""``errands worker --processes N``: N worker processes under one supervisor.

Each child is a full worker (its own id, pool and leases), started as a fresh interpreter
running the same command without ``--processes``, so nothing is shared by fork. The
supervisor forwards SIGTERM/SIGINT to every child and waits for them (each honours its
own ``--grace``); a second signal is forwarded too, and the children exit at once; a
SIGHUP is forwarded as SIGTERM. The children run in sessions of their own, so that a
terminal's Ctrl-C reaches them once, through the supervisor. A
child that dies on its own (crash, OOM kill) is restarted after a short backoff, so
capacity comes back; its running jobs are rescued after their leases expire. The backoff
starts afresh once a child has run HEALTHY_AFTER seconds. Each child says once when its
worker has started (one byte on a pipe of its own): children that keep failing before
that (a bad option or app, checked only in the child) are given up on after
GIVE_UP_AFTER failures in a row with none started since: the supervisor stops the
others and exits 1, so a service manager shows the failure (it restarted them for ever,
"running"). A child that dies after its start (a job's segfault, ``os._exit``, the OOM
killer) is only restarted: such deaths, judged by the time since the child's start,
stopped the whole fleet (exit 1), its healthy jobs left unrun, after five crashing jobs.
"""

from __future__ import annotations

import contextlib
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
from typing import TYPE_CHECKING, Any

from .signals import STOP_SIGNALS, SignalRelay

if TYPE_CHECKING:
    from .worker import Worker

log = logging.getLogger("errands.supervisor")

RESTART_BACKOFF_MAX = 30.0
HEALTHY_AFTER = 60.0  # seconds a child runs before its exit counts as a fresh failure
GIVE_UP_AFTER = 5  # failures in a row, each before HEALTHY_AFTER, with none healthy
# Set in the environment of each child worker: "<supervisor pid>:<lifeline fd>:<ready fd>"
# (the pid alone where there is no pass_fds: Windows).
SUPERVISOR_ENV = "ERRANDS_SUPERVISOR"
SUPERVISOR_WATCH_EVERY = 0.5  # seconds between a child's looks for its supervisor
HANGUP = getattr(signal, "SIGHUP", None)  # POSIX only
HANGUP_SIGNALS = () if HANGUP is None else (HANGUP,)
# The most worker processes one supervisor starts (--processes N). Each is a fresh
# interpreter that imports the app (tens of MB at least), with its own handler threads
# (-c) and, on PostgreSQL, its own pools and LISTEN connection (docs/postgres.md: 1,024
# processes of the defaults' 10 + 10 + 1 is some 21,500 connections). Unbounded, a typo
# (--processes 100000) started interpreters until the machine ran out of memory or
# process slots. More than a large host's cores: for more, raise -c or run more hosts.
PROCESSES_MAX = 1_024
PROCESSES_ADVICE = (
    "each is a worker process of its own: a Python interpreter with the app, its own "
    "handler threads and store connections); for more jobs at once raise -c, or run "
    "workers on more hosts"
)


def check_processes(value: object) -> int:
    """``--processes N``, checked: an int from 1 to PROCESSES_MAX (before any child
    starts, and before the app is imported)."""
    from .worker import check_count

    return check_count(
        value, "processes (--processes)", most=PROCESSES_MAX, advice=PROCESSES_ADVICE
    )


class Supervisor:
    def __init__(self, command: Sequence[str], processes: int) -> None:
        self.command = list(command)
        self.processes = check_processes(processes)
        self.children: dict[int, subprocess.Popen[bytes]] = {}
        self._stopping = False
        self._restarts: dict[int, int] = {}
        self._started: dict[int, float] = {}  # slot -> when its child started (monotonic)
        self._early_failures = 0  # children that failed before HEALTHY_AFTER, in a row
        # slot -> the write end of its child's lifeline, never written: the child reads
        # EOF once this process is gone, however it went (see supervisor_link)
        self._lifelines: dict[int, int] = {}
        # slot -> the read end of its child's ready pipe (POSIX), and whether it said it
        # started (see SupervisorLink.say_started)
        self._ready_pipes: dict[int, int] = {}
        self._ready: dict[int, bool] = {}
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
                said, say = os.pipe()  # the child's "started" (say: its end)
                env = {**os.environ, SUPERVISOR_ENV: f"{os.getpid()}:{read_end}:{say}"}
                try:
                    child = subprocess.Popen(
                        self.command, start_new_session=True, env=env,
                        pass_fds=(read_end, say),
                    )  # fmt: skip
                except BaseException:
                    os.close(write_end)
                    os.close(said)
                    raise
                finally:
                    os.close(read_end)
                    os.close(say)
                os.set_blocking(said, False)
                for pipes, fd in ((self._lifelines, write_end), (self._ready_pipes, said)):
                    previous = pipes.pop(slot, None)
                    if previous is not None:
                        os.close(previous)
                    pipes[slot] = fd
                self._ready[slot] = False
            else:
                env = {**os.environ, SUPERVISOR_ENV: str(os.getpid())}
                child = subprocess.Popen(self.command, start_new_session=True, env=env)
            self.children[slot] = child
            self._started[slot] = time.monotonic()
        log.info("started worker process %d (pid %d)", slot, child.pid)

    def _started_up(self, slot: int) -> bool | None:
        """Whether the child in ``slot`` has said its worker started (None: it cannot say,
        as on Windows: judged by the time it ran instead)."""
        fd = self._ready_pipes.get(slot)
        if fd is None:
            return None
        if not self._ready.get(slot):
            try:
                self._ready[slot] = bool(os.read(fd, 1))
            except BlockingIOError:  # not yet
                pass
            except OSError:
                pass
        return self._ready.get(slot, False)

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
                started = self._started_up(slot)  # (read before it is judged, below)
                if code is None:
                    alive += 1
                    if started or (started is None and ran >= HEALTHY_AFTER):
                        self._early_failures = 0  # a healthy child: the failures are no loop
                    continue
                if self._stopping or slot in pending_restart:
                    continue
                if ran >= HEALTHY_AFTER:
                    self._restarts[slot] = 0  # it ran well: its backoff starts afresh
                if code != 0 and not started and (started is False or ran < HEALTHY_AFTER):
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
        for fd in (*self._lifelines.values(), *self._ready_pipes.values()):
            os.close(fd)
        self._lifelines.clear()
        self._ready_pipes.clear()
        codes = [child.returncode for child in self.children.values()]
        return 0 if all(c == 0 for c in codes) and not self.gave_up else 1

    def _give_up(self, slot: int, pid: int, code: int) -> None:
        """Children keep failing as they start: stop the others (gracefully) and exit 1."""
        log.error(
            "worker process %d (pid %d) exited with %s: %d worker processes in a row "
            "failed as they started (see their errors above); stopping",
            slot, pid, code, self._early_failures,
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


@dataclass
class SupervisorLink:
    """How a worker started by a supervisor knows it is gone: ``lifeline``, the read end
    of a pipe whose write end only the supervisor holds (EOF once it is gone, however it
    went), or, without one (Windows), its pid no longer being this process's parent.
    ``ready``: the write end of a pipe on which it says once that its worker started."""

    pid: int
    lifeline: int | None
    ready: int | None = None

    def say_started(self) -> None:
        """Tell the supervisor this worker has started: its exits from now on are no
        start-up failures (see :class:`Supervisor`). Once; a supervisor gone is no news."""
        fd, self.ready = self.ready, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.write(fd, b"1")
        with contextlib.suppress(OSError):
            os.close(fd)

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
    pid_text, _, fds_text = value.partition(":")
    fd_text, _, ready_text = fds_text.partition(":")
    if not pid_text.isdigit():
        return None
    pid = int(pid_text)
    if _pipe(fd_text):
        return SupervisorLink(pid, int(fd_text), int(ready_text) if _pipe(ready_text) else None)
    return SupervisorLink(pid, None) if os.getppid() == pid else None


def _pipe(fd_text: str) -> bool:
    """Whether ``fd_text`` names a descriptor open on a pipe; it is then made one this
    worker's own subprocesses do not inherit."""
    if not fd_text.isdigit():
        return False
    try:
        is_pipe = stat.S_ISFIFO(os.fstat(int(fd_text)).st_mode)
    except OSError:
        return False
    if is_pipe:
        os.set_inheritable(int(fd_text), False)
    return is_pipe


class _SayStarted:
    """Tells the supervisor once this worker has started. It wants that one event alone:
    a subscriber without ``wants`` is handed every event, which had every job of a
    supervised worker build its started and completed events for nobody (a no-op job's
    CPU, 2 x with async handlers)."""

    def __init__(self, worker: Worker, link: SupervisorLink) -> None:
        self.worker, self.link = worker, link

    def wants(self, name: str) -> bool:
        return name == "errands.worker.started"

    def __call__(self, event: Any) -> None:
        if event.name == "errands.worker.started" and event.fields.get("worker_id") == (
            self.worker.id
        ):
            self.link.say_started()


def stop_with_supervisor(worker: Worker, link: SupervisorLink | None) -> None:
    """In a worker started by a supervisor: stop gracefully once the supervisor is gone
    (SIGKILLed, or killed with its process group by a tool that kills groups: the children
    run in sessions of their own), rather than claim jobs on with no one to stop them; at
    once when it went while the app was imported."""
    if link is None:
        return
    if link.ready is not None:
        worker.app.events.subscribe(_SayStarted(worker, link), inline=True)

    def watch() -> None:
        link.wait_gone()
        log.warning("the supervisor (pid %s) is gone: stopping gracefully", link.pid)
        worker.stop()

    threading.Thread(target=watch, name="errands-supervisor-watch", daemon=True).start()
