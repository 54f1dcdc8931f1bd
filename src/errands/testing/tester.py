"""``errands.testing.Tester``: run an App's jobs inside a test (DESIGN §10).

Modes:

- ``manual`` (the default): ``enqueue`` stores jobs in the real store and nothing runs
  until the test says so. :meth:`Tester.assert_enqueued`, :meth:`Tester.refute_enqueued`
  and :meth:`Tester.all_enqueued` look at what is pending; :meth:`Tester.drain` runs
  what is due, one job at a time, through the real worker code, moving the test clock
  over retry backoffs instead of sleeping.
- ``inline``: ``enqueue`` stores the job (serialised and validated as always) and runs it
  at once — and whatever it enqueues — through the same worker code, so it is decoded
  from the stored JSON like in production; if a job ends dead, ``enqueue`` raises what
  its handler raised.
- a real in-process worker: ``with tester.worker(): ...`` runs a worker in a thread.

Fault injection (:meth:`Tester.fail_attempt`, :meth:`Tester.crash_after_step`,
:meth:`Tester.crash_before_completion`) applies in every mode, and
:meth:`Tester.drain_duplicated` delivers every job twice to find handlers whose effects
are not idempotent. docs/testing.md describes all of it.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic_core import to_jsonable_python

from ..definition import JobDefinition
from ..errors import ConfigurationError, JobFailed
from ..forking import fresh_lock_at_fork
from ..handle import JobHandle
from ..jobs import Job
from ..maintenance import Maintenance
from ..observability.logcontext import current_job
from ..worker.execution import Attempt
from ..workflows import WorkflowHandle, WorkflowStatus
from . import faults
from ._store import PENDING, store_tools
from ._worker import HarnessWorker
from .clock import Clock
from .results import Difference, DrainResult, DuplicateReport, Run

if TYPE_CHECKING:
    from ..app import App

Mode = Literal["manual", "inline"]
JobRef = JobDefinition[Any, Any] | JobHandle | str
EffectsSnapshot = Callable[[], Any]

MAX_RUNS_DEFAULT = 10_000
EPSILON = 0.001  # seconds past a due time the clock lands on


class InjectedFailure(Exception):
    """The default exception :meth:`Tester.fail_attempt` raises."""


@dataclass
class _Target:
    """Which jobs a fault applies to: every job of a type, or one job."""

    name: str
    job_id: int | None = None

    def matches(self, name: str, job_id: int) -> bool:
        return name == self.name and (self.job_id is None or self.job_id == job_id)


@dataclass
class _FailRule:
    target: _Target
    attempt: int
    error: BaseException | type[BaseException]
    after_handler: bool
    fired: set[int] = field(default_factory=set)

    def make_error(self) -> BaseException:
        if isinstance(self.error, BaseException):
            return self.error
        return self.error(f"injected failure on attempt {self.attempt}")


@dataclass
class _CrashRule:
    target: _Target
    step: str | None  # None: before the outcome is written
    attempt: int | None
    fired: set[int] = field(default_factory=set)

    def take(self, name: str, job_id: int, attempt: int, step: str | None) -> bool:
        if not self.target.matches(name, job_id) or job_id in self.fired or step != self.step:
            return False
        if self.attempt is not None and attempt != self.attempt:
            return False
        self.fired.add(job_id)
        return True


@dataclass
class _DuplicatePlan:
    effects: EffectsSnapshot
    variant: Literal["duplicate", "crash"]
    report: DuplicateReport
    current: int | None = None  # the job whose first successful run is crashed (crash variant)


class Tester:
    """Run one App's jobs inside tests. See the module docstring and docs/testing.md.

    ``url``: use this store instead of the App's for the tester's lifetime (the App is
    pointed back when the tester closes). ``raise_errors`` (inline mode): re-raise what a
    job that ended dead raised. ``attempt_timeout``: how long ``drain()`` waits for one
    handler before giving up. Use it as a context manager, or call :meth:`close`.
    """

    __test__ = False  # a tool, not a test class, when imported into a test module

    def __init__(
        self,
        app: App,
        mode: Mode = "manual",
        *,
        clock: Clock | None = None,
        url: str | None = None,
        raise_errors: bool = True,
        attempt_timeout: float = 60.0,
    ) -> None:
        if mode not in ("manual", "inline"):
            raise ConfigurationError(
                f"Tester mode {mode!r}: choose 'manual' (the default) or 'inline'; for a real "
                "worker use `with tester.worker(): ...`"
            )
        self.app = app
        self.mode: Mode = mode
        self.raise_errors = raise_errors
        self.attempt_timeout = attempt_timeout
        self.history: list[Run] = []
        self._lock = threading.RLock()
        self._closed = False
        self._saved_url: str | None = None
        if url is not None:
            self._saved_url = app.url
            app.close()
            app.url = url
        self.clock = clock if clock is not None else Clock()
        self.clock.bind(app, self._live_tokens)
        self._driver: HarnessWorker | None = None
        self._maintenance: Maintenance | None = None
        self._workers: list[HarnessWorker] = []
        self._fail_rules: list[_FailRule] = []
        self._crash_rules: list[_CrashRule] = []
        self._wrapped: dict[str, Callable[..., Any]] = {}  # job name -> the original fn
        self._armed_after_step = False
        self._draining = False
        self._plan: _DuplicatePlan | None = None
        self._enqueue_saved: dict[str, Any] = {}
        if mode == "inline":
            self._install_inline()

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> Tester:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Undo everything the tester changed: enqueue, handlers, faults, workers, store."""
        if self._closed:
            return
        self._closed = True
        if self.mode == "inline":
            for name, saved in self._enqueue_saved.items():
                if saved is _NOTHING:
                    self.app.__dict__.pop(name, None)
                else:
                    self.app.__dict__[name] = saved
        for name, original in self._wrapped.items():
            definition = self.app.registry.get(name)
            if definition is not None:
                definition.fn = original
        self._wrapped.clear()
        if self._armed_after_step:
            _stop_crashing_after_steps(self)
        if self._driver is not None:
            self._driver.stop_services()
            self._driver = None
        if self._saved_url is not None:
            self.app.close()
            self.app.url = self._saved_url

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigurationError("this Tester is closed")

    # -- what the store holds ----------------------------------------------------------------
    def all_enqueued(
        self,
        job: JobRef | None = None,
        /,
        *,
        args: Mapping[str, Any] | None = None,
        queue: str | None = None,
        key: str | None = None,
        parent_id: int | None = None,
        states: Sequence[str] = PENDING,
        **arg_subset: Any,
    ) -> list[Job]:
        """Jobs waiting to run (``states``: scheduled, available, retryable), oldest first.

        ``job`` (a job function, a handle or a job name) narrows to one type; keyword
        arguments (or ``args={...}`` for names that clash with these options) must all be
        among the job's arguments with equal values.
        """
        self._check_open()
        name, job_id = _name_and_id(job)
        expected = {**(args or {}), **arg_subset}
        found: list[Job] = []
        for state in states:
            found.extend(
                self.app.jobs(
                    state=state, name=name, queue=queue, parent_id=parent_id, limit=100_000
                )
            )
        found.sort(key=lambda j: j.id)
        return [
            j
            for j in found
            if (job_id is None or j.id == job_id)
            and (key is None or j.idempotency_key == key)
            and self._args_match(j, expected)
        ]

    def assert_enqueued(
        self,
        job: JobRef,
        /,
        *,
        args: Mapping[str, Any] | None = None,
        queue: str | None = None,
        key: str | None = None,
        parent_id: int | None = None,
        **arg_subset: Any,
    ) -> Job:
        """Assert at least one pending job matches (see :meth:`all_enqueued`); return the
        oldest match."""
        found = self.all_enqueued(
            job, args=args, queue=queue, key=key, parent_id=parent_id, **arg_subset
        )
        if found:
            return found[0]
        name, _ = _name_and_id(job)
        wanted = {**(args or {}), **arg_subset}
        raise AssertionError(
            f"expected a pending {name} job with {_describe(wanted, queue, key, parent_id)}; "
            f"{self._pending_summary(name)}"
        )

    def refute_enqueued(
        self,
        job: JobRef,
        /,
        *,
        args: Mapping[str, Any] | None = None,
        queue: str | None = None,
        key: str | None = None,
        parent_id: int | None = None,
        **arg_subset: Any,
    ) -> None:
        """Assert no pending job matches (see :meth:`all_enqueued`)."""
        found = self.all_enqueued(
            job, args=args, queue=queue, key=key, parent_id=parent_id, **arg_subset
        )
        if found:
            name, _ = _name_and_id(job)
            wanted = {**(args or {}), **arg_subset}
            listing = "; ".join(f"job {j.id} args={j.masked_args}" for j in found[:5])
            raise AssertionError(
                f"expected no pending {name} job with "
                f"{_describe(wanted, queue, key, parent_id)}, found {len(found)}: {listing}"
            )

    def _args_match(self, job: Job, expected: Mapping[str, Any]) -> bool:
        if not expected:
            return True
        stored = job.args if isinstance(job.args, dict) else {}
        decoded: dict[str, Any] | None = None
        definition = self.app.registry.get(job.name)
        if definition is not None:
            try:
                decoded = definition.payload.decode(_dumps(stored))
            except Exception:
                decoded = None
        for name, value in expected.items():
            if decoded is not None and name in decoded and decoded[name] == value:
                continue
            if name in stored and stored[name] == _jsonable(value):
                continue
            if (
                decoded is not None
                and name in decoded
                and _jsonable(decoded[name]) == _jsonable(value)
            ):
                continue
            return False
        return True

    def _pending_summary(self, name: str | None) -> str:
        pending = self.all_enqueued(name)
        if not pending:
            return "none is pending" if name else "no job is pending"
        listing = "; ".join(f"job {j.id} args={j.masked_args}" for j in pending[:5])
        more = f" (and {len(pending) - 5} more)" if len(pending) > 5 else ""
        return f"pending: {listing}{more}"

    # -- running jobs ------------------------------------------------------------------------------
    def drain(
        self,
        queue: str | None = None,
        *,
        with_retries: bool = True,
        with_scheduled: bool = False,
        max_runs: int = MAX_RUNS_DEFAULT,
    ) -> DrainResult:
        """Run every due job (of ``queue``, or all queues) one at a time, through the real
        worker code, until none is due; jobs they enqueue run too.

        ``with_retries``: when nothing is due but failed attempts wait out a backoff (or a
        crashed attempt's lease has to expire first), advance the clock to the next one
        and go on, until every job is finished. ``with_scheduled``: advance the clock to
        scheduled (delayed) jobs too. ``max_runs`` stops a job that re-enqueues itself
        forever.
        """
        self._check_open()
        return self._drain(queue, with_retries, with_scheduled, max_runs)

    def drain_duplicated(
        self,
        effects: EffectsSnapshot,
        *,
        crash: bool = False,
        queue: str | None = None,
        with_retries: bool = True,
        with_scheduled: bool = False,
        max_runs: int = MAX_RUNS_DEFAULT,
    ) -> DuplicateReport:
        """Drain like :meth:`drain`, delivering every job twice, and report the jobs whose
        recorded effects changed because of the second delivery.

        ``effects()`` returns a comparable snapshot of what the handlers did (rows in a
        table, calls to a fake API...); it is taken after the first delivery and again
        after the second.

        - default (``crash=False``): once a job completes, it is delivered again as a
          stale worker would run it (same job, arguments, key and stored steps; its lease
          token no longer current, so its completion, transaction and children are
          refused). An idempotent handler leaves the effects as they were.
        - ``crash=True``: a job's first attempt that returns is treated as a crash just
          before its completion commits (its transaction rolls back, its children are
          dropped, its steps stay), then it is delivered again; that second delivery must
          not add effects either. The job is then rescued and completes normally (give
          such jobs at least one retry).
        """
        self._check_open()
        variant: Literal["duplicate", "crash"] = "crash" if crash else "duplicate"
        report = DuplicateReport(variant, DrainResult())
        plan = _DuplicatePlan(effects, variant, report)
        report.drain = self._drain(queue, with_retries, with_scheduled, max_runs, plan)
        return report

    def drain_workflow(
        self, workflow: WorkflowHandle | int, *, max_runs: int = MAX_RUNS_DEFAULT
    ) -> WorkflowStatus:
        """Drain (retries and scheduled jobs included) until the workflow settled and the
        callbacks it fired ran; its final status. AssertionError, naming the members
        still pending, when it cannot settle (a paused queue, a job of another App)."""
        self._check_open()
        workflow_id = workflow if isinstance(workflow, int) else workflow.id
        self._drain(None, True, True, max_runs)
        status = self.app.workflow_status(workflow_id)
        if not status.settled:
            stuck = [
                f"{m.node} (job {m.job_id}, {m.state})"
                for m in self.app.workflow_members(workflow_id)
                if m.outcome is None
            ]
            raise AssertionError(
                f"workflow {workflow_id} ({status.name}) did not settle: "
                f"{status.pending} of {status.total} members pending: {', '.join(stuck)}"
            )
        return status

    def assert_callbacks(self, workflow: WorkflowHandle | int, *events: str) -> None:
        """Assert exactly ``events`` (``on_success``, ``on_settled``, ``on_dead``) of the
        workflow fired, each once (a callback fires at most once by construction)."""
        workflow_id = workflow if isinstance(workflow, int) else workflow.id
        status = self.app.workflow_status(workflow_id)
        fired = sorted(event for event, job_id in status.callbacks.items() if job_id is not None)
        if fired != sorted(events):
            raise AssertionError(
                f"workflow {workflow_id} ({status.name}, {status.state}): expected callbacks "
                f"{sorted(events)} to have fired, fired {fired}"
            )

    def _driver_worker(self) -> HarnessWorker:
        with self._lock:
            if self._driver is None:
                driver = HarnessWorker(
                    self.app, self, concurrency=1, maintenance=False, poll_interval=0.05
                )
                driver.start_services()
                self._driver = driver
                self._maintenance = Maintenance(self.app, driver.id)
            return self._driver

    def _drain(
        self,
        queue: str | None,
        with_retries: bool,
        with_scheduled: bool,
        max_runs: int,
        plan: _DuplicatePlan | None = None,
    ) -> DrainResult:
        driver = self._driver_worker()
        tools = store_tools(self.app.backend)
        result = DrainResult()
        with self._lock:
            if self._draining:
                raise ConfigurationError("drain() is already running (called from a handler?)")
            self._draining = True
            self._plan = plan
        stalled = False
        try:
            while True:
                queues = [queue] if queue is not None else tools.pending_queues()
                row = driver.claim_one(queues)
                if row is not None:
                    stalled = False
                    if len(result) >= max_runs:
                        driver.release_row(row)  # never run: given back, nothing recorded
                        raise RuntimeError(
                            f"drain() ran {max_runs} attempts and jobs are still due; does a "
                            "job enqueue itself forever? (raise max_runs= if not)"
                        )
                    if plan is not None and plan.variant == "crash":
                        plan.current = None if row.id in plan.report.checked else row.id
                    run = driver.run_row(row, timeout=self.attempt_timeout)
                    result.runs.append(run)
                    if plan is not None:
                        self._deliver_again(driver, plan, row, run, result)
                    continue
                if not with_retries:
                    break
                wait = tools.next_wakeup(queue, with_scheduled, self._live_tokens())
                if wait is None or (wait <= 0 and stalled):
                    break  # nothing left, or what is left cannot be claimed (paused queue)
                step = max(wait, 0.0) + EPSILON
                self.clock.advance(step)
                result.advanced += step
                assert self._maintenance is not None
                rescued = self._maintenance.rescue()
                result.rescued += rescued
                # a signal's wait past its timeout: a failed attempt, as the leader records it
                expired = self._maintenance.expire_waits()
                # Something due that no claim takes and no rescue moves: a paused queue.
                stalled = wait <= 0 and rescued == 0 and expired == 0
        finally:
            with self._lock:
                self._draining = False
                self._plan = None
        return result

    def _deliver_again(
        self,
        driver: HarnessWorker,
        plan: _DuplicatePlan,
        row: Any,
        run: Run,
        result: DrainResult,
    ) -> None:
        if row.id in plan.report.checked:
            return
        if plan.variant == "duplicate" and run.outcome != "completed":
            return
        if plan.variant == "crash" and not (run.outcome == "crashed" and plan.current == row.id):
            return
        plan.current = None
        before = plan.effects()
        again = driver.run_row(row, duplicate=True, timeout=self.attempt_timeout)
        result.runs.append(again)
        after = plan.effects()
        plan.report.checked.append(row.id)
        if before != after:
            difference = Difference(row.id, row.name, plan.variant, before, after)
            plan.report.differences.append(difference)

    @contextmanager
    def worker(self, **options: Any) -> Iterator[HarnessWorker]:
        """A real worker in a thread of this process, with this tester's faults; stopped
        gracefully on exit. Options as ``errands.worker.Worker`` (``queues``,
        ``concurrency``...); polling and maintenance are fast by default."""
        self._check_open()
        options.setdefault("poll_interval", 0.05)
        options.setdefault("maintenance_tick", 0.1)
        running = HarnessWorker(self.app, self, **options)
        thread = threading.Thread(
            target=running.run,
            kwargs={"install_signals": False},
            name="errands-testing-worker",
            daemon=True,
        )
        with self._lock:
            self._workers.append(running)
        thread.start()
        try:
            yield running
        finally:
            running.stop()
            thread.join(timeout=60)
            with self._lock:
                self._workers.remove(running)
            if thread.is_alive():
                raise RuntimeError("the in-process worker did not stop within 60 s")

    def wait_idle(self, timeout: float = 10.0, *, queue: str | None = None) -> None:
        """Wait until no job is due or running (with a worker from :meth:`worker`)."""
        deadline = time.monotonic() + timeout
        tools = store_tools(self.app.backend)
        while tools.busy(queue):
            if time.monotonic() >= deadline:
                busy = self.all_enqueued(queue=queue, states=("available", "running"))
                raise AssertionError(
                    f"jobs still due or running after {timeout:g} s: "
                    + ", ".join(f"{j.id} {j.name} {j.state.value}" for j in busy[:10])
                )
            time.sleep(0.02)

    def _live_tokens(self) -> set[str]:
        tokens: set[str] = set()
        with self._lock:
            workers = [*self._workers, *([self._driver] if self._driver else [])]
        for w in workers:
            tokens |= w.live_tokens()
        return tokens

    # -- inline mode -------------------------------------------------------------------------------
    # The App's enqueue paths inline mode runs at once (each stored, then drained): an
    # async enqueue or a workflow was stored and left pending while enqueue_many ran.
    INLINE = ("enqueue_many", "aenqueue_many", "enqueue_workflow", "aenqueue_workflow")

    def _install_inline(self) -> None:
        app = self.app
        self._enqueue_saved = {n: app.__dict__.get(n, _NOTHING) for n in self.INLINE}
        many, amany = app.enqueue_many, app.aenqueue_many
        flow, aflow = app.enqueue_workflow, app.aenqueue_workflow

        @functools.wraps(many)
        def enqueue_many(jobs: Sequence[Any], conn: Any = None) -> list[JobHandle]:
            _no_caller_transaction(conn)
            handles = many(jobs, conn=None)
            self._run_inline([h.id for h in handles if not h.deduplicated])
            return handles

        @functools.wraps(amany)
        async def aenqueue_many(jobs: Sequence[Any], conn: Any = None) -> list[JobHandle]:
            _no_caller_transaction(conn)
            handles = await amany(jobs, conn=None)
            fresh = [h.id for h in handles if not h.deduplicated]
            await asyncio.to_thread(self._run_inline, fresh)  # the loop never blocks
            return handles

        @functools.wraps(flow)
        def enqueue_workflow(workflow: Any, conn: Any = None) -> Any:
            _no_caller_transaction(conn)
            handle = flow(workflow, conn=None)
            self._run_inline([], due=False)  # its dependents wait for their parents
            return handle

        @functools.wraps(aflow)
        async def aenqueue_workflow(workflow: Any, conn: Any = None) -> Any:
            _no_caller_transaction(conn)
            handle = await aflow(workflow, conn=None)
            await asyncio.to_thread(self._run_inline, [], due=False)
            return handle

        for name, fn in zip(
            self.INLINE,
            (enqueue_many, aenqueue_many, enqueue_workflow, aenqueue_workflow),
            strict=True,
        ):
            app.__dict__[name] = fn

    def _run_inline(self, fresh: list[int], *, due: bool = True) -> None:
        """Run what an enqueue just stored (``fresh``: its new jobs, made due now: inline
        ignores delay= and run_at=), and what it leads to; raise what a dead one raised."""
        with self._lock:
            nested = self._draining
        if self._closed or (due and not fresh):
            return
        if fresh and due:
            store_tools(self.app.backend).make_due(fresh)
        if nested:
            return  # from inside a handler: the running drain takes them
        result = self._drain(None, True, False, MAX_RUNS_DEFAULT)
        if self.raise_errors:
            _raise_dead(self.app, result, fresh)

    # -- faults ------------------------------------------------------------------------------------
    def fail_attempt(
        self,
        job: JobRef,
        attempt: int = 1,
        exc: BaseException | type[BaseException] = InjectedFailure,
        *,
        after_handler: bool = False,
    ) -> None:
        """Make attempt number ``attempt`` of ``job`` raise ``exc`` (a class, or an instance
        raised as is). ``job``: a job function (every job of that type) or a handle (one
        job). By default the handler does not run on that attempt; ``after_handler=True``
        runs it first, then raises — its effects done, its outcome a failure. Fires once
        per job (a replay does not fail again)."""
        self._check_open()
        if attempt < 1:
            raise ConfigurationError("fail_attempt: attempts are numbered from 1")
        target = self._target(job)
        self._fail_rules.append(_FailRule(target, attempt, exc, after_handler))
        self._wrap(target.name)

    def crash_after_step(self, job: JobRef, step: str, *, attempt: int | None = None) -> None:
        """Crash the attempt right after step ``step`` is stored (the ``after_step`` fault
        point), once per job (on ``attempt`` only, when given). The crash is simulated:
        nothing more of the attempt is written, its transaction rolls back, its children
        are dropped, and the job is rescued when its lease expires — ``drain()`` moves the
        clock there."""
        self._check_open()
        self._crash_rules.append(_CrashRule(self._target(job), step, attempt))
        if not self._armed_after_step:
            _crash_after_steps(self)
            self._armed_after_step = True

    def crash_before_completion(self, job: JobRef, *, attempt: int | None = 1) -> None:
        """Crash attempt ``attempt`` (any, with None) of ``job`` after its handler ended and
        before its outcome is written — the ``before_complete_commit`` moment — once per
        job. Its effects outside the store stay; nothing else of it does."""
        self._check_open()
        self._crash_rules.append(_CrashRule(self._target(job), None, attempt))

    def _target(self, job: JobRef) -> _Target:
        name, job_id = _name_and_id(job)
        if name is None:
            assert job_id is not None
            name = self.app.get_job(job_id).name
        if name not in self.app.registry:
            raise ConfigurationError(f"no job named {name!r} is registered on this App")
        return _Target(name, job_id)

    def _after_step(self, details: Mapping[str, Any]) -> bool:
        if details.get("app", self.app) is not self.app:
            return False  # another Tester's job (ids and names repeat across stores)
        with self._lock:
            return any(
                rule.take(
                    str(details.get("job")),
                    int(details.get("job_id", -1)),
                    int(details.get("attempt", 0)),
                    str(details.get("step")),
                )
                for rule in self._crash_rules
                if rule.step is not None
            )

    def _wrap(self, name: str) -> None:
        if name in self._wrapped:
            return
        definition = self.app.registry[name]
        original = definition.fn
        self._wrapped[name] = original
        rules = self._fail_rules

        def rule_for() -> _FailRule | None:
            job = current_job.get()
            if job is None:  # called directly, not as a job
                return None
            with self._lock:
                # a rule for this very job comes before the rules for every job of its type
                for rule in sorted(rules, key=lambda r: r.target.job_id is None):
                    if (
                        rule.target.matches(job.job_name, job.job_id)
                        and rule.attempt == job.attempt
                        and job.job_id not in rule.fired
                    ):
                        rule.fired.add(job.job_id)
                        return rule
            return None

        if definition.is_async:

            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                rule = rule_for()
                if rule is not None and not rule.after_handler:
                    raise rule.make_error()
                result = await original(*args, **kwargs)
                if rule is not None:
                    raise rule.make_error()
                return result

            definition.fn = functools.wraps(original)(async_wrapper)
        else:

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                rule = rule_for()
                if rule is not None and not rule.after_handler:
                    raise rule.make_error()
                result = original(*args, **kwargs)
                if rule is not None:
                    raise rule.make_error()
                return result

            definition.fn = functools.wraps(original)(wrapper)

    # -- hooks the workers call --------------------------------------------------------------------
    def _hook_crash_before_write(self, attempt: Attempt, exc: BaseException | None) -> bool:
        row = attempt.row
        with self._lock:
            plan = self._plan
            if plan is not None and plan.current == row.id and exc is None:
                return True  # duplicate-delivery crash variant: a first attempt that returned
            return any(
                rule.take(row.name, row.id, row.attempt, None)
                for rule in self._crash_rules
                if rule.step is None
            )

    def _hook_record(self, run: Run) -> None:
        with self._lock:
            self.history.append(run)

    def __repr__(self) -> str:
        return f"<errands.testing.Tester {self.mode} {self.app.url}>"


# The after_step fault point is one per process: every open Tester with crash rules shares
# one arming (a second Tester's arm replaced the first's, whose crashes then never
# happened, and closing either disarmed the other's).
_after_step_lock = threading.Lock()
fresh_lock_at_fork(globals(), "_after_step_lock")  # a new one in a forked child
_after_step_testers: list[Tester] = []


def _after_step_any(details: Mapping[str, Any]) -> bool:
    with _after_step_lock:
        testers = list(_after_step_testers)
    return any(tester._after_step(details) for tester in testers)


def _crash_after_steps(tester: Tester) -> None:
    with _after_step_lock:
        _after_step_testers.append(tester)
        if len(_after_step_testers) == 1:
            faults.arm("after_step", faults.raise_crash, when=_after_step_any)


def _stop_crashing_after_steps(tester: Tester) -> None:
    with _after_step_lock:
        if tester in _after_step_testers:
            _after_step_testers.remove(tester)
        if not _after_step_testers:
            faults.disarm("after_step", when=_after_step_any)


class _Nothing:
    pass


_NOTHING = _Nothing()


def _name_and_id(job: JobRef | int | None) -> tuple[str | None, int | None]:
    if job is None:
        return None, None
    if isinstance(job, JobDefinition):
        return job.name, None
    if isinstance(job, JobHandle):
        return job.name, job.id
    if isinstance(job, str):
        return job, None
    if isinstance(job, int):
        return None, job
    raise ConfigurationError(
        f"expected a job function (@app.job), a JobHandle or a job name, got {type(job).__name__}"
    )


def _jsonable(value: Any) -> Any:
    try:
        return to_jsonable_python(value)
    except Exception:
        return value


def _dumps(value: Any) -> str:
    import json

    return json.dumps(value)


def _describe(
    wanted: Mapping[str, Any], queue: str | None, key: str | None, parent_id: int | None
) -> str:
    parts = [f"args ⊇ {dict(wanted)!r}" if wanted else "any args"]
    if queue is not None:
        parts.append(f"queue={queue!r}")
    if key is not None:
        parts.append(f"key={key!r}")
    if parent_id is not None:
        parts.append(f"parent_id={parent_id}")
    return ", ".join(parts)


def _no_caller_transaction(conn: Any) -> None:
    if conn is not None:
        raise ConfigurationError(
            "inline mode cannot run a job enqueued inside your open transaction "
            "(conn=...): it is not committed yet. Use manual mode and drain() after "
            "your commit"
        )


def _raise_dead(app: App, result: DrainResult, ids: Sequence[int]) -> None:
    """Inline mode: raise for the first job of this enqueue (or run by it) that is dead."""
    errors: dict[int, BaseException] = {}
    for run in result.runs:
        if run.error is not None and not run.duplicate:
            errors[run.job_id] = run.error
    for job_id in dict.fromkeys([*ids, *(r.job_id for r in result.runs)]):
        job = app.get_job(job_id)
        if job.state.value != "dead":
            continue
        if job_id in errors:
            raise errors[job_id]
        last = job.last_error
        raise JobFailed(
            f"job {job.id} ({job.name}) is dead: "
            + (f"{last.type}: {last.message}" if last else "no error recorded"),
            job_id=job.id,
            last_error=None if last is None else last.__dict__,
        )
