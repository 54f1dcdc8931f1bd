"""``errands demo``: a small shop's background jobs, run end to end on a fresh SQLite file.

The demo defines four job types, enqueues a realistic mix (mostly in one
``app.enqueue_many`` transaction), runs an in-process worker until every job is
terminal, then prints what happened and how to inspect the dead-letter queue::

    send_welcome_email  emails    sensitive={"email"}; a few enqueued twice with one key=
                                  (deduplicated), and one held back with delay=2 s
    deliver_webhook     webhooks  retries=2; one endpoint is down: 3 attempts, then dead
    charge_payment      payments  every 5th order fails once (provider timeout), then succeeds;
                                  one card is declined: permanent=(CardDeclined,), dead at once
    import_csv          imports   a broken file raises errands.Permanent: dead at once

The module-level ``app`` lets ``errands worker errands.demo:app --url sqlite:///<db>``
run jobs replayed from the DLQ after the demo. Defining it does no I/O.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import random
import shlex
import shutil
import sys
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from .app import App
from .context import Context
from .handle import JobHandle
from .jobs import Job, JobState
from .outcomes import Permanent

DEMO_DB_DEFAULT = "errands-demo.db"
CONCURRENCY = 8
POLL_INTERVAL = 0.1
MAINTENANCE_TICK = 0.2
DELAY_SECONDS = 2.0
DEADLINE_SECONDS = 50.0  # give up (exit 1) if the jobs are not all terminal by then
WORK_BUDGET_SECONDS = 4.0  # simulated handler time in total, spread over the workers
DUPLICATES_MAX = 5
FLAKY_EVERY = 5  # every 5th order's first charge attempt times out

DOWN_ENDPOINT = "https://hooks.partner-down.example/orders"
BROKEN_FILE = "uploads/customers-broken.csv"
DECLINED_CARD = "tok_chargeDeclined"
EXPECTED_DEAD = 3  # the broken CSV, the down webhook, the declined card


class CardDeclined(Exception):
    """The payment provider declined the card: retrying cannot help."""


def build_app(url: str, *, work_seconds: float = 0.05) -> App:
    """The demo shop's App on ``url``; each handler 'works' about ``work_seconds``."""
    app = App(url)

    def work() -> None:
        time.sleep(work_seconds * random.uniform(0.5, 1.5))

    @app.job(name="send_welcome_email", queue="emails", sensitive={"email"})
    def send_welcome_email(user_id: int, email: str) -> None:
        work()

    @app.job(name="deliver_webhook", queue="webhooks", retries=2)
    def deliver_webhook(url: str, event: str, order_id: int) -> int:
        work()
        if url == DOWN_ENDPOINT:
            raise ConnectionError(f"POST {url}: connection refused")
        return 200

    @app.job(name="charge_payment", queue="payments", permanent=(CardDeclined,))
    def charge_payment(ctx: Context, order_id: int, amount_cents: int, card: str) -> str:
        work()
        if card == DECLINED_CARD:
            raise CardDeclined(f"order {order_id}: card declined by the issuer")
        if order_id % FLAKY_EVERY == 0 and ctx.attempt == 1:
            raise TimeoutError("payment provider did not answer within 5 s")
        # A real handler passes ctx.idempotency_key to the provider, so a retry after a
        # lost response cannot charge twice; it is the same on every attempt.
        return f"ch_{zlib.crc32(ctx.idempotency_key.encode()):08x}"

    @app.job(name="import_csv", queue="imports")
    def import_csv(path: str) -> int:
        work()
        if path == BROKEN_FILE:
            raise Permanent(f"{path}: line 3 has 2 columns, expected 4")
        return 120

    return app


app = build_app(f"sqlite:///{DEMO_DB_DEFAULT}")


# -- output ------------------------------------------------------------------------------
class Out:
    """Rich on a terminal; plain ASCII lines when stdout is a pipe or a file."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self.console = Console(highlight=False, soft_wrap=not self.tty)
        fancy = self.tty and (self.console.encoding or "").lower().startswith("utf")
        self.ok, self.bad, self.arrow = ("✓", "✗", "→") if fancy else ("ok", "x", "->")
        self.progress: Progress | None = None
        self.width = self.console.width if self.tty else 120

    def print(self, text: str = "", *, wrap: bool = True) -> None:
        target = self.progress.console if self.progress is not None else self.console
        target.print(text, soft_wrap=not wrap or not self.tty)


class LogCapture(logging.Handler):
    """Keeps worker log lines off the terminal; shows a short line per dead job."""

    def __init__(self, out: Out) -> None:
        super().__init__(logging.WARNING)
        self.out = out
        self.retries = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            event = getattr(record, "event", "")
            if event == "errands.job.retrying":
                self.retries += 1
                return
            message = record.getMessage()
            if event == "errands.job.dead":
                job = getattr(record, "job_id", "?")
                name = getattr(record, "job_name", "")
                message = message.replace(", moved to the dead-letter queue:", f" {self.out.arrow}")
                text = _short(f"job {job} {name} {message}", self.out.width - 6)
                self.out.print(f"  [red]{self.out.bad}[/red] {escape(text)}")
                return
            self.out.print(f"  [yellow]{escape(_short(message, self.out.width - 4))}[/yellow]")
        except Exception:
            self.handleError(record)


@contextmanager
def captured_logs(out: Out) -> Iterator[LogCapture]:
    logger = logging.getLogger("errands")
    saved = (logger.level, logger.propagate, list(logger.handlers))
    capture = LogCapture(out)
    for handler in saved[2]:
        logger.removeHandler(handler)
    logger.addHandler(capture)
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    try:
        yield capture
    finally:
        logger.removeHandler(capture)
        for handler in saved[2]:
            logger.addHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


# -- enqueue -----------------------------------------------------------------------------
@dataclass
class Enqueued:
    handles: list[JobHandle] = field(default_factory=list)
    in_batch: int = 0
    deduplicated: int = 0
    duplicates_sent: int = 0
    flaky: int = 0
    delayed: JobHandle | None = None
    payment: JobHandle | None = None

    @property
    def stored(self) -> int:
        return len({h.id for h in self.handles})


def enqueue_jobs(app: App, job_count: int) -> Enqueued:
    """Store ``job_count`` distinct jobs, plus duplicate enqueues that are deduplicated."""
    email, webhook = app.registry["send_welcome_email"], app.registry["deliver_webhook"]
    charge, import_csv = app.registry["charge_payment"], app.registry["import_csv"]
    # Enqueued first so its retry clock starts early: the slowest path of the demo.
    batch = [
        webhook.bind(url=DOWN_ENDPOINT, event="order.paid", order_id=1, key="delivery:down"),
        import_csv.bind(path=BROKEN_FILE),
        import_csv.bind(path="uploads/customers-2024-06.csv"),
        charge.bind(order_id=999, amount_cents=4999, card=DECLINED_CARD, key="order:999"),
    ]
    rest = job_count - len(batch) - 1  # one more: the delayed email below
    emails = max(1, rest * 4 // 10)
    webhooks = max(1, rest * 3 // 10)
    payments = rest - emails - webhooks
    users = [(1000 + i, f"user{1000 + i}@example.com") for i in range(emails)]
    batch += [email.bind(user_id=u, email=e, key=f"welcome:{u}") for u, e in users]
    batch += [
        webhook.bind(
            url=f"https://hooks.shop{i % 7}.example/orders",
            event="order.created",
            order_id=2000 + i,
            key=f"delivery:{i}",
        )
        for i in range(webhooks)
    ]
    orders = [3000 + i for i in range(payments)]
    batch += [
        charge.bind(order_id=o, amount_cents=500 + o % 97 * 100, card="tok_visa", key=f"order:{o}")
        for o in orders
    ]
    result = Enqueued(flaky=sum(1 for o in orders if o % FLAKY_EVERY == 0))
    result.handles = app.enqueue_many(batch)  # one transaction
    result.in_batch = len(batch)
    result.payment = result.handles[-1]
    # A user who signed up a moment ago: the welcome email waits DELAY_SECONDS.
    result.delayed = email.enqueue(
        user_id=999_999, email="late.signup@example.com", delay=DELAY_SECONDS
    )
    result.handles.append(result.delayed)
    # Double-clicked sign-up buttons: the same key= returns the job already stored.
    for user_id, address in users[:DUPLICATES_MAX]:
        handle = email.enqueue(user_id=user_id, email=address, key=f"welcome:{user_id}")
        result.duplicates_sent += 1
        result.deduplicated += handle.deduplicated
    return result


# -- running -----------------------------------------------------------------------------
TERMINAL = ("completed", "dead", "cancelled", "discarded")


def state_counts(app: App) -> Counter[str]:
    counts: Counter[str] = Counter()
    for stats in app.queue_stats():
        counts.update(stats.counts)
    return counts


def describe(counts: Counter[str]) -> str:
    waiting = counts["scheduled"] + counts["available"] + counts["running"]
    parts = [f"completed {counts['completed']}", f"retrying {counts['retryable']}"]
    parts += [f"dead {counts['dead']}", f"to do {waiting}"]
    return "  ".join(parts)


def wait_for_terminal(
    app: App, total: int, out: Out, worker_alive: Callable[[], bool]
) -> tuple[bool, Counter[str]]:
    """Poll the store until every job is terminal; show progress. False on timeout."""
    started = time.monotonic()
    deadline = started + DEADLINE_SECONDS
    counts = state_counts(app)

    def done() -> int:
        return sum(counts[s] for s in TERMINAL)

    if out.tty:
        out.progress = Progress(
            SpinnerColumn(),
            TextColumn("[bold]running[/bold]"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[detail]}"),
            console=out.console,
        )
        with out.progress:
            task = out.progress.add_task("jobs", total=total, detail=describe(counts))
            while done() < total and time.monotonic() < deadline and worker_alive():
                time.sleep(0.1)
                counts = state_counts(app)
                out.progress.update(task, completed=done(), detail=describe(counts))
        out.progress = None
    else:
        next_line = started
        while True:
            finished = done() >= total or time.monotonic() >= deadline or not worker_alive()
            if finished or time.monotonic() >= next_line:
                elapsed = time.monotonic() - started
                out.print(f"  {elapsed:5.1f}s  {done():>5}/{total} terminal   {describe(counts)}")
                next_line += 1.0
            if finished:
                break
            time.sleep(0.1)
            counts = state_counts(app)
    return done() >= total, counts


@dataclass
class Report:
    jobs: list[Job]
    completed: int
    dead: list[Job]
    retried: list[Job]
    problems: list[str]


def check(app: App, job_count: int, enqueued: Enqueued, all_terminal: bool) -> Report:
    jobs = app.jobs(limit=job_count + 100)
    by_state = Counter(j.state.value for j in jobs)
    dead = sorted((j for j in jobs if j.state is JobState.DEAD), key=lambda j: j.id)
    retried = [j for j in jobs if j.attempt > 1]
    problems = []
    if not all_terminal:
        waiting = {s: n for s, n in by_state.items() if s not in TERMINAL}
        problems.append(f"not every job reached a terminal state in time: {waiting}")
    if len(jobs) != job_count or enqueued.stored != job_count:
        problems.append(f"{len(jobs)} jobs stored, expected {job_count}")
    expectations = [
        ("completed", by_state["completed"], job_count - EXPECTED_DEAD),
        ("dead", len(dead), EXPECTED_DEAD),
        ("retried", len(retried), enqueued.flaky + 1),
        ("deduplicated", enqueued.deduplicated, enqueued.duplicates_sent),
    ]
    for label, got, want in expectations:
        if got != want:
            problems.append(f"{label}: {got}, expected {want}")
    delayed = find(jobs, enqueued.delayed)
    if delayed and delayed.attempted_at and delayed.attempted_at < delayed.run_at:
        problems.append(f"the delayed job {delayed.id} started before its run_at")
    return Report(jobs, by_state["completed"], dead, retried, problems)


# -- the summary -------------------------------------------------------------------------
def find(jobs: list[Job], handle: JobHandle | None) -> Job | None:
    return next((j for j in jobs if handle is not None and j.id == handle.id), None)


def _short(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def dead_reason(job: Job) -> tuple[str, str]:
    """(why it is dead, its last error) for grouping the DLQ summary."""
    last = job.last_error
    error = f"{last.type}: {last.message}" if last else "no error recorded"
    if last is not None and last.type == "WorkerLost":
        return "its worker was lost", error
    if job.attempt >= job.max_attempts and job.max_attempts > 1:
        return f"retries exhausted after {job.attempt} attempts", error
    return "permanent failure, not retried", error


def print_summary(out: Out, report: Report, enqueued: Enqueued, url: str, elapsed: float) -> None:
    out.print()
    out.print(f"[bold]Summary[/bold] ({elapsed:.1f} s)")
    recovered = sum(1 for j in report.retried if j.state is JobState.COMPLETED)
    rows = [
        ("completed", report.completed, ""),
        (
            "retried",
            len(report.retried),
            f"needed more than one attempt ({recovered} then completed, "
            f"{len(report.retried) - recovered} ran out of retries)",
        ),
        ("dead", len(report.dead), "in the dead-letter queue (below)"),
        (
            "deduplicated",
            enqueued.deduplicated,
            f"of {enqueued.duplicates_sent} repeat enqueues with an existing key= "
            "returned the original job",
        ),
    ]
    delayed = find(report.jobs, enqueued.delayed)
    if delayed and delayed.attempted_at:
        waited = (delayed.attempted_at - delayed.inserted_at).total_seconds()
        note = f"started {waited:.1f} s after enqueue (delay={DELAY_SECONDS:g} s"
        note += ")" if waited < DELAY_SECONDS + 0.5 else ", then its turn in a busy queue)"
        rows.append(("delayed", 1, note))
    for label, count, note in rows:
        out.print(f"  {label:<13}{count:>6}  {escape(note)}".rstrip())
    if enqueued.payment is not None and report.completed:
        try:
            result = enqueued.payment.result(timeout=1)
            out.print(
                f"  {'result':<13}{'':>6}  handle.result() of job {enqueued.payment.id} "
                f"(charge_payment) {out.arrow} {result!r}"
            )
        except Exception as exc:  # shown, not fatal: the checks below decide the exit code
            out.print(f"  result of job {enqueued.payment.id}: {type(exc).__name__}: {exc}")

    groups: dict[tuple[str, str, str], list[Job]] = {}
    for job in report.dead:
        groups.setdefault((job.name, *dead_reason(job)), []).append(job)
    if groups:
        out.print()
        out.print("[bold]Dead jobs by reason[/bold]")
        for (name, reason, error), members in groups.items():
            ids = ", ".join(str(j.id) for j in members[:5]) + (" ..." if len(members) > 5 else "")
            out.print(f"  [red]{len(members):>3}[/red]  {name}: {escape(reason)} (job {ids})")
            out.print(f"       {escape(_short(error, out.width - 8))}")

    first = report.dead[0].id if report.dead else "<id>"
    last = report.dead[-1].id if report.dead else "<id>"
    webhook = next((j.id for j in report.dead if j.name == "deliver_webhook"), first)
    csv = next((j.id for j in report.dead if j.name == "import_csv"), last)
    flag = f"--url {url}"
    errands = cli_command()
    commands = [
        ("list the dead-letter queue", f"{errands} dlq list {flag}"),
        ("one job's attempts and errors", f"{errands} dlq show {webhook} {flag}"),
        ("run it again (same id and key)", f"{errands} dlq replay {webhook} {flag}"),
        (
            "give up on it, with a reason",
            f'{errands} dlq discard {csv} --reason "bad file, customer re-uploads" {flag}',
        ),
        ("queues at a glance", f"{errands} status {flag}"),
        ("run replayed jobs (Ctrl-C stops)", f"{errands} worker errands.demo:app {flag}"),
        (
            "the same in the web dashboard, on http://127.0.0.1:8080 (Ctrl-C stops)",
            f"{errands} dashboard errands.demo:app {flag}",
        ),
    ]
    out.print()
    out.print("[bold]Next steps[/bold]: inspect the dead-letter queue (from this folder)")
    if importlib.util.find_spec("starlette") is None:
        out.print("  # the dashboard needs its extra first: pip install 'errands[dashboard]'")
    for what, command in commands:
        out.print(f"  # {what}", wrap=False)
        out.print(f"  [cyan]{escape(command)}[/cyan]", wrap=False)


def cli_command() -> str:
    """How to run errands' command line from the current folder: ``errands`` when that is
    the one on PATH, else the path of the script or interpreter this run came from
    (``make demo`` runs ``.venv/bin/errands``, whose folder is not on PATH)."""
    script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    on_path = shutil.which("errands")
    if os.path.basename(script) == "errands" and os.path.isfile(script):
        if on_path and os.path.realpath(on_path) == os.path.realpath(script):
            return "errands"
        return shlex.quote(_from_here(script))
    beside = os.path.join(os.path.dirname(sys.executable), "errands")
    if on_path and os.path.realpath(on_path) == os.path.realpath(beside):
        return "errands"
    return f"{shlex.quote(_from_here(sys.executable))} -m errands"


def _from_here(path: str) -> str:
    """``path`` relative to the current folder when it is inside it (``./x`` or
    ``.venv/bin/x``), else absolute."""
    relative = os.path.relpath(path)
    if relative.startswith(".."):
        return path
    return relative if os.sep in relative else f".{os.sep}{relative}"


# -- the command -------------------------------------------------------------------------
def remove_database(db_path: str) -> None:
    for path in (db_path, f"{db_path}-wal", f"{db_path}-shm", f"{db_path}-journal"):
        if os.path.lexists(path):
            os.remove(path)


def run_demo(db_path: str, job_count: int) -> int:
    """Run the demo on a fresh SQLite file; 0 when every job ended as expected, else 1."""
    out = Out()
    remove_database(db_path)
    url = f"sqlite:///{db_path}"
    work = min(max(WORK_BUDGET_SECONDS * CONCURRENCY / max(job_count, 1), 0.002), 0.12)
    demo_app = build_app(url, work_seconds=work)
    started = time.monotonic()
    out.print(f"[bold]errands demo[/bold]: {job_count} jobs on {url}")
    for definition in demo_app.registry.values():
        options = [f"queue={definition.queue}", f"retries={definition.retries}"]
        if definition.sensitive:
            names = ", ".join(f'"{n}"' for n in sorted(definition.sensitive))
            options.append(f"sensitive={{{names}}}")
        if definition.permanent:
            options.append(f"permanent=({', '.join(e.__name__ for e in definition.permanent)},)")
        out.print(f"  {definition.name:<20} {escape(' '.join(options))}")
    with captured_logs(out) as logs:
        try:
            enqueued = enqueue_jobs(demo_app, job_count)
            out.print(
                f"enqueued {enqueued.stored} jobs ({enqueued.in_batch} in one enqueue_many "
                f"transaction, 1 delayed {DELAY_SECONDS:g} s); "
                f"{enqueued.deduplicated} repeats deduplicated by key="
            )
            worker = demo_app.worker(
                concurrency=CONCURRENCY,
                poll_interval=POLL_INTERVAL,
                maintenance_tick=MAINTENANCE_TICK,
                grace=5.0,
            )
            failure: list[BaseException] = []

            def run() -> None:
                try:
                    worker.run(install_signals=False)
                except BaseException as exc:
                    failure.append(exc)

            thread = threading.Thread(target=run, name="errands-demo-worker", daemon=True)
            out.print(
                f"worker {worker.id}: {CONCURRENCY} at once on "
                f"{', '.join(worker.queue_limits)}; poll every {POLL_INTERVAL:g} s"
            )
            thread.start()
            try:
                all_terminal, _ = wait_for_terminal(demo_app, enqueued.stored, out, thread.is_alive)
            finally:
                worker.stop()
                thread.join(timeout=15)
            if failure:
                out.print(f"[red]the worker failed: {escape(repr(failure[0]))}[/red]")
                return 1
            report = check(demo_app, job_count, enqueued, all_terminal)
            if logs.retries == 0 and enqueued.flaky:
                report.problems.append("no retry was logged")
            print_summary(out, report, enqueued, url, time.monotonic() - started)
        except KeyboardInterrupt:
            out.print("\ninterrupted")
            return 1
        finally:
            demo_app.close()
    out.print()
    if report.problems:
        out.print("[red bold]The demo did not go as expected:[/red bold]")
        for problem in report.problems:
            out.print(f"  - {escape(problem)}")
        return 1
    out.print(
        f"[green]{out.ok}[/green] every job reached a terminal state and the counts match "
        "what the demo set up."
    )
    return 0
