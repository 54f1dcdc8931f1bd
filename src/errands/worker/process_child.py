"""The child's side of the process pool (:mod:`.process_pool`): the loop a worker's child
process runs, and what it says to its worker.

A child imports the app, says READY (or why it cannot start), then runs one job per
message until told to stop (None) or its worker is gone: it answers each job with
``(True, ChildResult)`` or ``(False, failure)``, a failure being the handler's exception
as ``(type name, message, traceback, kind, after)`` (then a :class:`MaybeLanded` when
its transaction's COMMIT may have gone through), and while a job runs it may send
``(PROGRESS, attempt, fraction, message)`` reports. Whatever fails around the handler is
the job's failure, never the child's death: a child that died took a job recorded as a
crash, charged toward its poison limit, with it.
"""

from __future__ import annotations

import contextlib
import contextvars
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errortext import clip, format_trace, scrub
from ..jobs import EnqueueRequest, JobRow

if TYPE_CHECKING:  # (imported when used: the completer's imports lead back here)
    from .completer import Unsure

READY = "ready"
# A child's message during a run: (PROGRESS, attempt, fraction, message), ``attempt`` the
# job's (id, lease token): a report sent after its job's outcome (by a thread the handler
# left running) belongs to no job that runs, and is no sign of the child's death.
PROGRESS = "progress"
PROGRESS_EVERY = 0.1  # seconds: a handler reporting in a tight loop floods no pipe
# A child whose worker died exits with this code (os._exit: its handler is cut short).
ORPHAN_EXIT = 3
# A failure's kind: the job's ctx.transaction() met a store that cannot write now (full,
# read-only), as its COMMIT or a statement of the handler's in it: not the job's failure,
# the worker gives it back (uncharged, after a growing pause)
UNWRITABLE = "unwritable"

Progress = Callable[[tuple[float, str]], None]


@dataclass
class ChildResult:
    result_json: str | None
    children: list[EnqueueRequest] = field(default_factory=list)
    written: bool | None = None  # set when the child committed its own transaction
    # what that transaction's workflow fan-in settled and released, for the worker to
    # announce (events, metrics, its own wake-up) as it does for its own threads'
    settled: list[Any] = field(default_factory=list)
    released: set[str] = field(default_factory=set)


@dataclass
class MaybeLanded:
    """Sent with the failure of a job whose ctx.transaction() COMMIT failed on a
    connection error: it may have gone through before it (its reply lost). The worker
    hands the completion to its completer (:meth:`.completer.Completer.maybe_landed`)
    before it writes the failure: if the fence refuses that, the job is read back (again
    while the store is out of reach) and a completion found there is the attempt's
    outcome, reported with ``fan_ins``, as for a worker thread's transaction. The child
    read the job back itself, once: a second failure of the store (still away) had the
    worker write the failure, which the fence refused: reported as a stale write, the
    completion and its workflow's settlement never announced."""

    result_json: str | None
    fan_ins: Unsure  # what the transaction's workflow fan-in did, had it committed


def attempt_of(row: JobRow) -> tuple[int, str | None]:
    """What a progress report names its attempt by: the job's id and lease token."""
    return row.id, row.lease_token


def is_progress(message: Any) -> bool:
    return type(message) is tuple and len(message) == 4 and message[0] == PROGRESS


def _outlived(signum: int, frame: Any) -> None:
    """A worker child's SIGINT, SIGTERM and SIGHUP: its worker decides when it stops."""


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
        from ..observability.logcontext import lockless_line

        _wait_for_the_worker(parent.sentinel, parent.pid)
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


WATCH_EVERY = 1.0  # seconds between a child's looks at its worker when its sentinel is lost


def _wait_for_the_worker(sentinel: int, pid: int | None) -> None:
    """Return once the worker (``pid``, whose end of the ``sentinel`` pipe closes as it
    exits) is gone.

    A handler may close the sentinel: daemonising code's ``os.closerange(3, ...)`` does,
    and the descriptor's number is then reused by whatever it opens next. A wait on it
    then watched another file: the worker's death was missed (the child ran its job on
    beside the rescued run), or a file always ready was taken for it. So the sentinel is
    trusted only while its descriptor is still the pipe it was; once it is not (or a wait
    on it fails), the worker's pid is looked at every WATCH_EVERY seconds instead."""
    from multiprocessing.connection import wait

    pipe = _identity(sentinel)
    while pipe is not None:
        try:
            ready = wait([sentinel], timeout=WATCH_EVERY)
        except (OSError, ValueError):  # closed under the wait
            break
        if _identity(sentinel) != pipe:  # closed (and maybe reused): it tells nothing now
            break
        if ready:
            return
    while not _gone(pid):
        time.sleep(WATCH_EVERY)


def _identity(fd: int) -> tuple[int, int] | None:
    """What file descriptor ``fd`` is open on (None: closed)."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _gone(pid: int | None) -> bool:
    """Whether process ``pid`` has exited (a zombie not yet reaped has)."""
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # (its pid taken by another user's process)
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] == b"Z"
    except (OSError, IndexError):
        return False  # no /proc (not Linux): alive as far as anyone can tell


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
    from ..observability.logcontext import configure_logging, install_record_factory

    install_record_factory()  # a job's records carry its id here too, as in the worker
    if logs is not None:
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
                outcome = contextvars.copy_context().run(  # a context per job, as a thread's
                    _run_one, app, row, worker_id or f"child-{os.getpid()}", reporter, app_path
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
    attempt (:meth:`for_attempt`); only the running attempt's are sent.

    A report of an earlier attempt (from a thread its handler left running) is dropped
    here: the parent would ignore it, and held in the one slot reports wait in, it
    replaced the running attempt's latest report, which was then never sent (a stale
    thread reporting every few milliseconds left the running job with no progress)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.sent_at = 0.0
        self.held: tuple[tuple[int, str | None], float, str] | None = None
        self.running: tuple[int, str | None] | None = None  # the attempt this child runs
        threading.Thread(target=self._flusher, name="errands-progress", daemon=True).start()

    def for_attempt(self, row: JobRow) -> Progress:
        """Where the attempt of ``row``, which begins now, reports its progress."""
        attempt = attempt_of(row)
        with self.lock:
            self.running = attempt
        return lambda report: self._report(attempt, report)

    def _report(self, attempt: tuple[int, str | None], report: tuple[float, str]) -> None:
        with self.lock:
            if attempt != self.running:  # an earlier attempt's: see the class
                return
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
            self.running = None  # its reports from now on are stale
            self.conn.send(outcome)


def _failure(
    exc: BaseException, kind: str, after: float | None = 0.0, secrets: list[str] | None = None
) -> tuple[Any, ...]:
    """An exception as the parent's :class:`ChildFailure` takes it. Its text is user code
    and may raise: such an exception is recorded as ``<unprintable ValueError>``, never
    left to end the child. Its message and traceback are clipped here as the parent's
    error entry clips them (errands.errortext: no megabytes through the pipe), after
    ``secrets`` (the job's sensitive values) are scrubbed: a cut leaves no part of one.
    A suspension's message is the signal's name, sent whole."""

    def clean(text: str) -> str:
        return scrub(text, secrets or [])

    name = type(exc).__qualname__
    try:
        message = str(exc) if kind == "suspend" else clip(clean(str(exc)))
    except Exception:
        message = f"<unprintable {name}>"
    try:
        trace = format_trace(exc, clean)
    except Exception:
        trace = f"<traceback of an unprintable {name}>"
    return name, message, trace, kind, after


def _unknown_here(name: str, app_path: str) -> tuple[Any, ...]:
    """A job type the worker's app has and its child's lacks: a transient failure,
    retried with backoff, as the worker's own UnknownJob is. Version skew makes it: a
    child started with spawn, or from a forkserver started afresh, imports the app's code
    from disk, which a deploy may have changed under a worker still running the old; a
    retry may meet a child (or a worker) that has the type. Permanent, it sent the job
    to the dead-letter queue at once. The message names the type and the fix."""
    module = app_path.partition(":")[0]
    message = (
        f"job type {name!r} is not registered in the app this worker's child processes "
        f"load ({app_path!r}), though the worker's own app has it (retried with backoff). "
        f"The child's app must define it: register the job where importing {module!r} "
        "registers it (a job added only by the script that starts the worker, or by a "
        "module only it imports, never reaches the children); after a deploy, restart "
        "the worker (its children may have imported code newer than its own)"
    )
    return "UnknownJob", message, "", "transient", 0.0


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
    from ..observability.logcontext import JobLogContext, job_context
    from ..outcomes import Permanent, Retry
    from .dispatch import encode, leave_if_forked
    from .execution import Attempt, Suspended, _secrets, context_for, outcome_for
    from .recorder import job_fields
    from .runtime import AttemptRuntime

    definition = app.registry.get(row.name)
    if definition is None:
        return False, _unknown_here(row.name, app_path)
    attempt = Attempt(row=row, definition=definition, lease_seconds=row.lease_seconds or 30.0)
    runtime = attempt.runtime = AttemptRuntime(app, attempt)
    runtime.lease_kept_here = False  # the parent renews the lease, and stops this child
    runtime.report_progress = reporter.for_attempt(row) if reporter is not None else None
    try:
        # As in the worker's own threads: every record carries the job's fields, and the
        # app's handler wrappers (tracing's process span) are entered around the call
        # (neither was, here: a process-pool job's log lines had no job id, no span).
        with job_context(JobLogContext(row.id, row.name, row.queue, row.attempt)):
            kwargs = definition.payload.decode(row.args)
            attempt.kwargs = kwargs
            ctx = context_for(row, definition, worker_id, runtime)
            call = dict(kwargs)
            if definition.payload.context_param:
                call[definition.payload.context_param] = ctx
            # no outcome event here (the worker records it): its wrappers end what
            # they began as the handler returns (tracing: ENDS_HERE)
            info = {**job_fields(row), "meta": row.meta, "ends_here": True}
            pid = os.getpid()
            with app.events.around_handler(info):
                try:
                    value = definition.fn(**call)
                    if inspect.isawaitable(value):  # an async def handler: its own loop here
                        value = asyncio.run(_awaited(value))
                finally:
                    leave_if_forked(pid, row.id)
                    # no step or transaction starts now (ctx.atransaction()'s thread ends)
                    runtime.close()
            result_json = encode(definition, value)
            if runtime.tx is not None:
                runtime.check_transaction()  # raises if the handler ended it
    except BaseException as exc:
        # as the worker's recorder judges it (a handler that committed through .raw and
        # then raised was retried here, and repeated the writes it had committed)
        unwritable = runtime.met_unwritable(exc)  # (first: see AttemptRuntime.met_unwritable)
        ended = runtime.ended_then_failed()
        if ended is None and unwritable:
            # its ctx.transaction() met a store that cannot write (its own statement, or
            # its opening): nothing written, the parent gives the job back uncharged
            runtime.rollback()
            return False, _failure(exc, UNWRITABLE, secrets=_secrets(attempt))
        exc = ended or exc
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
        return False, _failure(exc, kind, after, _secrets(attempt))
    written = None
    if runtime.tx is not None:
        from dataclasses import replace

        outcome = outcome_for(attempt, None, result_json, worker_id)
        if runtime.children:
            outcome = replace(outcome, children=tuple(runtime.children))
        taken = runtime.take_transaction()
        assert taken is not None  # nothing else ends a child's transaction
        backend, tx = taken
        try:
            written = backend.tx_finish(tx, outcome)
        except Exception as exc:
            from ..errors import cannot_write_now, is_transient

            secrets = _secrets(attempt)
            if cannot_write_now(exc):  # nothing written: the parent gives the job back
                return False, _failure(exc, UNWRITABLE, secrets=secrets)
            if not is_transient(exc):
                return False, _failure(exc, "transient", secrets=secrets)  # retried
            # Its COMMIT may have gone through before the error (its reply lost): the
            # worker writes the failure, and reads the job back if the fence refuses it,
            # as for its own threads' (Completer.maybe_landed; see MaybeLanded)
            landing = MaybeLanded(result_json, _fan_ins(backend))
            return False, (*_failure(exc, "transient", secrets=secrets), landing)
        settled = backend.workflow_take_settled()
        released = backend.workflow_take_released()
        return True, ChildResult(result_json, [], written, settled, released)
    return True, ChildResult(result_json, list(runtime.children), written)


def _fan_ins(backend: Any) -> Unsure:
    """What the workflow fan-in of a transaction whose COMMIT failed did, if it committed:
    this thread's record, read now (the worker reports it if the completion landed)."""
    from .completer import Unsure

    kept = Unsure()
    kept.take(backend)
    return kept


async def _awaited(value: Any) -> Any:
    return await value
