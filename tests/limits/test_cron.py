"""Cron: ``@app.periodic(expression, tz=, args=, catch_up=)`` (item 6).

The scheduler (the maintenance leader's duty) inserts each slot with the slot as the
idempotency key, so any number of schedulers insert each slot once. Tests move an
injected clock instead of waiting for real minutes.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

import errands
from errands.backends.base import WorkerInfo
from errands.errors import ConfigurationError, InvalidPayload
from errands.maintenance.scheduler import MISFIRE_GRACE, Scheduler
from errands.maintenance.service import Maintenance

from .helpers import LimitsCluster

START = datetime(2031, 3, 1, 12, 0, 30, tzinfo=UTC)


def cron_app(url: str) -> errands.App:
    """One deployment of the same code: each scheduler process has its own App."""
    app = errands.App(url)

    @app.periodic("* * * * *", args={"region": "eu"}, name="cron.minutely")
    def minutely(region: str) -> None: ...

    return app


@pytest.fixture
def three_apps(store_url: str) -> Iterator[list[errands.App]]:
    apps = [cron_app(store_url) for _ in range(3)]
    yield apps
    for app in apps:
        app.close()


def slots_of(app: errands.App, name: str) -> list[datetime]:
    return sorted(j.run_at for j in app.jobs(name=name, limit=1000))


def test_three_schedulers_over_ten_cron_slots_insert_exactly_ten_jobs(
    three_apps: list[errands.App],
) -> None:
    """Given three schedulers (no leadership between them: the worst case) racing on each
    of 10 minutely slots, with clocks a few seconds apart, then exactly 10 jobs exist,
    one per slot, each keyed and scheduled at its slot."""
    schedulers = [Scheduler(app) for app in three_apps]
    for scheduler in schedulers:
        assert scheduler.run_once(now=START) == 0  # first sight: starts from now

    for minute in range(1, 11):
        barrier = threading.Barrier(len(schedulers))
        errors: list[BaseException] = []

        def tick(
            index: int,
            scheduler: Scheduler,
            minute: int = minute,
            barrier: threading.Barrier = barrier,
            errors: list[BaseException] = errors,
        ) -> None:
            try:
                barrier.wait()
                scheduler.run_once(now=START + timedelta(minutes=minute, seconds=3 * index))
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=tick, args=(i, s)) for i, s in enumerate(schedulers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not errors, errors

    expected = [START.replace(second=0) + timedelta(minutes=m) for m in range(1, 11)]
    jobs = three_apps[0].jobs(name="cron.minutely", limit=100)
    assert sorted(j.run_at for j in jobs) == expected
    assert sorted(j.idempotency_key for j in jobs) == [
        f"cron:{slot:%Y-%m-%dT%H:%M:%SZ}" for slot in expected
    ]
    assert {json.dumps(j.args) for j in jobs} == {'{"region": "eu"}'}
    assert sum(s.inserted for s in schedulers) == 10


def test_only_the_maintenance_leader_inserts_cron_slots(
    three_apps: list[errands.App],
) -> None:
    services = [Maintenance(app, f"w-{i}") for i, app in enumerate(three_apps)]
    now = START
    for service in services:
        service.scheduler.clock = lambda: now
    for minute in range(0, 11):
        now = START + timedelta(minutes=minute)
        for service in services:
            service.run_once()
    assert [s.is_leader for s in services] == [True, False, False]
    assert [s.scheduler.inserted for s in services] == [10, 0, 0]
    assert len(slots_of(three_apps[0], "cron.minutely")) == 10


def policy_app(url: str) -> errands.App:
    app = errands.App(url)
    for name, catch_up in (("latest", None), ("all", True), ("skip", False)):
        app.periodic("*/5 * * * *", name=f"misfire.{name}", catch_up=catch_up)(lambda: None)
    return app


def test_misfire_policy_latest_once_by_default_all_with_catch_up_none_with_catch_up_false(
    store_url: str,
) -> None:
    """Given three */5 jobs first seen at 00:00:30, when the scheduler next runs at
    00:52 (10 slots missed, the last 120 s ago), then the default runs the latest missed
    slot once, catch_up=True runs all 10, catch_up=False none; a slot seen on time (within
    60 s) runs under every policy."""
    app = policy_app(store_url)
    try:
        scheduler = Scheduler(app)
        day = datetime(2031, 3, 1, tzinfo=UTC)
        scheduler.run_once(now=day + timedelta(seconds=30))
        scheduler.run_once(now=day + timedelta(minutes=52))
        counts = {n: len(slots_of(app, f"misfire.{n}")) for n in ("latest", "all", "skip")}
        assert counts == {"latest": 1, "all": 10, "skip": 0}
        assert slots_of(app, "misfire.latest") == [day + timedelta(minutes=50)]
        assert slots_of(app, "misfire.all") == [day + timedelta(minutes=m) for m in range(5, 55, 5)]

        assert MISFIRE_GRACE == 60.0
        scheduler.run_once(now=day + timedelta(minutes=55, seconds=20))  # on time
        counts = {n: len(slots_of(app, f"misfire.{n}")) for n in ("latest", "all", "skip")}
        assert counts == {"latest": 2, "all": 11, "skip": 1}
        assert slots_of(app, "misfire.skip") == [day + timedelta(minutes=55)]
    finally:
        app.close()


def test_time_zone_slots_follow_the_zone_across_a_daylight_saving_change(
    store_url: str,
) -> None:
    """09:00 in Europe/Paris is 08:00 UTC before 30 March 2031 and 07:00 UTC after."""
    app = errands.App(store_url)
    try:
        app.periodic("0 9 * * *", tz="Europe/Paris", name="paris.nine")(lambda: None)
        scheduler = Scheduler(app)
        scheduler.run_once(now=datetime(2031, 3, 28, 12, 0, tzinfo=UTC))
        scheduler.run_once(now=datetime(2031, 3, 29, 8, 0, 10, tzinfo=UTC))
        scheduler.run_once(now=datetime(2031, 3, 30, 7, 0, 10, tzinfo=UTC))
        assert slots_of(app, "paris.nine") == [
            datetime(2031, 3, 29, 8, 0, tzinfo=UTC),
            datetime(2031, 3, 30, 7, 0, tzinfo=UTC),
        ]
        [info] = app.periodic_jobs()
        assert info.timezone == "Europe/Paris"
        assert info.next_run.utcoffset() in (timedelta(hours=1), timedelta(hours=2))
        assert (info.next_run.hour, info.next_run.minute) == (9, 0)
    finally:
        app.close()


def test_a_changed_schedule_starts_from_now_instead_of_running_the_new_ones_missed_slots(
    store_url: str,
) -> None:
    """A 03:00 job moved to 04:00 and deployed at 14:00 ran at once: the slots of the new
    schedule since the old one's last counted as missed (catch_up=True ran every one).
    The schedule (and its time zone) is stored with the state: a change starts anew."""
    day = datetime(2031, 3, 1, tzinfo=UTC)
    old = errands.App(store_url)
    old.periodic("0 3 * * *", name="report.nightly", catch_up=True)(lambda: None)
    scheduler = Scheduler(old)
    scheduler.run_once(now=day)  # first seen
    assert scheduler.run_once(now=day + timedelta(hours=3, seconds=5)) == 1
    old.close()
    new = errands.App(store_url)
    try:
        new.periodic("0 4 * * *", name="report.nightly", catch_up=True)(lambda: None)
        scheduler = Scheduler(new)
        assert scheduler.run_once(now=day + timedelta(days=2, hours=14)) == 0  # not 2 slots
        assert scheduler.run_once(now=day + timedelta(days=3, hours=4, seconds=5)) == 1
        assert slots_of(new, "report.nightly") == [
            day + timedelta(hours=3),
            day + timedelta(days=3, hours=4),
        ]
    finally:
        new.close()


def test_a_job_first_seen_in_the_repeated_autumn_hour_runs_no_slot_from_before(
    store_url: str,
) -> None:
    """'30 1 * * *' in America/New_York, first seen at 01:10 EST on 2 November 2031 (the
    second 01:00-02:00): the cron library gives 01:30 EDT, which was before it was first
    seen, and it ran (then repeated the skip warning every tick for a day)."""
    app = errands.App(store_url)
    try:
        app.periodic("30 1 * * *", tz="America/New_York", name="ny.half_one")(lambda: None)
        scheduler = Scheduler(app)
        first_seen = datetime(2031, 11, 2, 6, 10, tzinfo=UTC)  # 01:10 EST
        scheduler.run_once(now=first_seen)
        assert scheduler.run_once(now=first_seen + timedelta(minutes=30)) == 0
        assert slots_of(app, "ny.half_one") == []
    finally:
        app.close()


@pytest.mark.parametrize(
    ("expression", "tz", "message"),
    [
        ("*/5 * * *", "UTC", r"bad cron expression '\*/5 \* \* \*' \(Wrong number of fields\)"),
        ("61 * * * *", "UTC", r"bad cron expression '61 \* \* \* \*' \(Bad minute\)"),
        ("@hourly", "UTC", "write five fields: minute hour day-of-month month day-of-week"),
        ("0 9 30 2 *", "UTC", r"\(Bad day-of-month\)"),
        ("0 9 * * *", "Europe/Pariss", "unknown time zone 'Europe/Pariss'; use an IANA name"),
    ],
)
def test_bad_cron_expression_or_time_zone_fails_at_definition_with_a_clear_error(
    tmp_path: Path, expression: str, tz: str, message: str
) -> None:
    app = errands.App(f"sqlite:///{tmp_path}/errands.db")
    with pytest.raises(ConfigurationError, match=message):
        app.periodic(expression, tz=tz, name="bad.cron")(lambda: None)
    assert (app.registry, app.schedules) == ({}, {})


def test_bad_periodic_arguments_fail_at_definition_and_register_nothing(tmp_path: Path) -> None:
    app = errands.App(f"sqlite:///{tmp_path}/errands.db")

    def needs_region(region: str) -> None: ...

    with pytest.raises(InvalidPayload, match="region: Field required"):
        app.periodic("*/5 * * * *", name="needs.region")(needs_region)
    assert (app.registry, app.schedules) == ({}, {})
    app.periodic("*/5 * * * *", name="needs.region", args={"region": "eu"})(needs_region)
    assert list(app.schedules) == ["needs.region"]


def test_cron_list_shows_schedules_time_zones_next_runs_and_last_slots(
    cluster: LimitsCluster,
) -> None:
    app = cluster.app("cron_app")
    scheduler = Scheduler(app)
    now = datetime.fromtimestamp(app.backend.db_now(), tz=UTC)
    # Ten minutes of slots, ending now; or ending before 03:00 UTC when that is in them:
    # "nightly" (0 3 * * *) would have its first slot (a run at 03:0x failed so).
    end = now
    nightly = now.replace(hour=3, minute=0, second=0, microsecond=0)
    if timedelta(0) <= now - nightly < timedelta(minutes=15):
        end = nightly - timedelta(minutes=1)
    scheduler.run_once(now=end - timedelta(minutes=10))
    scheduler.run_once(now=end)  # the latest */5 slot is enqueued (the one before it too)
    last = max(app.jobs(name="reconcile", limit=10), key=lambda job: job.run_at)

    text = cluster.cli("cron", "list", "-A", "cron_app:app")
    assert text.code == 0, text
    header, *lines = text.stdout.splitlines()
    assert header.split() == [
        "name", "queue", "schedule", "tz", "next", "run", "last", "slot", "last", "job",
        "catch", "up",
    ]  # fmt: skip
    rows = {line.split()[0]: line for line in lines}
    assert set(rows) == {"reconcile", "nightly"}
    assert "*/5 * * * *  Europe/Paris" in rows["reconcile"]
    paris = last.run_at.astimezone(ZoneInfo("Europe/Paris"))
    assert f"{paris:%Y-%m-%d %H:%M:%S} {paris.tzname()}" in rows["reconcile"]  # Paris time
    assert rows["reconcile"].split()[-2:] == [str(last.id), "latest"]
    # before its first slot, "last slot" is when the scheduler first saw the job
    assert rows["nightly"].split()[-2:] == ["-", "all"]

    listed = cluster.cli("cron", "list", "-A", "cron_app:app", "--json")
    assert listed.code == 0, listed
    by_name = {item["name"]: item for item in listed.json()}
    reconcile = by_name["reconcile"]
    assert (reconcile["expression"], reconcile["timezone"]) == ("*/5 * * * *", "Europe/Paris")
    assert reconcile["last_job_id"] == last.id
    next_run = datetime.fromisoformat(reconcile["next_run"])
    # the next slot after the listing ran (a 5-minute boundary may pass while a busy
    # machine starts the command: bounded by the clock read after it, not before)
    listed_by = datetime.fromtimestamp(app.backend.db_now(), tz=UTC)
    assert now < next_run <= listed_by + timedelta(minutes=5)
    assert next_run.utcoffset() in (timedelta(hours=1), timedelta(hours=2))  # Paris time
    assert by_name["nightly"]["catch_up"] is True


def test_cron_list_marks_a_periodic_jobs_queue_that_no_live_worker_serves(
    cluster: LimitsCluster,
) -> None:
    app = cluster.app("cron_app")
    app.backend.schema_check()  # the store exists (admin commands refuse a missing file)
    unserved = cluster.cli("cron", "list", "-A", "cron_app:app")
    as_json = cluster.cli("cron", "list", "-A", "cron_app:app", "--json")
    app.backend.worker_register(
        WorkerInfo(id="w-live", host="h", pid=1, queues="default=4", concurrency=4, version="x")
    )
    served = cluster.cli("cron", "list", "-A", "cron_app:app")

    assert unserved.code == 0, unserved
    assert "default (no live worker)" in unserved.stdout
    assert "warning: no live worker serves default" in unserved.stderr
    assert {(i["name"], i["queue"], i["served"]) for i in as_json.json()} == {
        ("reconcile", "default", False),
        ("nightly", "default", False),
    }
    assert "no live worker" not in served.stdout + served.stderr
