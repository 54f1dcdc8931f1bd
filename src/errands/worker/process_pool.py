"""``errands worker --pool process``: sync handlers in child processes a timeout can kill.

Threads cannot be killed; processes can. In process mode each sync attempt runs in one of
``concurrency`` child interpreters (started with ``spawn``, importing the app by its
``module:attr`` path). The parent keeps everything that guards the job — the lease, its
heartbeats, the fenced outcome — so a child that hangs, crashes or is killed never leaves
a job without an owner:

- a timeout or an operator's cancel kills the child (SIGKILL) and starts a new one;
- a child that dies on its own fails the attempt ("worker process died", kind ``crash``),
  retried with backoff; the job stays a suspect, so it runs isolated again;
- a child whose pipe closes while it runs on (a handler closing inherited descriptors)
  is killed, and its end waited for, before its job's outcome is written (a transient
  failure, not a crash): no child is ever replaced while it still runs its job;
- a child that cannot start costs its job nothing: the job is released, uncharged, and
  the claims that need a child pause (:mod:`.child_starts`); while other children live,
  the job waits for one of them instead (no release, no pause);
- a failure that is the job's own (its handler's exception, even one that cannot be
  printed; a job type the child's app lacks) is recorded as such, and the child lives on;
- a child whose worker dies (SIGKILL, OOM) leaves at once, its handler cut short: the
  worker's jobs are rescued when their leases run out, and a child left running one
  would race its rescued run (two runs of one job at once, a per-key limit broken);
- ``ctx.progress`` reports travel to the parent (at most one every PROGRESS_EVERY
  seconds, the running attempt's latest always kept), which stores them with its next
  heartbeat;
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
import signal
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from ..backends import url_scheme
from ..jobs import JobRow
from .child_starts import StartFailures
from .process_child import READY, MaybeLanded, Progress, attempt_of, child_main, is_progress

log = logging.getLogger("errands.worker")

STOP_WAIT = 2.0  # seconds a stopping runner waits for its children to leave, then kills
ROOM_RECHECK = 1.0  # seconds a submit waiting for a child looks again for room to start one
FORKSERVER_TRIES = 3  # forkserver failures in a row after which children start with spawn


class ChildStartFailed(RuntimeError):
    """No child process could be started for a job: it did nothing (see child_starts)."""


class ChildFailure(Exception):
    """A handler's exception, as reported by the child process that ran it."""

    def __init__(
        self,
        type_name: str,
        message: str,
        trace: str,
        kind: str,
        after: float | None = 0.0,
        landing: MaybeLanded | None = None,
    ):
        super().__init__(message)
        self.type_name = type_name
        self.trace = trace
        self.kind = kind  # permanent | retry | transient | crash | suspend (after: timeout)
        self.after = after
        # its ctx.transaction()'s COMMIT failed on a connection error: it may have landed
        self.landing = landing


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
PRELOAD = ("errands.loading", __name__, "errands.worker.dispatch")  # (and process_child)
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

    def _spawn(self, replacing: _Slot | None = None) -> _Slot:
        """Start a child; a start that fails is counted (:class:`StartFailures`): as a
        miss, raising :class:`_OthersRun`, while other children live (``replacing``, the
        one whose place it takes, is not one of them), else as a failure."""
        try:
            slot = self._start_one()
        except Exception as exc:
            if self._closed:  # closing: a start cut short is no news
                raise
            with self._cond:
                others = sum(1 for s in self._slots if s is not replacing and not s.killed)
            if not others:
                self.failures.failed(exc)
                raise
            self.failures.missed(exc, others)
            raise _OthersRun(f"{type(exc).__name__}: {exc}") from exc
        self.failures.started()
        return slot

    def hopeless(self) -> bool:
        """Whether children have kept failing to start long enough to give up on them, and
        none lives: a pool short of some children still runs its jobs."""
        return self.failures.hopeless() and not self.pids()

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
        try:
            threading.Thread(
                target=self._serve, args=(row, future, on_progress), name="errands-child-job",
                daemon=True,
            ).start()  # fmt: skip
        except RuntimeError as exc:
            # "can't start new thread": the limits that refuse a fork refuse a thread too
            # (RLIMIT_NPROC, a cgroup's pids.max). The job did nothing: as a child that
            # cannot start, it is released uncharged and the failure counted (it was the
            # job's failure, charged: each job claimed meanwhile burnt an attempt, on its
            # last one into the dead-letter queue, and no claim paused).
            if not self._closed:
                self.failures.failed(exc)
            failed = ChildStartFailed(
                "no thread could be started to hand it to a worker child process: "
                f"{type(exc).__name__}: {exc}"
            )
            failed.__cause__ = exc
            _settle(future, exc=failed)
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
        if slot is None:
            return
        try:
            self._top_up()
        except Exception:  # (it raises nothing it foresees) the job has its child: it runs
            log.exception("could not start spare worker child processes")
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
                # for ever then (-c 1: the whole worker). A start missed while other
                # children run makes the room wait until another start may be tried.
                while (
                    not self._free and not self._closed and not self._may_grow()
                ) and not future.done():
                    self._cond.wait(timeout=min(ROOM_RECHECK, self._grow_wait()))
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
        (a burst's jobs each start theirs at once, not one after another). A start that
        fails while other children live leaves the job waiting for one of them (the
        failure said by StartFailures); raises when none lives."""
        with self._cond:
            if self._free or self._closed or not self._may_grow():
                return
            self._starting += 1
        with contextlib.suppress(_OthersRun):
            self._start_counted("a worker child process")

    def _may_grow(self) -> bool:
        """Whether a child may be started now: there is room, and no start missed while
        other children ran asks to wait (call under ``_cond``)."""
        return self._room() > 0 and self.failures.retry_left() <= 0

    def _grow_wait(self) -> float:
        """Seconds a job waiting for a child waits before it looks again (at most)."""
        return self.failures.retry_left() or ROOM_RECHECK

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
        started = 0
        try:
            for _ in range(count):
                threading.Thread(
                    target=self._start_spare, name="errands-child-start", daemon=True
                ).start()
                started += 1
        except RuntimeError as exc:  # "can't start new thread" (RLIMIT_NPROC, pids.max)
            log.warning(
                "could not start a thread to start a spare worker child process (%s); the "
                "next job starts its child itself",
                exc,
            )
        finally:
            if started < count:  # their places were counted as starting: room again
                with self._cond:
                    self._starting -= count - started
                    self._cond.notify_all()

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
            # The pipe's end: the child died, or closed its end and runs on (a handler
            # that closes inherited descriptors, as daemonising code does). Such a child
            # was taken for dead and its job retried beside it (one job running in three
            # processes at once), each retry charged as a crash toward its poison limit,
            # and it outlived its worker. It is killed, and its end waited for, before
            # the outcome is written; a crash only when it died on its own.
            died, code = _end(slot.process)
            if died:
                failure = ChildFailure(
                    "WorkerProcessDied",
                    f"the worker child process died running this job (exit code {code})",
                    "",
                    "crash",
                )
            else:
                failure = ChildFailure(
                    "WorkerProcessLost",
                    "the worker child process running this job closed its pipe to the "
                    "worker but ran on, so its outcome could never be reported; it was "
                    "killed (does the handler close inherited file descriptors, as "
                    "daemonising code does? run such code in a subprocess of its own)",
                    "",
                    "transient",
                )
            # the outcome first; the replacement may take a while
            _settle(future, exc=failure)
            self._replace(slot)
            return
        except BaseException as exc:  # errands' side failed (an answer it cannot read): the
            # child may still be running the job, which is failed (retried, not charged
            # toward poison) and its child replaced
            from ..observability.logcontext import job_extra

            log.exception(
                "job %s: lost track of its worker child process", row.id, extra=job_extra(row)
            )
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
        while is_progress(message):
            if on_progress is not None and message[1] == attempt_of(row):
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
        """Start a child in the place of ``slot``'s, which has ended or is killed here
        first: never two children for one place, nor a replaced one left running (it
        ran on beside its job's retry, and outlived its worker)."""
        _end(slot.process, wait=5.0)
        with self._cond:
            if self._closed:
                return
        try:
            fresh = self._spawn(replacing=slot)
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


class _OthersRun(RuntimeError):
    """A child could not start while other children of the runner live: a job waits for
    one of them (see :meth:`StartFailures.missed`)."""


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
            if not is_progress(slot.conn.recv()):
                return False
    except Exception:  # the end of the pipe (EOFError), a broken one, an unreadable message
        return False
    return slot.process.is_alive() or _pid_alive(slot.process.pid)


def _end(process: Any, wait: float = 2.0) -> tuple[bool, int | None]:
    """Wait up to ``wait`` seconds for ``process`` to exit, then kill it (SIGKILL) and
    wait for that: whether it had ended on its own, and its exit code when known."""
    process.join(timeout=wait)
    if not _running(process):
        return True, process.exitcode
    with contextlib.suppress(OSError, ValueError):  # (gone meanwhile)
        if process.exitcode is None:
            process.kill()
        else:  # its server died: the process object no longer signals it
            os.kill(process.pid, signal.SIGKILL)
    process.join(timeout=STOP_WAIT)
    deadline = time.monotonic() + STOP_WAIT
    while _running(process) and time.monotonic() < deadline:  # (no server to tell us)
        time.sleep(0.05)
    return False, process.exitcode


def _running(process: Any) -> bool:
    """Whether ``process`` runs: no exit code yet, or the 255 a forkserver child is given
    when its server dies (see :func:`_pid_alive`) while its pid still runs."""
    if process.exitcode is None:
        return True
    forked_by_a_server = type(process).__name__ == "ForkServerProcess"
    return forked_by_a_server and process.exitcode == 255 and _pid_alive(process.pid)


def _settle(future: Future[Any], *, result: Any = None, exc: BaseException | None = None) -> None:
    """Settle ``future`` with ``exc`` (or ``result``), unless it is settled already (a
    kill and the child's answer may race)."""
    with contextlib.suppress(InvalidStateError):
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)


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


def _logging() -> tuple[str, int] | None:
    """How this worker logs (format and level), for its children to log alike; None when
    it set up no logging of errands' (an embedded worker: its app's logging rules)."""
    from ..observability import logcontext

    fmt = logcontext.current_format()
    return None if fmt is None else (fmt, logging.getLogger().level)
