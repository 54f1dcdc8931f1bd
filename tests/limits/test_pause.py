"""Queue pause and resume (item 5): ``app.pause``/``app.resume``, ``errands queues
pause|resume NAME``, persisted in the store and audited; ``errands queues`` lists queues.

Every claim checks the pause in the store (the fast claim in its SQL, a limited queue's
claim in its settings), so once ``pause`` returns no worker claims from the queue; running
jobs finish. A resumed queue is claimed again at the workers' next poll.
"""

from __future__ import annotations

import json
import time

import pytest

import errands

from .helpers import Intervals, db_now, run_cli, wait_until, workers

POLL = 0.2
CLOCK_STEP = 0.002  # seconds: two ticks of SQLite's millisecond clock


@pytest.mark.parametrize("limited", [False, True], ids=["plain-queue", "limited-queue"])
def test_pause_stops_claims_within_one_poll_interval_and_resume_restarts_them(
    store: errands.App, limited: bool
) -> None:
    """Given a worker busy on a queue, when the queue is paused, then no job is claimed
    later than one poll interval after the pause (claim times and the audited pause time
    both by the database clock) while jobs wait; when it is resumed, claims start again
    within one poll interval (plus a generous 1 s)."""
    runs = Intervals()
    if limited:
        store.queue("mail", limit=3)

    @store.job(name="mail.send", queue="mail")
    def send(n: int) -> None:
        with runs.run():
            time.sleep(0.02)

    store.enqueue_many([send.bind(n=i) for i in range(400)])
    with workers([store], concurrency=3, poll_interval=POLL):
        wait_until(lambda: len(runs.start_times()) >= 20, 20, "20 starts")
        store.pause("mail", actor="ops:bob")
        time.sleep(5 * POLL)  # the measurement: nothing may be claimed in here
        assert len(store.jobs(state="available", queue="mail", limit=500)) > 0

        resumed_db, resumed = db_now(store), time.monotonic()
        store.resume("mail", actor="ops:bob")
        first = wait_until(
            lambda: [t for t in runs.start_times() if t > resumed], 10, "a start after resume"
        )[0]
        assert first - resumed <= POLL + 1.0, f"resumed after {first - resumed:.2f} s"

    [resume, pause] = store.audit(limit=2)
    assert [(e.action, e.actor, e.detail) for e in (pause, resume)] == [
        ("pause", "ops:bob", {"queue": "mail"}),
        ("resume", "ops:bob", {"queue": "mail"}),
    ]
    claimed = [
        j.attempted_at.timestamp() for j in store.jobs(queue="mail", limit=500) if j.attempted_at
    ]
    assert sum(1 for t in claimed if t <= pause.at) >= 20
    # SQLite's clock has millisecond resolution: a claim right after the resume can read
    # as the same millisecond as resumed_db, so the window ends a little before it.
    late = [t - pause.at for t in claimed if pause.at + POLL < t < resumed_db - CLOCK_STEP]
    assert late == [], f"claimed this long after the pause: {late}"


def test_pause_is_persisted_seen_by_other_apps_and_kept_when_workers_restart(
    store: errands.App,
) -> None:
    ran: list[int] = []

    @store.job(name="mail.later", queue="mail")
    def later(n: int) -> None:
        ran.append(n)

    store.pause("mail", actor="ops:dana")
    handle = later.enqueue(n=1)
    other = errands.App(store.url)
    try:
        [settings] = other.queue_settings()
        assert (settings.name, settings.paused, settings.updated_by) == ("mail", True, "ops:dana")
        # a worker that starts (and stores this app's limits for the queue) keeps it paused
        other.queue("mail", limit=4)
        other.job(name="mail.later", queue="mail")(later.fn)
        with workers([other], poll_interval=0.05):
            time.sleep(0.5)
            assert ran == []
            [settings] = store.queue_settings()
            assert (settings.paused, settings.max_running) == (True, 4)
            other.resume("mail", actor="ops:dana")
            assert handle.result(timeout=10) is None
    finally:
        other.close()
    assert ran == [1]
    assert [(e.action, e.actor) for e in store.audit()] == [
        ("resume", "ops:dana"),
        ("pause", "ops:dana"),
    ]


def test_queues_command_lists_queues_and_pauses_and_resumes_them(store: errands.App) -> None:
    store.queue("payments", limit=5, rate="100/m")

    @store.job(name="pay", queue="payments")
    def pay(n: int) -> None: ...

    @store.job(name="mail", queue="emails")
    def mail(n: int) -> None: ...

    pay.enqueue(n=1)
    mail.enqueue(n=2)
    with workers([store], queues="nothing"):  # a worker stores the declared limits
        pass

    paused = run_cli("queues", "pause", "emails", "--url", store.url, "--actor", "ops:carol")
    assert paused.exit_code == 0, paused.output
    assert paused.output.strip() == (
        "queue emails: paused (workers stop claiming within one poll interval)"
    )
    listing = run_cli("queues", "--url", store.url)
    assert listing.exit_code == 0, listing.output
    header, *lines = listing.output.splitlines()
    assert header.split() == [
        "queue", "state", "limit", "rate", "pending", "running", "dead", "changed", "by"
    ]  # fmt: skip
    rows = {line.split()[0]: line.split() for line in lines}
    assert rows["emails"][:7] == ["emails", "paused", "-", "-", "1", "0", "0"]
    assert rows["emails"][7] == "ops:carol"
    assert rows["payments"][:7] == ["payments", "active", "5", "100/m", "1", "0", "0"]

    resumed = run_cli("queues", "resume", "emails", "--url", store.url, "--actor", "ops:carol")
    assert resumed.exit_code == 0, resumed.output
    assert resumed.output.strip() == "queue emails: resumed"
    as_json = json.loads(run_cli("queues", "--url", store.url, "--json").output)
    assert {r["queue"]: r["state"] for r in as_json} == {"emails": "active", "payments": "active"}
    assert [(e.action, e.actor) for e in store.audit()] == [
        ("resume", "ops:carol"),
        ("pause", "ops:carol"),
    ]
