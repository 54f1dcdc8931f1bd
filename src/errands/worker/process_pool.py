"""``errands worker --pool process``: sync handlers in child processes a timeout can kill.

Threads cannot be killed; processes can. In process mode each sync attempt runs in one of
``concurrency`` child interpreters (started with ``spawn``, importing the app by its
``module:attr`` path). The parent keeps everything that guards the job — the lease, its
heartbeats, the fenced outcome — so a child that hangs, crashes or is killed never leaves
a job without an owner:

- a timeout or an operator's cancel kills the child (SIGKILL) and starts a new one;
- a child that dies on its own fails the attempt ("worker process died", kind ``crash``),
  retried with backoff; the job stays a suspect, so it runs isolated again;
- a child whose worker dies (SIGKILL, OOM) leaves at once, its handler cut short: the
  worker's jobs are rescued when their leases run out, and a child left running one
  would race its rescued run (two runs of one job at once, a per-key limit broken);
- ``ctx.progress`` reports travel to the parent (at most one every PROGRESS_EVERY
  seconds, the latest always kept), which stores them with its next heartbeat;
- ``ctx.step`` and ``ctx.transaction()`` work in the child through its own connection;
  when the handler used ``ctx.transaction()``, the child writes the fenced completion in
  that transaction itself and reports whether it landed; children of ``ctx.enqueue``
  travel back to the parent, which inserts them with the completion.

Arguments and results cross the process boundary as the job's stored JSON, never pickled
user objects; failures come back as their type name, message, traceback and class.

The same runner isolates *suspects* (rescued jobs, which may have killed their worker) in
thread mode: one child per suspect running (up to the worker's suspect lanes), sync or
``async def``. A spare child is kept started ahead of need (and replaced in the
background as soon as it is taken), so a burst of rescued jobs does not queue behind
child start-ups; children idle for a while beyond the spare are stopped.

Children start from a forkserver where the platform has one (see :func:`start_context`).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
import traceback as tb
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from ..backends import url_scheme
from ..jobs import EnqueueRequest, JobRow
from .child_starts import StartFailures

log = logging.getLogger("errands.worker")

READY = "ready"
# A child's message during a run: (PROGRESS, attempt, fraction, message), ``attempt`` the
# job's (id, lease token): a report sent after its job's outcome (by a thread the handler
# left running) belongs to no job that runs, and is no sign of the child's death.
PROGRESS = "progress"
PROGRESS_EVERY = 0.1  # seconds: a handler reporting in a tight loop floods no pipe
STOP_WAIT = 2.0  # seconds a stopping runner waits for its children to leave, then kills
ROOM_RECHECK = 1.0  # seconds a submit waiting for a child looks again for room to start one
FORKSERVER_TRIES = 3  # forkserver failures in a row after which children start with spawn

Progress = Callable[[tuple[float, str]], None]


@dataclass
class ChildResult:
    result_json: str | None
    children: list[EnqueueRequest] = field(default_factory=list)
    written: bool | None = None  # set when the child committed its own transaction


class ChildStartFailed(RuntimeError):
    """No child process could be started for a job: it did nothing (see child_starts)."""


class ChildFailure(Exception):
    """A handler's exception, as reported by the child process that ran it."""

    def __init__(
        self, type_name: str, message: str, trace: str, kind: str, after: float | None = 0.0
    ):
        super().__init__(message)
        self.type_name = type_name
        self.trace = trace
        self.kind = kind  # permanent | retry | transient | crash | suspend (after: timeout)
        self.after = after


@dataclass
class _Slot:
    process: Any
    conn: Any
    busy: Future[Any] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    idle_since: float = field(default_factory=time.monotonic)
    killed: bool = False  # killed while busy (timeout, cancel): never handed out again


# What a child needs besides the app: imported once in the forkserver, not in each child
# on its first job (the handler's path, and the store's driver: psycopg alone takes a
# good part of a second on a busy machine).
PRELOAD = ("errands.loading", __name__, "errands.worker.dispatch")
BACKEND_MODULES = {
    "sqlite": "errands.backends.sqlite",
    "postgres": "errands.backends.postgres",
    "postgresql": "errands.backends.postgres",
}


def start_context(app_path: str, url: str = "") -> Any:
    """How children start: ``forkserver`` where the platform has it, else ``spawn``.

    A spawned child is a fresh interpreter that imports errands and the app: about half a
    second of CPU for a small app, seconds for a big one, and several children starting
    at once on a busy machine took ~3 s each (the soak's rescue bursts). The forkserver
    imports them once (its preload, the app's module included); each child is then a
    fork of it, ready in tens of milliseconds. The server itself is a clean process (no
    threads, no connections), so forking it is safe; code that opens a connection at
    import time would share it between children, as under any preforking server.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    # The server imports these before forking any child (an ImportError is skipped: the
    # child then imports, and reports, as a spawned one would). Process-wide, and fixed
    # once the server runs: both of a worker's runners load the same app.
    backend = BACKEND_MODULES.get(url_scheme(url)) if url else None
    ctx.set_forkserver_preload(
        [
            "errands.worker.forkserver_signals",  # (CPython imports "__main__" first anyway)
            "__main__",
            *PRELOAD,
            *([backend] if backend else []),
            app_path.partition(":")[0],
        ]
    )
    return ctx


class ProcessRunner:
    def __init__(
        self,
        app_path: str,
        url: str,
        size: int,
        *,
        start: bool = True,
        worker_id: str = "",
        spare: int = 0,
        idle_retire: float | None = None,
        needed_by: str = "jobs",
    ) -> None:
        """``size`` children at most; ``start=False`` starts each when first needed. A
        handler in a child sees ``worker_id`` (the parent worker's) as ``ctx.worker_id``.

        ``spare``: after :meth:`warm`, keep this many idle children started ahead of need
        (in the background, as each is taken), so the next job does not wait for one to
        start. ``idle_retire``: stop children idle this many seconds, beyond the spares.
        ``needed_by``: what needs these children, named when they cannot start."""
        self.app_path = app_path
        self.url = url
        self.worker_id = worker_id
        self.size = size
        self.spare = min(spare, size)
        self.idle_retire = idle_retire
        self.ctx = start_context(app_path, url)
        self._slots: list[_Slot] = []
        self._free: list[_Slot] = []
        self._cond = threading.Condition()
        self._closed = False
        self._starting = 0
        self._warm = False
        self.killed = 0
        self.started = 0  # children started (the replacements included)
        self.failures = StartFailures(needed_by)  # starts that failed (see child_starts)
        self._forkserver_failures = 0  # in a row (see _spawn)
        self.retired = 0  # idle children stopped
        try:
            for _ in range(size if start else 0):  # (a failure here fails the worker's start)
                self._add(self._start_one())
        except BaseException:  # the children started before the one that failed: stopped
            self.shutdown()
            raise
        if idle_retire is not None:
            threading.Thread(target=self._retire_idle, name="errands-children", daemon=True).start()

    def _spawn(self) -> _Slot:
        """Start a child; a start that fails is counted (:class:`StartFailures`)."""
        try:
            slot = self._start_one()
        except Exception as exc:
            if not self._closed:  # closing: a start cut short is no news
                self.failures.failed(exc)
            raise
        self.failures.started()
        return slot

    def _start_one(self) -> _Slot:
        """Start a child, from the forkserver where there is one. A start the forkserver
        fails (its server died, or could not fork) is made again with spawn, and the next
        start tries the forkserver again (a server that died is started afresh): one such
        failure made every later child of the worker a spawned one, each importing the app
        itself (seconds on a busy machine). After FORKSERVER_TRIES failures in a row the
        runner uses spawn for good, and says so once."""
        ctx = self.ctx
        try:
            slot = self._start_child(ctx)
        except _ChildRefused:
            raise
        except Exception as exc:
            if self._closed or ctx.get_start_method() != "forkserver":
                raise  # closing (the process may be exiting, its forkserver gone)
            self._forkserver_failed(ctx, exc)
            return self._start_child(multiprocessing.get_context("spawn"))
        if ctx.get_start_method() == "forkserver":
            self._forkserver_failures = 0
        return slot

    def _forkserver_failed(self, ctx: Any, exc: Exception) -> None:
        with self._cond:
            if self.ctx is not ctx:
                return  # another start gave up on the forkserver meanwhile, and said so
            self._forkserver_failures += 1
            failures = self._forkserver_failures
            if failures >= FORKSERVER_TRIES:
                self.ctx = multiprocessing.get_context("spawn")
        if failures >= FORKSERVER_TRIES:
            log.error(
                "the forkserver failed to start %d worker children in a row (last: %r); "
                "starting them with spawn from now on (each imports the app itself: slower)",
                failures,
                exc,
            )
        else:
            log.warning(
                "the forkserver could not start a worker child (%r; %d in a row, spawn for "
                "good after %d); this one starts with spawn, the next tries the forkserver "
                "again",
                exc,
                failures,
                FORKSERVER_TRIES,
            )

    def _start_child(self, ctx: Any) -> _Slot:
        began = time.monotonic()
        parent, child = ctx.Pipe()
        process = ctx.Process(
            target=child_main, args=(self.app_path, self.url, child, self.worker_id, _logging()),
            daemon=True, name="errands-child",
        )  # fmt: skip
        process.start()
        child.close()
        message = parent.recv() if parent.poll(60) else None
        if message != READY:
            process.kill()
            raise _ChildRefused(
                f"worker child process failed to start: {message!r} (can it import "
                f"{self.app_path!r}?)"
            )
        self.started += 1
        log.debug(
            "worker child %s started (%s) in %.3f s",
            process.pid,
            ctx.get_start_method(),
            time.monotonic() - began,
        )
        return _Slot(process, parent)

    def _add(self, slot: _Slot, replacing: _Slot | None = None) -> None:
        """A started child joins the free ones (stopped at once if the runner closed)."""
        with self._cond:
            if not self._closed:
                if replacing is not None and replacing in self._slots:
                    self._slots[self._slots.index(replacing)] = slot
                else:
                    self._slots.append(slot)
                slot.idle_since = time.monotonic()
                self._free.append(slot)
                self._cond.notify()
                return
        _stop(slot)

    def submit(
        self, row: JobRow, on_progress: Progress | None = None, future: Future[Any] | None = None
    ) -> Future[Any]:
        """Run ``row`` in a child; ``on_progress`` receives its ctx.progress reports.

        Returns at once: a thread of the runner's waits for a free child (or starts one),
        hands it the job and settles the future with its answer. Nothing of the runner's
        is done on the caller's thread, which the worker may stop with an interrupt raised
        inside it (a timeout's, a graceful stop's): one landing between the taking of a
        child and its handing over left that child busy for ever, the pool a child short
        (-c 1: no job ran again). ``future``: the caller's own, made before the call, so
        that :meth:`kill` reaches the job whatever instant the caller is stopped at."""
        future = Future() if future is None else future
        threading.Thread(
            target=self._serve, args=(row, future, on_progress), name="errands-child-job",
            daemon=True,
        ).start()  # fmt: skip
        return future

    def _serve(self, row: JobRow, future: Future[Any], on_progress: Progress | None) -> None:
        try:
            slot = self._take(future)
        except Exception as exc:  # no child could be started for it
            failed = ChildStartFailed(
                f"no worker child process could be started for it: {type(exc).__name__}: {exc}"
            )
            failed.__cause__ = exc
            _settle(future, exc=failed)
            return
        if slot is not None:
            self._top_up()
            self._run(slot, row, future, on_progress)

    def _take(self, future: Future[Any]) -> _Slot | None:
        """A free child that lives, now busy with ``future``; None when ``future`` was
        settled first (killed while it waited: it gets no child) or the runner closed."""
        while True:
            self._grow()
            dead = None
            with self._cond:
                # Wait for a free child, or for room to start one: a child that died is
                # replaced by its _run thread, and when that replacement cannot start its
                # place is given up (room). Waiting for a free child alone, a job waited
                # for ever then (-c 1: the whole worker).
                while (
                    not self._free and not self._closed and self._room() <= 0
                ) and not future.done():
                    self._cond.wait(timeout=ROOM_RECHECK)
                if self._closed:
                    _settle(future, exc=RuntimeError("process pool closed"))
                    return None
                if future.done():
                    return None
                if self._free:
                    slot = self._free.pop()
                    if _idle_alive(slot):
                        slot.busy = future
                        return slot
                    # Died while idle (the OOM killer, a stray signal): handed out, it
                    # failed this job as a crash, charged toward its poison limit. Its
                    # place is given up; the next round starts a fresh child.
                    self._slots.remove(slot)
                    dead = slot
            if dead is not None:
                log.warning(
                    "a worker child process (pid %s) died while idle (exit code %s); "
                    "starting another",
                    dead.process.pid,
                    dead.process.exitcode,
                )
                _stop(dead)

    def _grow(self) -> None:
        """Start one more child here when none is free and fewer than ``size`` exist
        (a burst's jobs each start theirs at once, not one after another)."""
        with self._cond:
            if self._free or self._room() <= 0 or self._closed:
                return
            self._starting += 1
        self._start_counted("a worker child process")

    def _start_counted(self, what: str) -> None:
        """Start a child already counted in ``_starting``; it joins the free ones."""
        try:
            slot = self._spawn()
        except Exception:
            log.debug("could not start %s", what, exc_info=True)  # (said by StartFailures)
            raise
        finally:
            with self._cond:
                self._starting -= 1
        self._add(slot)

    @property
    def ready(self) -> bool:
        """A child has started (the forkserver runs: the next one forks in milliseconds),
        or starting one failed (a job submitted now is released at once, the failure
        logged, rather than kept waiting for a child that does not come)."""
        return self.started > 0 or self.failures.total > 0

    def pids(self) -> list[int]:
        """The process ids of the children started now (busy or idle)."""
        with self._cond:
            return [slot.process.pid for slot in self._slots]

    def idle(self) -> int:
        """How many children wait for a job."""
        with self._cond:
            return len(self._free)

    def _room(self) -> int:
        return self.size - len(self._slots) - self._starting

    def warm(self) -> None:
        """Start the spare children now, in the background, and keep them topped up."""
        self._warm = True
        self._top_up()

    def _top_up(self) -> None:
        """Start children in the background until ``spare`` are free or starting."""
        if not self._warm:
            return
        with self._cond:
            if self._closed:
                return
            count = min(self.spare - len(self._free) - self._starting, self._room())
            if count <= 0:
                return
            self._starting += count
        for _ in range(count):
            threading.Thread(
                target=self._start_spare, name="errands-child-start", daemon=True
            ).start()

    def _start_spare(self) -> None:
        with contextlib.suppress(Exception):  # logged; the next submit starts one itself
            self._start_counted("a spare worker child process")

    def _retire_idle(self) -> None:
        """Stop the children idle longer than ``idle_retire``, but keep ``spare`` of them."""
        assert self.idle_retire is not None
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed, timeout=self.idle_retire / 4)
                if self._closed:
                    return
                cutoff = time.monotonic() - self.idle_retire
                keep = self.spare if self._warm else 0
                old = [s for s in self._free if s.idle_since < cutoff]
                old = sorted(old, key=lambda s: s.idle_since)[: max(len(self._free) - keep, 0)]
                for slot in old:
                    self._free.remove(slot)
                    self._slots.remove(slot)
                self.retired += len(old)
            for slot in old:
                _stop(slot)

    def _run(
        self, slot: _Slot, row: JobRow, future: Future[Any], on_progress: Progress | None
    ) -> None:
        """Hand the job to its child and settle ``future`` with the answer; the child then
        goes back to the free ones, or is replaced (it died, was killed, or is in a state
        nobody knows): never left busy."""
        try:
            ok, payload = self._exchange(slot, row, on_progress)
            answer = None if ok else ChildFailure(*payload)
        except (EOFError, OSError):
            slot.process.join(timeout=2)
            code = slot.process.exitcode
            # the outcome first; the replacement may take a while
            _settle(
                future,
                exc=ChildFailure(
                    "WorkerProcessDied",
                    f"the worker child process died running this job (exit code {code})",
                    "",
                    "crash",
                ),
            )
            self._replace(slot)
            return
        except BaseException as exc:  # errands' side failed (an answer it cannot read): the
            # child may still be running the job, which is failed (retried, not charged
            # toward poison) and its child replaced
            log.exception("job %s: lost track of its worker child process", row.id)
            slot.process.kill()
            lost = f"errands lost track of the worker child process running this job: {exc!r}"
            _settle(future, exc=ChildFailure(type(exc).__qualname__, lost, "", "transient"))
            self._replace(slot)
            return
        with self._cond:  # kill() looks for the child under it: never one given back
            killed = slot.killed
            if not killed:
                _settle(future, result=payload, exc=answer)
                slot.busy = None
                slot.idle_since = time.monotonic()
                self._free.append(slot)
                self._cond.notify()
        if killed:
            # Killed as it answered (a timeout or a cancel landing between the answer and
            # here): handed out again, the dead child failed the next job as a crash,
            # counted toward that job's poison limit. A fresh child takes its place.
            self._replace(slot)

    def _exchange(self, slot: _Slot, row: JobRow, on_progress: Progress | None) -> tuple[bool, Any]:
        """Send the job to its child, pass its progress reports on, return its answer."""
        slot.conn.send(tuple(getattr(row, c) for c in row.__slots__))
        message = _receive(slot)
        while _is_progress(message):
            if on_progress is not None and message[1] == _attempt_of(row):
                on_progress((message[2], message[3]))
            message = _receive(slot)  # (another attempt's: stale, ignored)
        ok, payload = message
        return bool(ok), payload

    def kill(self, future: Future[Any], exc: BaseException) -> bool:
        """Stop the job of ``future`` (a timeout, a cancel, an attempt given up on): the
        future fails with ``exc``, and the child running the job is killed (its _run
        thread replaces it: True), or the job, still waiting for a child, gets none. A job
        answered already is left as it is (False)."""
        with self._cond:  # _run hands a finished child back under it: never this one then
            doomed = next((s for s in self._slots if s.busy is future), None)
            if doomed is None:
                if not future.done():  # not handed to a child yet: it never will be
                    _settle(future, exc=exc)
                    self._cond.notify_all()
                return False
            if doomed.killed:
                return True
            doomed.killed = True
        _settle(future, exc=exc)
        self.killed += 1
        doomed.process.kill()  # its _run thread sees EOF (or its answer) and replaces it
        return True

    def _replace(self, slot: _Slot) -> None:
        slot.process.join(timeout=5)
        with self._cond:
            if self._closed:
                return
        try:
            fresh = self._spawn()
        except Exception:
            log.debug("could not start a replacement worker child process", exc_info=True)
            with self._cond:
                if slot in self._slots:
                    self._slots.remove(slot)  # the next submit starts one when needed
                self._cond.notify_all()  # a submit waiting for a child: room to start one
            return
        self._add(fresh, replacing=slot)

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            slots = list(self._slots)
        _stop(*slots)


class _ChildRefused(RuntimeError):
    """A child started but could not load the app: it said why."""


def _outlived(signum: int, frame: Any) -> None:
    """A worker child's SIGINT, SIGTERM and SIGHUP: its worker decides when it stops."""


def _idle_alive(slot: _Slot) -> bool:
    """Whether an idle child still lives: its pipe holds nothing but stale progress
    reports (drained here), and it runs (its process, or its pid when its forkserver died:
    see :func:`_pid_alive`).

    An idle child runs no job, so a progress report in its pipe is a previous attempt's,
    sent after that attempt's outcome (by a thread its handler left running): the child
    was taken for dead and replaced, the submitting job waiting 2-4 s for its stop. Any
    other message, or the pipe's end, is a child that died (before its exit status
    reached the forkserver's sentinel)."""
    try:
        while slot.conn.poll(0):
            if not _is_progress(slot.conn.recv()):
                return False
    except Exception:  # the end of the pipe (EOFError), a broken one, an unreadable message
        return False
    return slot.process.is_alive() or _pid_alive(slot.process.pid)


def _settle(future: Future[Any], *, result: Any = None, exc: BaseException | None = None) -> None:
    """Settle ``future`` with ``exc`` (or ``result``), unless it is settled already (a
    kill and the child's answer may race)."""
    with contextlib.suppress(InvalidStateError):
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)


def _attempt_of(row: JobRow) -> tuple[int, str | None]:
    """What a progress report names its attempt by: the job's id and lease token."""
    return row.id, row.lease_token


def _is_progress(message: Any) -> bool:
    return type(message) is tuple and len(message) == 4 and message[0] == PROGRESS


def _pid_alive(pid: int | None) -> bool:
    """Whether ``pid`` still runs, for a child whose sentinel says it exited: a forkserver
    child's sentinel is the server's socket, which a dead server closes (exit code 255)
    while the child runs on."""
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # (or a pid another user's process took)
        return False
    return True


def _receive(slot: _Slot) -> Any:
    """The child's next message; EOFError once the child has exited with none left. Its
    exit is watched, not only the pipe's end: a process the handler forked (a
    multiprocessing pool, os.fork, a shell) holds the pipe open after the child died
    (a segfault, the OOM killer, a kill for a timeout), and the job stayed running,
    heart-beaten, for ever, or a timed-out job's slot was never given back."""
    ready = multiprocessing.connection.wait([slot.conn, slot.process.sentinel])
    if slot.conn in ready or slot.conn.poll(0):  # its last words before it left, too
        return slot.conn.recv()
    forked_by_a_server = type(slot.process).__name__ == "ForkServerProcess"
    if forked_by_a_server and _pid_alive(slot.process.pid):
        return slot.conn.recv()  # its forkserver died, not the child: its pipe tells
    raise EOFError("the worker child process exited")


def _stop(*slots: _Slot) -> None:
    """Tell children to leave, and wait for them: one wait for them all, not one each
    (those still running after it are killed)."""
    for slot in slots:
        with contextlib.suppress(OSError):
            slot.conn.send(None)
    deadline = time.monotonic() + STOP_WAIT
    for slot in slots:
        slot.process.join(timeout=max(deadline - time.monotonic(), 0.0))
    for slot in slots:
        if slot.process.is_alive():
            slot.process.kill()
            slot.process.join(timeout=STOP_WAIT)
        with contextlib.suppress(OSError):
            slot.conn.close()


# A child whose worker died exits with this code (os._exit: its handler is cut short).
ORPHAN_EXIT = 3


def _logging() -> tuple[str, int] | None:
    """How this worker logs (format and level), for its children to log alike; None when
    it set up no logging of errands' (an embedded worker: its app's logging rules)."""
    from ..observability import logcontext

    fmt = logcontext.current_format()
    return None if fmt is None else (fmt, logging.getLogger().level)


def _leave_with_the_worker(running: threading.Event) -> None:
    """Exit this child as soon as the worker that started it dies. The worker's jobs are
    rescued when their leases run out; a child running on would race the rescued run
    (seen: a child of a SIGKILLed worker still sleeping through its job, and the
    forkserver kept alive by it). The child learns of its worker's death otherwise only
    when it next writes to it, after the job. A child cut off in a job says so on
    stderr; one idle or still starting leaves quietly (a worker that stopped gracefully
    while its spare child started is no news, and its log stays one format)."""
    parent = multiprocessing.parent_process()
    if parent is None:  # not a child process (in-process tests)
        return

    def watch() -> None:
        from multiprocessing.connection import wait

        from ..observability.logcontext import lockless_line

        wait([parent.sentinel])
        if running.is_set():
            with contextlib.suppress(OSError):
                os.write(
                    2,
                    lockless_line(
                        f"the worker (pid {parent.pid}) of child {os.getpid()} is gone: "
                        "leaving its job (rescued when its lease runs out, unless its "
                        "outcome was written already)"
                    ),
                )
        os._exit(ORPHAN_EXIT)

    threading.Thread(target=watch, name="errands-worker-watch", daemon=True).start()


def child_main(
    app_path: str,
    url: str,
    conn: Any,
    worker_id: str = "",
    logs: tuple[str, int] | None = None,
) -> None:
    """A child's loop: import the app, then run one job per message until told to stop.
    ``logs``: the worker's log format and level, which the child's own lines follow (a
    handler's log lines, and the line it leaves with), so a JSON log stays JSON."""
    import signal

    # The worker decides when its children stop (a message, or SIGKILL): a SIGTERM or
    # SIGHUP sent to the whole group (systemd's default KillMode=control-group, `kill --
    # -PGID`, a terminal closing) killed the child at once, the running job recorded as a
    # crash and charged toward its poison limit, when the worker's grace should let it end.
    # A handler that does nothing, not SIG_IGN: exec resets a handled signal to its
    # default, so the programs a handler starts still stop on SIGTERM (an ignored one
    # stays ignored: `p.terminate()` on a subprocess hung).
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):  # (no SIGHUP on Windows)
        signum = getattr(signal, name, None)
        if signum is not None:
            signal.signal(signum, _outlived)
    if logs is not None:
        from ..observability.logcontext import configure_logging

        configure_logging(logs[0], logs[1], background=False)
    running = threading.Event()  # set while a job runs here, until its outcome is sent
    _leave_with_the_worker(running)
    try:
        from ..loading import load_app

        app = load_app(app_path, url, need_code=True)
    except BaseException as exc:  # report why it cannot start, then leave
        with contextlib.suppress(OSError):  # the worker stopped meanwhile: nobody to tell
            conn.send(f"{type(exc).__name__}: {exc}")
        return
    try:
        conn.send(READY)
    except OSError:  # the worker stopped while this child started (a spare): leave quietly
        return
    reporter = _ProgressSender(conn)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the worker is gone (a SIGKILL resets the pipe): leave
            return
        if message is None:
            return
        running.set()
        try:
            try:
                row = JobRow(*message)
                outcome = _run_one(
                    app, row, worker_id or f"child-{os.getpid()}", reporter, app_path
                )
            except Exception as exc:  # errands' own code around the handler failed: the
                # job's failure, recorded as such; the child lives on for the next job (it
                # died, and the job was recorded as a crash, charged toward its poison limit)
                outcome = False, _failure(exc, "transient")
            try:
                reporter.send_outcome(outcome)
            except OSError:  # the worker died while the job ran: a transactional job's
                # outcome is written already (by _run_one); any other is rescued when its
                # lease runs out
                return
        finally:
            running.clear()


class _ProgressSender:
    """Sends a child's progress reports to the parent, at most one per PROGRESS_EVERY
    seconds: a report held back goes out within that time (a flusher thread), or just
    before the outcome. One lock orders every message on the pipe. Each report names its
    attempt (:meth:`for_attempt`)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.sent_at = 0.0
        self.held: tuple[tuple[int, str | None], float, str] | None = None
        threading.Thread(target=self._flusher, name="errands-progress", daemon=True).start()

    def for_attempt(self, row: JobRow) -> Progress:
        """Where the attempt of ``row`` reports its progress."""
        attempt = _attempt_of(row)
        return lambda report: self._report(attempt, report)

    def _report(self, attempt: tuple[int, str | None], report: tuple[float, str]) -> None:
        with self.lock:
            self.held = (attempt, *report)
            if time.monotonic() - self.sent_at >= PROGRESS_EVERY:
                self._send_held()

    def _send_held(self) -> None:
        if self.held is not None:
            self.conn.send((PROGRESS, *self.held))
            self.held, self.sent_at = None, time.monotonic()

    def _flusher(self) -> None:
        while True:
            time.sleep(PROGRESS_EVERY)
            with self.lock:
                try:
                    self._send_held()
                except OSError:  # the parent is gone: the child's loop ends too
                    return

    def send_outcome(self, outcome: tuple[bool, Any]) -> None:
        with self.lock:
            self._send_held()
            self.conn.send(outcome)


def _failure(exc: BaseException, kind: str, after: float | None = 0.0) -> tuple[Any, ...]:
    """An exception as the parent's :class:`ChildFailure` takes it. Its text is user code
    and may raise: such an exception is recorded as ``<unprintable ValueError>``, never
    left to end the child."""
    name = type(exc).__qualname__
    try:
        message = str(exc)
    except Exception:
        message = f"<unprintable {name}>"
    try:
        trace = "".join(tb.format_exception(exc))
    except Exception:
        trace = f"<traceback of an unprintable {name}>"
    return name, message, trace, kind, after


def _unknown_here(name: str, app_path: str) -> tuple[Any, ...]:
    """A job type the worker's app has and its child's lacks: a permanent failure (each
    retry would fail alike) that says how to fix it."""
    module = app_path.partition(":")[0]
    message = (
        f"job type {name!r} is not registered in the app this worker's child processes "
        f"load ({app_path!r}), though the worker's own app has it: the child's app must "
        f"define it. Register the job where importing {module!r} registers it (a job added "
        "only by the script that starts the worker, or by a module only it imports, never "
        "reaches the children)"
    )
    return "UnknownJob", message, "", "permanent", 0.0


def _run_one(
    app: Any,
    row: JobRow,
    worker_id: str,
    reporter: _ProgressSender | None = None,
    app_path: str = "",
) -> tuple[bool, Any]:
    import asyncio
    import inspect

    from ..errors import InvalidPayload, StepError, TransactionEnded
    from ..outcomes import Permanent, Retry
    from .dispatch import encode
    from .execution import Attempt, Suspended, context_for, outcome_for
    from .runtime import AttemptRuntime

    definition = app.registry.get(row.name)
    if definition is None:
        return False, _unknown_here(row.name, app_path)
    attempt = Attempt(row=row, definition=definition, lease_seconds=row.lease_seconds or 30.0)
    runtime = attempt.runtime = AttemptRuntime(app, attempt)
    runtime.report_progress = reporter.for_attempt(row) if reporter is not None else None
    try:
        kwargs = definition.payload.decode(row.args)
        attempt.kwargs = kwargs
        ctx = context_for(row, definition, worker_id, runtime)
        call = dict(kwargs)
        if definition.payload.context_param:
            call[definition.payload.context_param] = ctx
        value = definition.fn(**call)
        if inspect.isawaitable(value):  # an async def handler: its own event loop here
            value = asyncio.run(_awaited(value))
        result_json = encode(definition, value)
        if runtime.tx is not None:
            runtime.check_transaction()  # raises if the handler ended it
    except BaseException as exc:
        runtime.rollback()
        permanent = (InvalidPayload, Permanent, StepError, TransactionEnded, *definition.permanent)
        after: float | None
        if isinstance(exc, Suspended):  # the parent writes the suspension
            kind, after = "suspend", exc.timeout
        elif isinstance(exc, permanent):
            kind, after = "permanent", 0.0
        elif isinstance(exc, Retry):
            kind, after = "retry", exc.after
        else:
            kind, after = "transient", 0.0
        return False, _failure(exc, kind, after)
    written = None
    if runtime.tx is not None:
        from dataclasses import replace

        outcome = outcome_for(attempt, None, result_json, worker_id)
        if runtime.children:
            outcome = replace(outcome, children=tuple(runtime.children))
        tx, runtime.tx = runtime.tx, None
        try:
            written = app.backend.tx_finish(tx, outcome)
        except Exception as exc:  # the parent retries it, like any store failure
            return False, _failure(exc, "transient")
        return True, ChildResult(result_json, [], written)
    return True, ChildResult(result_json, list(runtime.children), written)


async def _awaited(value: Any) -> Any:
    return await value
