"""One catalogue of events: every emitted event carries exactly its catalogued fields, and
docs/observability.md documents each of them (DESIGN §9, issue 6)."""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path

import pytest

import errands
from errands.maintenance.service import Maintenance
from errands.observability.events import CATALOGUE, Event
from tests.integration.helpers import claim_as_dead_worker, expire_lease, run_script, wait_until

DOC = Path(__file__).resolve().parents[2] / "docs" / "observability.md"


def test_the_docs_list_every_catalogued_event_with_exactly_its_fields() -> None:
    rows: dict[str, set[str]] = {}
    text = DOC.read_text()
    section = text[text.index("### The catalogue") : text.index("What the fields hold")]
    for line in section.splitlines():
        match = re.match(r"\| `(errands\.[a-z_.]+)` \| [^|]+ \| (.+) \|$", line)
        if match:
            rows[match[1]] = set(re.findall(r"`(\w+)`", match[2]))
    assert set(rows) == set(CATALOGUE)
    for name, fields in CATALOGUE.items():
        assert rows[name] == set(fields), name


def test_an_unknown_event_name_is_refused(app: errands.App) -> None:
    with pytest.raises(ValueError, match="add it to the catalogue"):
        app.events.emit("errands.job.exploded", job_id=1)


def doomed_again(handle: errands.JobHandle) -> bool:
    job = handle.job()
    return job.attempt == 1 and job.state.value == "dead" and len(job.errors) == 2


def test_emitted_events_carry_exactly_the_catalogued_fields(tmp_path: Path) -> None:
    app = errands.App(f"sqlite:///{tmp_path}/events.db", retention=0.2, lease=1.5)
    seen: list[Event] = []
    lock = threading.Lock()

    def record(event: Event) -> None:
        with lock:
            seen.append(event)

    app.events.subscribe(record)
    release = threading.Event()

    @app.job(name="ev.ok")
    def ok() -> None:
        pass

    @app.job(name="ev.flaky", retries=1, backoff=0.01)
    def flaky(ctx: errands.Context) -> None:
        if ctx.attempt == 1:
            raise ConnectionError("blip")

    @app.job(name="ev.doomed")
    def doomed() -> None:
        raise errands.Permanent("no")

    @app.job(name="ev.slow")
    def slow(ctx: errands.Context) -> None:
        ctx.progress(0.5, "half way")  # stored (and announced) by the next heartbeat
        while not ctx.cancelled and not release.is_set():
            time.sleep(0.01)
        if ctx.cancelled:
            raise RuntimeError("stopped half-way")  # after a cancel: recorded as cancelled

    @app.job(name="ev.wait", retries=0)
    def wait(ctx: errands.Context, timeout: float) -> object:
        return ctx.wait_for_signal("go", timeout=timeout)

    @app.job(name="ev.member")
    def member() -> None:
        pass

    @app.job(name="ev.lost", queue="elsewhere", retries=2)
    def lost() -> None:
        pass

    handles = [ok.enqueue(key="k1"), ok.enqueue(key="k1"), flaky.enqueue(), doomed.enqueue()]
    slow_cancelled = slow.enqueue()
    try:
        from tests.conftest import running_worker

        with running_worker(app, queues="default", grace=0):
            for handle in handles[:3]:
                handle.result(timeout=10)
            wait_until(lambda: handles[3].job().state.value == "dead", what="doomed dead")
            wait_until(lambda: slow_cancelled.job().state.value == "running", what="slow runs")
            wait_until(
                lambda: any(e.name == "errands.job.progress" for e in list(seen)),
                what="progress stored by a heartbeat",
            )
            app.cancel(slow_cancelled.id)
            wait_until(lambda: slow_cancelled.job().state.value == "cancelled", what="cancelled")
            later = slow.enqueue(delay=3600)
            assert app.reprioritise([later.id], 5).matched == [later.id]
            signalled, timed_out = wait.enqueue(timeout=60), wait.enqueue(timeout=0.1)
            wait_until(lambda: signalled.job().state.value == "waiting", what="a job waits")
            app.signal(signalled.id, "go", "yes")
            assert signalled.result(timeout=10) == "yes"
            wait_until(lambda: timed_out.job().state.value == "dead", what="wait timed out")
            app.replay([handles[3].id])
            wait_until(lambda: doomed_again(handles[3]), what="doomed dead again")
            app.discard([handles[3].id], reason="not needed")
            batch = errands.Batch("ev.batch")
            batch.add(member.bind())
            assert app.enqueue_workflow(batch).result(timeout=10)  # settled by the worker
            to_cancel = errands.Batch("ev.cancelled")
            to_cancel.add(member.bind(delay=3600))
            app.enqueue_workflow(to_cancel).cancel()  # settled by the cancel
            slow.enqueue()  # still running at the stop: released (grace=0)
            wait_until(
                lambda: any(e.name == "errands.job.started" and e["job_name"] == "ev.slow"
                            and e["job_id"] != slow_cancelled.id for e in list(seen)),
                what="second slow job started",
            )  # fmt: skip
        release.set()
        lost_handle = lost.enqueue()
        claim_as_dead_worker(app, lost_handle.id)
        expire_lease(app, lost_handle.id)
        maintenance = Maintenance(app, "test-leader")
        assert maintenance.rescue() == 1
        time.sleep(0.3)  # past retention=0.2 s
        assert maintenance.prune() >= 1
    finally:
        release.set()
        app.close()

    names = {e.name for e in seen}
    expected = set(CATALOGUE) - {
        "errands.job.stale_write_rejected",  # needs a lost lease race
        "errands.job.write_failed",  # needs a store that fails (test_metrics.py)
    }
    assert expected <= names, sorted(expected - names)
    for event in seen:
        assert set(event.fields) == set(CATALOGUE[event.name]), event
    enqueued = [e for e in seen if e.name == "errands.job.enqueued" and e["job_name"] == "ev.ok"]
    assert [e["deduplicated"] for e in enqueued] == [False, True]


def test_a_failing_before_insert_hook_or_subscriber_never_breaks_enqueue(
    app: errands.App, caplog: pytest.LogCaptureFixture
) -> None:
    @app.job(name="ev.plain")
    def plain(n: int) -> None:
        pass

    def add_meta(requests: list) -> None:  # type: ignore[type-arg]
        for request in requests:
            request.meta["tenant"] = "acme"

    def broken_hook(requests: list) -> None:  # type: ignore[type-arg]
        raise RuntimeError("hook bug")

    def broken_subscriber(event: Event) -> None:
        raise RuntimeError("subscriber bug")

    app.events.before_insert(add_meta)
    app.events.before_insert(broken_hook)
    app.events.subscribe(broken_subscriber)
    handle = plain.enqueue(n=1)
    assert handle.job().meta == {"tenant": "acme"}
    messages = [r.getMessage() for r in caplog.records]
    assert any("before-insert hook" in m for m in messages)
    assert any("event subscriber" in m for m in messages)


def test_a_handler_wrapper_can_neither_fail_a_completed_job_nor_swallow_its_error(
    app: errands.App, worker_factory, caplog: pytest.LogCaptureFixture
) -> None:
    """A wrapper whose exit raises made a completed handler's job fail and run again (its
    effects repeated); one that suppressed the handler's exception left no result (an
    UnboundLocalError instead of its Permanent outcome). Their exits never change the
    handler's outcome now, and a failing one is logged."""
    from contextlib import contextmanager

    calls: list[str] = []

    @contextmanager
    def raising_on_exit(info: dict[str, object]):  # type: ignore[no-untyped-def]
        yield
        raise RuntimeError("the wrapper's own bug")

    class Swallowing:
        def __init__(self, info: dict[str, object]) -> None: ...

        def __enter__(self) -> None: ...

        def __exit__(self, *exc: object) -> bool:
            return True  # suppresses whatever the handler raised

    app.events.wrap(raising_on_exit)
    app.events.wrap(Swallowing)

    @app.job(name="wrapped.ok", retries=2)
    def ok() -> str:
        calls.append("ok")
        return "done"

    @app.job(name="wrapped.bad", retries=2)
    def bad() -> None:
        raise errands.Permanent("a bad input")

    good, failing = ok.enqueue(), bad.enqueue()
    with worker_factory(concurrency=1):
        assert good.result(timeout=10) == "done"
        job = wait_until(
            lambda: (j := failing.job()).state is errands.JobState.DEAD and j,
            what="the permanent failure to be recorded",
        )
    assert calls == ["ok"]  # ran once
    assert job.attempt == 1 and job.errors[-1].message == "a bad input"
    assert any("failed on exit" in r.getMessage() for r in caplog.records)


def test_a_hung_subscriber_never_holds_the_thread_a_transactional_jobs_slot_gave_back(
    app: errands.App, worker_factory
) -> None:
    """A job that completes in its ctx.transaction() has its end written on its handler
    thread, after its slot was given back: a subscriber that hung there held the thread
    the next claimed job waited for (-c 1: every job). So did one of errands.job.started
    (on the handler thread, before the handler) and one of the errands.workflow.settled
    of a workflow that completion settled. Subscribers run on the events lane now."""
    release = threading.Event()
    threads: dict[str, str] = {}
    hanging = ("errands.job.completed", "errands.job.started", "errands.workflow.settled")

    def hung(event: Event) -> None:
        if event.name in hanging:
            threads.setdefault(event.name, threading.current_thread().name)
            release.wait(20)

    app.events.subscribe(hung)

    @app.job(name="tx.first")
    def first(ctx: errands.Context) -> str:
        ctx.transaction()
        return "first"

    @app.job(name="tx.second")
    def second() -> str:
        return "second"

    batch = errands.Batch("settled-in-tx")
    batch.add(first.bind(), name="first")
    try:
        one = app.enqueue_workflow(batch)
        with worker_factory(concurrency=1):
            assert one.result(timeout=10) == {"first": "first"}
            assert second.enqueue().result(timeout=10) == "second"
            release.set()  # before the worker stops (it waits for the events lane)
    finally:
        release.set()
    assert set(threads) == set(hanging)
    assert not any(name.startswith("errands-job") for name in threads.values()), threads


def test_a_workflow_settled_by_a_completion_whose_reply_was_lost_is_announced_once(
    each_store_url: str,
) -> None:
    """The completer's batch committed (the member's end, the workflow settled, its
    callback inserted), then its reply was lost: the retry's write began by dropping what
    the first try's fan-in reported, and the retry itself settles nothing (the token is
    spent), so errands.workflow.settled (and its counter) never came."""
    import sqlite3

    from errands import faults
    from errands.observability.metrics import install_metrics

    from .conftest import metric_value

    app = errands.App(each_store_url)
    registry = install_metrics(app, cache_seconds=0).registry
    settled: list[Event] = []
    app.events.subscribe(lambda e: settled.append(e) if e.name.endswith("settled") else None)

    @app.job(name="ev.member")
    def member() -> int:
        return 1

    @app.job(name="ev.callback")
    def callback() -> None:
        pass

    lost: list[str] = []

    def lose_the_reply(point: str) -> None:
        if not lost:  # once: the retry's reply comes back
            lost.append(point)
            raise sqlite3.OperationalError("server closed the connection (after the commit)")

    batch = errands.Batch("ev.lost_reply", on_success=callback.bind())
    batch.add(member.bind(), name="only")
    handle = app.enqueue_workflow(batch)
    faults.arm("after_finish_commit", lose_the_reply)
    try:
        from tests.conftest import running_worker

        with running_worker(app, concurrency=1, maintenance=False):
            wait_until(lambda: app.workflow_status(handle.id).state == "succeeded", what="settle")
            wait_until(lambda: settled, what="the settled event")
            wait_until(
                lambda: [j.state.value for j in app.jobs()] == ["completed"] * 2,
                what="the callback run",
            )
    finally:
        faults.disarm("after_finish_commit")
        app.close()
    assert lost == ["after_finish_commit"]
    assert [(e["workflow_id"], e["state"], e["callbacks"]) for e in settled] == [
        (handle.id, "succeeded", ["on_success"])
    ]
    assert metric_value(registry, "errands_workflows_settled_total", state="succeeded") == 1


def _lost_reply_error(store_url: str) -> Exception:
    """What the driver raises when the connection drops once the COMMIT reached the
    server (a local SQLite commit cannot lose its reply: simulated with its own class)."""
    if store_url.startswith("sqlite"):
        import sqlite3

        return sqlite3.OperationalError("disk I/O error (after the commit)")
    import psycopg

    return psycopg.OperationalError("server closed the connection unexpectedly")


def test_a_transactional_completion_whose_commit_reply_was_lost_is_a_completion(
    each_store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A member completed in its handler's ctx.transaction(): the COMMIT went through (the
    member's end, the workflow settled, its callback inserted), then its reply was lost.
    The recorder took the error for a failed commit and handed a retryable failure to
    the completer, whose write the fence refused: the attempt was reported as a stale
    write (event, metric, WARNING line) and neither errands.job.completed nor the
    workflow's errands.workflow.settled came. The row is read back: the completion
    landed, and is reported as one."""
    from errands import faults
    from errands.observability.metrics import install_metrics

    from .conftest import metric_value

    app = errands.App(each_store_url)
    registry = install_metrics(app, cache_seconds=0).registry
    seen: list[Event] = []
    app.events.subscribe(seen.append)

    @app.job(name="ev.tx_member", retries=2)
    def member(ctx: errands.Context) -> int:
        ctx.transaction().execute("SELECT 1")
        return ctx.attempt

    @app.job(name="ev.tx_callback")
    def callback() -> None:
        pass

    lost: list[str] = []

    def lose_the_reply(point: str) -> None:
        if not lost:  # once
            lost.append(point)
            raise _lost_reply_error(each_store_url)

    batch = errands.Batch("ev.tx_lost_reply", on_success=callback.bind())
    batch.add(member.bind(), name="only")
    handle = app.enqueue_workflow(batch)
    faults.arm("after_complete_commit", lose_the_reply)
    try:
        from tests.conftest import running_worker

        with running_worker(app, concurrency=1, maintenance=False):
            wait_until(lambda: app.workflow_status(handle.id).state == "succeeded", what="settle")
            wait_until(
                lambda: [j.state.value for j in app.jobs()] == ["completed"] * 2,
                what="the callback run",
            )
            wait_until(
                lambda: (
                    any(e.name == "errands.job.completed" for e in seen)
                    or any(e.name == "errands.job.stale_write_rejected" for e in seen)
                ),
                what="the member's outcome event",
            )
    finally:
        faults.disarm("after_complete_commit")
        app.close()
    assert lost == ["after_complete_commit"]
    member_job = next(j for j in app.jobs() if j.name == "ev.tx_member")
    assert (member_job.attempt, member_job.result, member_job.errors) == (1, 1, [])
    names = [e.name for e in seen if e.get("job_id", member_job.id) == member_job.id]
    assert "errands.job.stale_write_rejected" not in names, names
    assert "errands.job.completed" in names, names
    assert [(e["workflow_id"], e["state"]) for e in seen if e.name.endswith("settled")] == [
        (handle.id, "succeeded")
    ]
    assert metric_value(registry, "errands_stale_writes_rejected_total") == 0
    assert metric_value(registry, "errands_workflows_settled_total", state="succeeded") == 1
    assert (
        metric_value(
            registry, "errands_jobs_completed_total", job="ev.tx_member", outcome="completed"
        )
        == 1
    )
    assert not [r for r in caplog.records if "stale write" in r.getMessage()]


def test_a_transactional_completion_whose_commit_failed_before_landing_is_retried(
    each_store_url: str,
) -> None:
    """The other side of the read-back: the connection dropped before the COMMIT went
    through, so nothing of the attempt landed; the attempt is a failure, retried (its
    transaction's writes were rolled back with it), never taken for a completion."""
    from errands import faults

    app = errands.App(each_store_url)
    seen: list[Event] = []
    app.events.subscribe(seen.append)

    @app.job(name="ev.tx_unlanded", retries=2, backoff=0.01)
    def unlanded(ctx: errands.Context) -> int:
        ctx.transaction().execute("SELECT 1")
        return ctx.attempt

    lost: list[str] = []

    def drop_before_the_commit(point: str) -> None:
        if not lost:  # once
            lost.append(point)
            raise _lost_reply_error(each_store_url)

    handle = unlanded.enqueue()
    faults.arm("before_complete_commit", drop_before_the_commit)
    try:
        from tests.conftest import running_worker

        with running_worker(app, concurrency=1, maintenance=False):
            assert handle.result(timeout=20) == 2
    finally:
        faults.disarm("before_complete_commit")
        app.close()
    assert lost == ["before_complete_commit"]
    names = [e.name for e in seen if e.name.startswith("errands.job.")]
    assert "errands.job.stale_write_rejected" not in names, names
    assert names.count("errands.job.retrying") == 1, names


def test_a_workflow_settled_by_a_rescue_whose_reply_was_lost_is_announced_once(
    app: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rescue's batch committed (the member dead, its workflow failed), its reply was
    lost: the next tick confirms the rescue by reading it back and announces the member's
    events; the workflow's settled event was dropped."""
    import sqlite3

    settled: list[Event] = []
    app.events.subscribe(lambda e: settled.append(e) if e.name.endswith("settled") else None)

    @app.job(name="ev.lost_member", retries=0)
    def lost_member() -> None:
        pass

    batch = errands.Batch("ev.rescued")
    batch.add(lost_member.bind(), name="only")
    handle = app.enqueue_workflow(batch)
    [job_id] = [j.id for j in app.jobs()]
    claim_as_dead_worker(app, job_id)
    expire_lease(app, job_id)
    real = app.backend.job_rescue_many
    lost: list[int] = []

    def reply_lost(rescues: object) -> list[bool]:
        done = real(rescues)  # type: ignore[arg-type]
        if not lost:
            lost.append(1)
            raise sqlite3.OperationalError("disk I/O error (after the commit)")
        return done

    monkeypatch.setattr(app.backend, "job_rescue_many", reply_lost)
    leader = Maintenance(app, "test-leader")
    with pytest.raises(sqlite3.OperationalError):
        leader.rescue()
    assert app.workflow_status(handle.id).state == "failed"  # it did commit
    assert settled == []
    assert leader.rescue() == 1  # confirmed by reading it back
    assert [(e["workflow_id"], e["state"]) for e in settled] == [(handle.id, "failed")]
    assert leader.rescue() == 0
    assert len(settled) == 1


def test_a_workflow_settled_by_a_give_back_whose_reply_was_lost_is_announced_once(
    app: errands.App,
) -> None:
    """The completer gives a job back (a GiveBack: its ctx.transaction() met a store that
    could not write): the release committed (the member, cancelled meanwhile, ended
    ``cancelled``; its workflow settled, failed), then its reply was lost. The retry is refused
    and confirmed by reading the job back; the workflow's settled event was dropped with
    the try's fan-in (each try began by dropping what the earlier one recorded)."""
    import sqlite3

    from errands.backends.base import LeaseRef
    from errands.worker.completer import Completer
    from errands.worker.execution import Attempt

    settled: list[Event] = []
    app.events.subscribe(lambda e: settled.append(e) if e.name.endswith("settled") else None)

    @app.job(name="ev.given_back")
    def given_back() -> None:
        pass

    batch = errands.Batch("ev.given_back_batch")
    batch.add(given_back.bind(), name="only")
    handle = app.enqueue_workflow(batch)
    [job_id] = [j.id for j in app.jobs()]
    row = claim_as_dead_worker(app, job_id, lease=60)
    app.cancel(job_id)  # running: asked to stop; the release ends it cancelled
    lost: list[int] = []

    def release(attempts: list[Attempt], message: str, delays: list[float]) -> list[bool | None]:
        done = app.backend.job_release_many(
            [LeaseRef(a.id, a.token, a.lease_seconds, fair=False) for a in attempts],
            message % len(attempts),
            delays=delays,
        )
        if not lost:
            lost.append(1)
            raise sqlite3.OperationalError("disk I/O error (after the commit)")
        return list(done)

    completer = Completer(app, lambda *_: None, release=release)
    attempt = Attempt(row, None, 60.0)
    assert completer._release([attempt], "released %d job(s)", [0.0]) == [True]  # read back
    assert lost == [1]
    assert app.get_job(job_id).state is errands.JobState.CANCELLED  # it did commit
    state = app.workflow_status(handle.id).state
    assert state == "failed"  # settled by that member's end
    wait_until(lambda: settled, what="the settled event")
    app.hooks.drain(5.0)
    assert [(e["workflow_id"], e["state"]) for e in settled] == [(handle.id, state)]


def test_an_insert_failed_hook_that_raises_never_replaces_the_inserts_own_error(
    app: errands.App, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import sqlite3

    from errands.backends.sqlite import backend as sqlite_backend

    told: list[tuple[int, str]] = []

    @app.events.on_insert_failed
    def record(requests: list[object], exc: BaseException) -> None:
        told.append((len(requests), type(exc).__name__))

    @app.events.on_insert_failed
    def hostile(requests: list[object], exc: BaseException) -> None:
        raise RuntimeError("a plugin's bug")

    @app.job(name="ev.refused")
    def refused(n: int) -> int:
        return n

    app.migrate()

    def broken(request: object) -> object:
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(sqlite_backend, "insert_params", broken)
    with pytest.raises(sqlite3.OperationalError, match="disk I/O error"):
        app.enqueue_many([refused.bind(n=1), refused.bind(n=2)])
    assert told == [(2, "OperationalError")]
    assert "insert-failed hook" in caplog.text and "a plugin's bug" in caplog.text


class LibraryTimeout(BaseException):
    """As gevent's and eventlet's Timeout: a BaseException, which ``except Exception``
    in errands' delivery let through."""


def test_a_subscriber_raising_a_base_exception_never_makes_a_stored_enqueue_look_failed(
    app: errands.App, caplog: pytest.LogCaptureFixture
) -> None:
    """The enqueue returns its handles: the jobs were stored whatever a subscriber does.
    It raised the subscriber's exception, and a caller retrying the failed-looking
    enqueue (no key) stored the job twice. The subscribers after it get the event."""

    @app.job(name="ev.base")
    def job(n: int) -> None: ...

    def timing_out(event: Event) -> None:
        if event.name in ("errands.job.enqueued", "errands.workflow.enqueued"):
            raise LibraryTimeout

    seen: list[str] = []
    app.events.subscribe(timing_out)
    app.events.subscribe(lambda event: seen.append(event.name))
    one = job.enqueue(n=1)
    many = app.enqueue_many([job.bind(n=2), job.bind(n=3)])
    batch = errands.Batch("ev.base.batch")
    batch.add(job.bind(n=4))
    flow = app.enqueue_workflow(batch)
    assert not one.deduplicated and len(many) == 2 and flow.id is not None
    assert sorted(j.args["n"] for j in app.jobs(name="ev.base")) == [1, 2, 3, 4]
    assert seen.count("errands.job.enqueued") == 4 and "errands.workflow.enqueued" in seen
    failed = [r for r in caplog.records if "event subscriber" in r.getMessage()]
    assert len(failed) == 5 and all(r.exc_info for r in failed)


def test_ctrl_c_in_a_subscriber_still_stops_the_call_its_job_stored(app: errands.App) -> None:
    """KeyboardInterrupt and SystemExit still propagate (the process is being stopped),
    as one landing just after the commit would: the job is stored."""

    @app.job(name="ev.ctrl_c")
    def job(n: int) -> None: ...

    def interrupted(event: Event) -> None:
        if event.name == "errands.job.enqueued":
            raise KeyboardInterrupt

    app.events.subscribe(interrupted)
    with pytest.raises(KeyboardInterrupt):
        job.enqueue(n=1)
    assert [j.args for j in app.jobs(name="ev.ctrl_c")] == [{"n": 1}]


def test_a_subscriber_raising_a_base_exception_on_the_events_lane_leaves_the_event_to_the_next(
    app: errands.App, worker_factory
) -> None:
    """A worker's events reach subscribers on the events lane, one after another: one
    raising a BaseException ended the lane's call, and the subscribers after it never
    got the event."""

    def timing_out(event: Event) -> None:
        raise LibraryTimeout

    completed: list[int] = []
    app.events.subscribe(timing_out)
    app.events.subscribe(
        lambda event: (
            completed.append(event["job_id"]) if event.name == "errands.job.completed" else None
        )
    )

    @app.job(name="ev.lane")
    def job() -> str:
        return "done"

    with worker_factory(concurrency=1):
        handle = job.enqueue()
        assert handle.result(timeout=30) == "done"
        wait_until(lambda: completed == [handle.id], timeout=30)


@pytest.mark.skipif(sys.platform == "win32", reason="no os.fork on Windows")
def test_a_child_forked_while_another_thread_subscribes_subscribes_and_hears_its_events(
    tmp_path: Path,
) -> None:
    """The parent forks while another thread holds its event bus's lock (subscribing,
    unsubscribing, adding a wrapper or an insert hook: each takes it for a moment). The
    child had the lock copied held, by a thread it does not have: its first subscribe
    hung for good. In the child the lock is new: it subscribes, hears its own enqueue's
    event, and unsubscribes. Real os.fork, in a process of its own; a child still hung
    after 60 s is ended by its alarm."""
    script = """
        import os, signal, sys, threading
        import errands

        app = errands.App("sqlite:///" + sys.argv[1])

        @app.job(name="forked.job")
        def job() -> None: ...

        held, forked = threading.Event(), threading.Event()

        def subscribing() -> None:  # the bus's lock held across the fork
            with app.events._lock:
                held.set()
                forked.wait(60)

        threading.Thread(target=subscribing, daemon=True).start()
        assert held.wait(30)
        pid = os.fork()
        if pid == 0:
            signal.alarm(60)  # hung: killed by SIGALRM, the test fails
            try:
                heard = []
                hear = app.events.subscribe(lambda event: heard.append(event.name))
                job.enqueue()
                app.events.unsubscribe(hear)
                print("child heard", heard.count("errands.job.enqueued"), flush=True)
                app.close()
            except BaseException as exc:
                print("child:", type(exc).__name__, exc, flush=True)
                os._exit(1)
            os._exit(0)
        forked.set()
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status), flush=True)
        app.events.subscribe(print)
        app.close()
        """
    done = run_script(script, str(tmp_path / "store.db"))
    assert done.returncode == 0, (done.stdout, done.stderr[-3000:])
    for said in ("child heard 1", "child exit 0"):
        assert said in done.stdout, (done.stdout, done.stderr[-3000:])
