"""Cron at its edges (found by a cold review): a job back after an absence, a long tick, a
database clock stepped back, a schedule changed across a slot, a long catch-up that loses
its leadership, and bad definitions. Both stores; an injected clock, never real minutes."""

from __future__ import annotations

import functools
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest

import errands
from errands.errors import ConfigurationError
from errands.maintenance.scheduler import CATCH_UP_MAX, Scheduler
from errands.maintenance.service import Maintenance

DAY = datetime(2031, 3, 1, tzinfo=UTC)


def slots_of(app: errands.App, name: str) -> list[datetime]:
    return sorted(j.run_at for j in app.jobs(name=name, limit=2000))


def minutely(url: str, **options: Any) -> errands.App:
    app = errands.App(url)
    app.periodic("* * * * *", name="cron.minutely", **options)(lambda: None)
    return app


def test_a_periodic_job_back_after_an_absence_starts_afresh(store_url: str) -> None:
    """Removed from the code for a week (a leader ran all along), then back (a rollback,
    a rename undone): its last slot, a week old, made every slot of the absence 'missed',
    and catch_up=True enqueued 1,000 stale jobs in one tick."""
    first, without = minutely(store_url, catch_up=True), errands.App(store_url)
    try:
        Scheduler(first).run_once(now=DAY)
        assert Scheduler(first).run_once(now=DAY + timedelta(minutes=1, seconds=5)) == 1
        Scheduler(without).run_once(now=DAY + timedelta(minutes=2))  # its leader's code
        back = DAY + timedelta(days=7, seconds=20)
        assert Scheduler(first).run_once(now=back) == 1  # the slot seen on time only
        assert slots_of(first, "cron.minutely") == [
            DAY + timedelta(minutes=1),
            back.replace(second=0),
        ]
    finally:
        first.close()
        without.close()


@pytest.mark.parametrize("catch_up", [None, False, True])
def test_every_slot_a_long_maintenance_tick_sees_on_time_runs_under_every_policy(
    store_url: str, catch_up: bool | None
) -> None:
    """With --maintenance-tick 300 each slot is seen up to 300 s late: catch_up=False
    skipped them all (a 60 s grace), and every slot of a failover once the tick was 12 s.
    Then a tick saw five slots of a minutely job, each on time: the default and
    catch_up=False ran only the newest (12 jobs in an hour, not 60)."""
    app = minutely(store_url, catch_up=catch_up)
    try:
        app.periodic("*/5 * * * *", name="cron.every5", catch_up=catch_up)(lambda: None)
        scheduler = Maintenance(app, "w-slow", tick=300.0).scheduler
        scheduler.run_once(now=DAY + timedelta(seconds=10))
        for n in range(1, 13):
            scheduler.run_once(now=DAY + timedelta(minutes=5 * n, seconds=70))
        hour = [DAY + timedelta(minutes=m) for m in range(1, 62)]
        assert slots_of(app, "cron.minutely") == hour
        assert slots_of(app, "cron.every5") == hour[4::5]
    finally:
        app.close()


@pytest.mark.parametrize("catch_up", [None, False])
def test_slots_due_while_the_leader_was_busy_run_on_time_and_after_a_lost_leadership_by_age(
    store_url: str, catch_up: bool | None
) -> None:
    """A leader's tick held 100 s by a slow duty (a prune round beside 500,000 edges took
    70 s): at its next look the slots of an every-5-s job due meanwhile were older than
    the grace, and catch_up=False skipped them ("skipped 2 missed slot(s)") though the
    leader was up all along. They run now, each; once the leadership was lost and taken
    again, the slots of the gap are judged by their age again."""
    app = errands.App(store_url)
    app.periodic("*/5 * * * * *", name="cron.five", catch_up=catch_up)(lambda: None)
    service = Maintenance(app, "w-busy", tick=1.0)
    now, busy = [DAY], [1000.0]  # the database's clock; the leader's monotonic one
    service.scheduler.clock = lambda: now[0]
    service.scheduler.monotonic = lambda: busy[0]

    def pass_time(seconds: float) -> int:
        now[0] += timedelta(seconds=seconds)
        busy[0] += seconds
        return 0

    service.prune = lambda: pass_time(100.0)  # type: ignore[method-assign]
    try:
        service.run_once()  # the job first seen at DAY, then the duty takes 100 s
        service.run_once()  # (the prune is not due again for a minute)
        assert service.is_leader
        assert slots_of(app, "cron.five") == [DAY + timedelta(seconds=s) for s in range(5, 101, 5)]

        service._resign()  # the leadership lost: another term, when taken again
        pass_time(100.0)
        service.run_once()
        assert service.is_leader
        grace = service.scheduler.grace  # 60 s: slots from 140 s on are on time
        on_time = [DAY + timedelta(seconds=s) for s in range(140, 201, 5)]
        assert on_time[0] == DAY + timedelta(seconds=200 - grace)
        missed = [DAY + timedelta(seconds=135)] if catch_up is None else []
        assert slots_of(app, "cron.five")[20:] == missed + on_time
    finally:
        app.close()


@pytest.mark.parametrize("catch_up", [None, False, True])
def test_a_failover_runs_every_slot_of_its_gap_and_the_policy_decides_the_missed_ones(
    store_url: str, catch_up: bool | None
) -> None:
    """An every-2-s job (a seconds field), a tick a second and a 6 s failover: the new
    leader's first tick saw three slots on time and ran only the newest (18 of 20). After
    an outage longer than the grace, the slots within it still run each; of the older
    (missed) ones the default runs the latest, catch_up=False none, True every one."""
    app = errands.App(store_url)
    try:
        app.periodic("*/2 * * * * *", name="cron.two", catch_up=catch_up)(lambda: None)
        scheduler = Scheduler(app)  # grace 60 s
        ticks = [s for s in range(0, 41) if not 10 < s < 16]  # no leader from 10 s to 16 s
        for second in ticks:
            scheduler.run_once(now=DAY + timedelta(seconds=second, milliseconds=500))
        assert slots_of(app, "cron.two") == [DAY + timedelta(seconds=s) for s in range(2, 41, 2)]

        scheduler.run_once(now=DAY + timedelta(seconds=200, milliseconds=500))  # an outage
        missed = [DAY + timedelta(seconds=s) for s in range(42, 141, 2)]
        on_time = [DAY + timedelta(seconds=s) for s in range(142, 201, 2)]
        kept = {None: missed[-1:], False: [], True: missed}[catch_up]
        assert slots_of(app, "cron.two")[20:] == kept + on_time
    finally:
        app.close()


def test_slots_run_again_once_a_database_clock_stepped_ahead_is_set_back(
    store_url: str,
) -> None:
    """The last slot handled only moves forward: after the clock ran 6 h ahead and was
    corrected, no slot ran until the clock caught up with it."""
    app = minutely(store_url)
    try:
        scheduler = Scheduler(app)
        scheduler.run_once(now=DAY)
        scheduler.run_once(now=DAY + timedelta(hours=6, seconds=5))  # stepped ahead
        for minute in range(1, 4):  # set back: ticks on the right time again
            scheduler.run_once(now=DAY + timedelta(minutes=minute, seconds=5))
        assert slots_of(app, "cron.minutely") == [
            DAY + timedelta(minutes=2),
            DAY + timedelta(minutes=3),
            DAY + timedelta(hours=5, minutes=59),  # the latest missed slot (the default)
            DAY + timedelta(hours=6),  # and the one on time
        ]
    finally:
        app.close()


def test_a_changed_schedule_still_runs_a_slot_due_in_the_deploys_gap(store_url: str) -> None:
    """*/5 changed to */10, the old code's last tick at 09:59, the new code's first at
    10:00:06: the 10:00 slot is in both schedules and never ran."""
    old, new = errands.App(store_url), errands.App(store_url)
    try:
        old.periodic("*/5 * * * *", name="cron.report")(lambda: None)
        new.periodic("*/10 * * * *", name="cron.report")(lambda: None)
        Scheduler(old).run_once(now=DAY + timedelta(hours=9, minutes=50, seconds=30))
        Scheduler(old).run_once(now=DAY + timedelta(hours=9, minutes=59))
        assert Scheduler(new).run_once(now=DAY + timedelta(hours=10, seconds=6)) == 1
        assert slots_of(new, "cron.report") == [
            DAY + timedelta(hours=9, minutes=55),
            DAY + timedelta(hours=10),
        ]
    finally:
        old.close()
        new.close()


def test_a_schedule_changed_to_a_frequent_one_starts_with_one_slot_not_its_whole_grace(
    store_url: str,
) -> None:
    """A 03:00 daily job redeployed every 2 seconds, under a grace of 60 s: its first tick
    ran each of the new schedule's 30 slots in the grace before the deploy, runs dated
    before it was deployed (every on-time slot runs, but these were never due)."""
    old, new = errands.App(store_url), errands.App(store_url)
    try:
        old.periodic("0 3 * * *", name="cron.sweep")(lambda: None)
        new.periodic("*/2 * * * * *", name="cron.sweep")(lambda: None)
        Scheduler(old, grace=60).run_once(now=DAY + timedelta(hours=9))
        deployed = DAY + timedelta(hours=10, seconds=1)
        assert Scheduler(new, grace=60).run_once(now=deployed) == 1
        assert slots_of(new, "cron.sweep") == [DAY + timedelta(hours=10)]
    finally:
        old.close()
        new.close()


def test_a_long_catch_up_stops_when_the_leadership_is_lost_and_the_next_goes_on(
    store_url: str,
) -> None:
    """Leadership was asked between periodic jobs only: 1,000 slots of one job (a slow
    before_insert hook: 11 s) held the leader past its ttl while another took over."""
    app = minutely(store_url, catch_up=True)
    try:
        scheduler = Scheduler(app)
        scheduler.run_once(now=DAY)
        answers = iter([True, True, True, False])  # leader for the job and 2 more slots
        later = DAY + timedelta(minutes=10, seconds=5)
        assert scheduler.run_once(now=later, go_on=lambda: next(answers)) == 3
        assert Scheduler(app).run_once(now=later) == 7  # from where it stopped
        assert slots_of(app, "cron.minutely") == [DAY + timedelta(minutes=m) for m in range(1, 11)]
    finally:
        app.close()


def test_a_year_behind_a_minutely_job_runs_its_latest_slots(store_url: str) -> None:
    """The walk starts at the oldest slot it may keep (walking every slot of a year took
    seconds on the leader's thread): catch_up=True gets the latest CATCH_UP_MAX."""
    app = minutely(store_url, catch_up=True)
    try:
        scheduler = Scheduler(app)
        scheduler.run_once(now=DAY)
        now = DAY + timedelta(days=365, seconds=5)
        assert scheduler.run_once(now=now) == CATCH_UP_MAX
        slots = slots_of(app, "cron.minutely")
        assert slots[-1] == now.replace(second=0)
        assert slots[0] == now.replace(second=0) - timedelta(minutes=CATCH_UP_MAX - 1)
    finally:
        app.close()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"catch_up": 1}, r"catch_up=1; give None .*, True .* or False"),
        ({"catch_up": "all"}, r"catch_up='all'"),
        ({"args": {"queue": "other"}}, r"args names \['queue'\], enqueue option"),
        ({"args": [("region", "eu")]}, r"give a dict of the job's arguments"),
        ({"tz": None}, r"tz=None: give an IANA time zone name"),
        ({"unique_for": 60}, r"unique_for= does not apply: each run is keyed by its slot"),
        ({"args": {1: 2}}, r"its keys are the job's parameter names \(strings\)"),
    ],
)
def test_bad_periodic_options_fail_at_definition_naming_the_fix(
    tmp_path: Path, options: dict[str, Any], message: str
) -> None:
    app = errands.App(f"sqlite:///{tmp_path}/errands.db")

    def report(region: str = "eu") -> None: ...

    with pytest.raises(ConfigurationError, match=message):
        app.periodic("*/5 * * * *", name="bad.periodic", **options)(report)
    assert (app.registry, app.schedules) == ({}, {})


def test_a_cron_expression_that_is_not_a_string_fails_naming_the_fix(tmp_path: Path) -> None:
    app = errands.App(f"sqlite:///{tmp_path}/errands.db")
    with pytest.raises(ConfigurationError, match="give a string of five fields"):
        app.periodic(None, name="bad.periodic")(lambda: None)  # type: ignore[arg-type]


def test_a_job_is_a_function_not_a_partial(tmp_path: Path) -> None:
    """A functools.partial failed from inside typing (or on its missing __qualname__)."""
    app = errands.App(f"sqlite:///{tmp_path}/errands.db")

    def report(region: str) -> None: ...

    for name in (None, "report.eu"):
        with pytest.raises(ConfigurationError, match=r"a job is a function \(def or async def"):
            app.periodic("0 3 * * *", name=name)(functools.partial(report, "eu"))
        with pytest.raises(ConfigurationError, match=r"a job is a function \(def or async def"):
            app.job(name=name)(functools.partial(report, "eu"))
    assert (app.registry, app.schedules) == ({}, {})
    cached = app.job(name="report.cached")(functools.lru_cache(report))  # still a job
    assert cached.name == "report.cached"


def test_a_zoneinfo_and_a_job_already_defined_are_taken(tmp_path: Path) -> None:
    app = errands.App(f"sqlite:///{tmp_path}/errands.db")

    @app.periodic("0 9 * * *", tz=ZoneInfo("Europe/Paris"))
    @app.job(name="report.daily", queue="reports")
    def daily() -> None: ...

    [periodic] = app.schedules.values()
    assert (periodic.name, periodic.timezone) == ("report.daily", "Europe/Paris")
    assert periodic.bound.request.queue == "reports"
    with pytest.raises(ConfigurationError, match=r"give \['queue'\] to its @app.job"):
        app.periodic("0 9 * * *", queue="other")(daily)


def test_a_second_schedule_on_one_job_fails_naming_both_instead_of_replacing_the_first(
    tmp_path: Path,
) -> None:
    """Two @app.periodic stacked on one function (a Celery beat habit), or one job
    scheduled twice with other arguments: the second replaced the first without a word,
    and only one of them ever ran. It fails naming both schedules and the fix; the same
    schedule registered again (its module run twice) changes nothing."""
    app = errands.App(f"sqlite:///{tmp_path}/errands.db")
    try:
        with pytest.raises(ConfigurationError) as stacked:

            @app.periodic("0 17 * * *")
            @app.periodic("0 9 * * *", name="cron.report")
            def report() -> None: ...

        message = str(stacked.value)
        assert "'0 9 * * *' (tz UTC" in message and "'0 17 * * *' (tz UTC" in message, message
        assert "'0 9,17 * * *'" in message and "name='cron.report.2'" in message, message
        [first] = app.schedules.values()
        assert first.expression == "0 9 * * *"  # the first is kept, untouched

        @app.job(name="cron.reconcile")
        def reconcile(region: str) -> None: ...

        app.periodic("*/5 * * * *", args={"region": "eu"})(reconcile)
        assert app.periodic("*/5 * * * *", args={"region": "eu"})(reconcile) is reconcile
        with pytest.raises(ConfigurationError, match=r"'region': 'eu'.*'region': 'us'"):
            app.periodic("*/5 * * * *", args={"region": "us"})(reconcile)
        # the fix it names: the function as a job type of its own
        app.periodic("*/5 * * * *", args={"region": "us"}, name="cron.reconcile.2")(reconcile.fn)
        scheduler = Scheduler(app)
        scheduler.run_once(now=DAY)
        scheduler.run_once(now=DAY + timedelta(minutes=5, seconds=5))
        runs = {(j.name, j.args["region"]) for j in app.jobs(limit=100) if "reconcile" in j.name}
        assert runs == {("cron.reconcile", "eu"), ("cron.reconcile.2", "us")}
    finally:
        app.close()
