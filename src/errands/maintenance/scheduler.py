"""Cron: the leader inserts each slot of each periodic job exactly once.

Each tick the leader computes, per periodic job, the slots between the last slot it
handled (``errands_cron.last_slot``) and now — by the database clock — and inserts the
job for the slots the misfire policy keeps, with the slot as idempotency key
(``cron:<slot ISO time>``). Two schedulers (a leader change, a paused leader waking up)
compute the same slots and the same keys, so a slot can never be inserted twice.

Misfire policy, for slots that passed while no leader ran (``catch_up``):

- ``None`` (default): run the latest missed slot once;
- ``True``: run every missed slot (at most ``CATCH_UP_MAX``);
- ``False``: skip missed slots.

Under every policy each slot seen within the grace (``MISFIRE_GRACE``, longer when the
maintenance tick and the leadership's ttl are) runs, however many one tick sees: a tick
or a failover never makes an on-time slot look missed. A missed slot is one older than
the grace when the scheduler first sees it, plus, for the leader's scheduler, the time
its leader was busy since its last look while leading all along (``leading``): a slow
tick (a long prune, a store waiting on a lock) never makes the slots due meanwhile look
missed either. That time is read on ``time.monotonic()``, which on Linux stops while the
host is suspended: the slots of a suspend are judged by their age.

A periodic job seen for the first time starts from now: slots before its first
deployment never run. One whose schedule changed, or that comes back after a leader
whose code did not define it (its state is marked absent then), starts from the grace
before now: the slots that were due meanwhile were never missed, they did not exist
(a job back after a week's absence ran 1,000 stale slots with catch_up=True), while a
slot due in the deploy's gap still runs (its key keeps it once).

No user code runs here (the maintenance thread): a periodic job's arguments are
validated and encoded once, when ``@app.periodic`` registers it, and each slot inserts a
copy with its own key and time. One periodic job whose slot cannot be inserted is logged
and retried next tick; it never holds the others back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from ..errors import ConfigurationError

if TYPE_CHECKING:
    from ..app import App
    from ..definition import BoundJob, JobDefinition
    from ..handle import JobHandle

log = logging.getLogger("errands.cron")

MISFIRE_GRACE = 60.0
CATCH_UP_MAX = 1000
# The expression stored for a periodic job that the last leader's code did not define
# (see Scheduler._mark_absent): never a valid schedule, so its return reads as a change.
ABSENT = "(absent)"
ABSENT_CHECK_EVERY = 60.0  # seconds, for a leader whose code defines no periodic job


@dataclass(frozen=True)
class Periodic:
    """A job run on a cron schedule (``@app.periodic``)."""

    definition: JobDefinition[Any, Any]
    expression: str
    timezone: str
    args: dict[str, Any]
    catch_up: bool | None
    bound: BoundJob  # the job with its arguments, validated and encoded at registration

    @property
    def name(self) -> str:
        return self.definition.name

    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    def slots_after(self, after: datetime, until: datetime) -> list[datetime]:
        """Slots in ``(after, until]``, oldest first (at most CATCH_UP_MAX + 1)."""
        zone = self.zone()
        # Far behind (a minutely job a year down: 525,000 slots, 5 s to walk), the walk
        # starts at the oldest slot it may keep, found walking back from ``until``.
        start = after
        back = CronSim(self.expression, (until + timedelta(seconds=1)).astimezone(zone), True)
        for n, slot in enumerate(back):
            if slot <= after:
                break
            if n > CATCH_UP_MAX:
                start = slot
                break
        found: list[datetime] = []
        for slot in CronSim(self.expression, start.astimezone(zone)):
            if slot > until:
                break
            if slot <= after:  # the repeated autumn hour: CronSim may give its first pass
                continue
            found.append(slot)
            if len(found) > CATCH_UP_MAX:
                found.pop(0)
        return found

    def next_after(self, moment: datetime) -> datetime:
        return next(iter(CronSim(self.expression, moment.astimezone(self.zone()))))

    def for_slot(self, slot: datetime) -> BoundJob:
        """The job of one slot: the registered arguments, the slot as key and time."""
        from ..definition import BoundJob

        request = self.bound.request
        return BoundJob(
            self.definition,
            replace(request, meta=dict(request.meta), key=slot_key(slot), run_at=slot.timestamp()),
        )


def check_schedule(expression: object, timezone: object, name: str) -> str:
    """Fail at definition with a clear error for a bad expression or time zone; the time
    zone's name (a ZoneInfo is taken for its key)."""
    if isinstance(timezone, ZoneInfo) and timezone.key:
        timezone = timezone.key
    if not isinstance(timezone, str):
        raise ConfigurationError(
            f"periodic job {name!r}: tz={timezone!r}: give an IANA time zone name such as "
            "tz='UTC' or tz='Europe/Paris'"
        )
    if not isinstance(expression, str):
        raise ConfigurationError(
            f"periodic job {name!r}: the cron expression is {expression!r}; give a string "
            "of five fields, as in '*/5 * * * *'"
        )
    try:
        zone = ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError):
        raise ConfigurationError(
            f"periodic job {name!r}: unknown time zone {timezone!r}; use an IANA name such as "
            "'UTC' or 'Europe/Paris'"
        ) from None
    try:
        next(iter(CronSim(expression, datetime.now(zone))))
    except (CronSimError, StopIteration) as exc:
        raise ConfigurationError(
            f"periodic job {name!r}: bad cron expression {expression!r} ({exc}); write five "
            "fields: minute hour day-of-month month day-of-week, as in '*/5 * * * *'"
        ) from None
    return timezone


def check_catch_up(catch_up: object, name: str) -> bool | None:
    """``catch_up`` is None, True or False (1 counted as True and ran one slot; "all"
    behaved as the default and broke ``errands cron list``)."""
    if catch_up is None or isinstance(catch_up, bool):
        return catch_up
    raise ConfigurationError(
        f"periodic job {name!r}: catch_up={catch_up!r}; give None (run the latest missed "
        "slot once), True (run every missed slot) or False (skip missed slots)"
    )


def check_one_schedule(
    before: Periodic, expression: str, timezone: str, args: dict[str, Any], catch_up: bool | None
) -> None:
    """A job type has one schedule: ``@app.periodic`` on a job that has one already passes
    when it is the same schedule again (the module that registers it run twice), and
    fails naming both otherwise. The second replaced the first without a word (two
    schedules stacked on one function, a Celery beat habit, ran only the outer one; one
    job scheduled for two regions, only for the last)."""
    first = (before.expression, before.timezone, before.args, before.catch_up)
    if (expression, timezone, args, catch_up) == first:
        return
    name = before.name
    raise ConfigurationError(
        f"periodic job {name!r} already has the schedule {_schedule_text(*first)}; a second "
        f"one, {_schedule_text(expression, timezone, args, catch_up)}, would replace it: a "
        "job type has one schedule. Write both times in one cron expression when the "
        "arguments are the same (a list: '0 9,17 * * *'), or schedule the function as a "
        f"job type of its own for the second: app.periodic({expression!r}, ..., "
        f"name={name + '.2'!r})(the function; for a job already defined, its .fn)"
    )


def _schedule_text(
    expression: str, timezone: str, args: dict[str, Any], catch_up: bool | None
) -> str:
    catch = "" if catch_up is None else f", catch_up={catch_up}"
    return f"{expression!r} (tz {timezone}, args {args!r}{catch})"


def slot_key(slot: datetime) -> str:
    return "cron:" + slot.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Scheduler:
    """Inserts due cron slots. Run by the maintenance leader; ``clock`` is injectable."""

    def __init__(
        self,
        app: App,
        clock: Callable[[], datetime] | None = None,
        *,
        grace: float = MISFIRE_GRACE,
    ) -> None:
        self.app = app
        self.clock = clock or (lambda: datetime.fromtimestamp(app.backend.db_now(), tz=UTC))
        # How late a slot may be seen and still be on time: at least MISFIRE_GRACE, and a
        # tick plus a leadership's ttl (a 300 s tick saw every slot late, and catch_up=False
        # skipped them all; a failover with a 12 s tick, each slot of the ttl)
        self.grace = max(grace, MISFIRE_GRACE)
        self.inserted = 0
        self._first = 0  # the periodic job a tick starts with
        # The last look of the leader's scheduler: its leadership's term, and when
        # (monotonic; see the module's docstring). Injectable, as ``clock`` is.
        self.monotonic: Callable[[], float] = time.monotonic
        self._looked: tuple[object, float] | None = None
        self._clock_warned: set[str] = set()
        self._absent_checked = float("-inf")  # monotonic: the last look with no periodic job

    def run_once(
        self,
        now: datetime | None = None,
        go_on: Callable[[], bool] | None = None,
        leading: object | None = None,
    ) -> int:
        """Insert the due slots of every periodic job; the number inserted. ``go_on``
        (the leader's renewal) is asked before each periodic job: a tick whose inserts
        wait on slow hooks stops when the leadership is lost. After one insert timed out
        on its lane, the others of this tick are left to the next (each could take a
        whole hook_timeout, N of them far past the leader's lease).

        ``leading`` names the leadership's term (the maintenance leader's; it changes when
        the leadership is lost and taken again): from one look to the next of the same
        term, the slots due meanwhile are on time however late this look is (a slow duty
        held the tick: catch_up=False skipped them, with the leader up all along)."""
        looked = self.monotonic()
        busy = 0.0
        if leading is not None and self._looked is not None and self._looked[0] == leading:
            busy = max(looked - self._looked[1], 0.0)
        self._looked = None if leading is None else (leading, looked)
        periodic = list(self.app.schedules.values())
        if not periodic:
            # Nothing to insert; the states of periodic jobs other code defined are
            # marked absent, once a minute (a read a tick for nothing, else).
            if time.monotonic() >= self._absent_checked + ABSENT_CHECK_EVERY:
                self._absent_checked = time.monotonic()
                self._mark_absent(self.app.backend.cron_states())
            return 0
        now_given = now is not None  # a test's clock: not read again
        now = now or self.clock()
        backend = self.app.backend
        states = {s.name: s for s in backend.cron_states()}
        self._mark_absent([s for s in states.values() if s.name not in self.app.schedules])
        count = 0
        # The next tick starts after one that timed out: a hook hanging on one job's slots
        # never keeps the others waiting for ever.
        first = self._first % len(periodic)
        for index, job in enumerate(periodic[first:] + periodic[:first]):
            if go_on is not None and not go_on():
                break
            try:
                count += self._run_one(job, states.get(job.name), now, go_on, now_given, busy)
            except TimeoutError:
                log.error(
                    "cron %s: its insert timed out (a before_insert hook?); this tick's "
                    "other periodic jobs wait for the next",
                    job.name,
                )
                self._first = first + index + 1
                break
            except Exception:
                log.exception(
                    "cron %s: inserting its due slots failed; retrying next tick", job.name
                )
        self.inserted += count
        return count

    def _mark_absent(self, states: list[Any]) -> None:
        """Mark the state of each periodic job this leader's code does not define (removed,
        renamed, or not yet deployed here): when a leader defines it again its slots start
        afresh, not from a last slot that may be a week old. Written once per absence."""
        for state in states:
            if state.expression == ABSENT:
                continue
            try:
                self.app.backend.cron_save(
                    state.name, ABSENT, state.timezone, state.last_slot or 0.0, None, None
                )
                log.info(
                    "cron %s: not defined in this leader's code; its slots start afresh "
                    "when a leader defines it again", state.name,
                )  # fmt: skip
            except Exception as exc:
                log.warning("cron %s: could not mark it absent (%s); next tick", state.name, exc)

    def _run_one(
        self,
        job: Periodic,
        state: Any,
        now: datetime,
        go_on: Callable[[], bool] | None = None,
        now_given: bool = True,
        busy: float = 0.0,
    ) -> int:
        backend = self.app.backend
        count = 0
        if state is None or state.last_slot is None:
            # Seen for the first time: it starts from now (slots before its first
            # deployment never run).
            backend.cron_save(job.name, job.expression, job.timezone, now.timestamp(), None,
                              job.next_after(now).timestamp())  # fmt: skip
            return 0
        last = datetime.fromtimestamp(state.last_slot, tz=UTC)
        changed = (state.expression, state.timezone) != (job.expression, job.timezone)
        if changed:
            # Its schedule (or time zone) changed, or it is back after an absence: it
            # starts from the grace before now. The new schedule's slots since the old
            # one's last were never due (a 03:00 job moved to 04:00 at 14:00 ran at once;
            # catch_up=True ran each), but one due in the deploy's gap still runs.
            log.info(
                "cron %s: %s %r (%s); its slots start from now",
                job.name, "back, with schedule" if state.expression == ABSENT
                else "schedule changed to", job.expression, job.timezone,
            )  # fmt: skip
            last = max(last, now - timedelta(seconds=self.grace))
        elif last > now + timedelta(seconds=self.grace) and (
            now_given or last > self.clock() + timedelta(seconds=self.grace)
        ):
            # The database clock is behind the last slot handled: it was stepped forward,
            # then back. Slots from now on run (their keys keep the ones inserted while it
            # ran ahead once); the last slot only moving forward skipped them all. (Asked
            # the clock again: this tick's now is stale after a pause that another leader
            # ran through.)
            if job.name not in self._clock_warned:
                self._clock_warned.add(job.name)
                log.warning(
                    "cron %s: the database clock (%s) is behind its last slot handled (%s): "
                    "was it stepped back? Slots from now on run", job.name,
                    now.isoformat(), last.isoformat(),
                )  # fmt: skip
            backend.cron_save(job.name, job.expression, job.timezone, now.timestamp(), None,
                              job.next_after(now).timestamp(), rewind=True)  # fmt: skip
            return 0
        slots = job.slots_after(last, now)
        if not slots:
            if changed:
                backend.cron_save(job.name, job.expression, job.timezone, last.timestamp(),
                                  None, job.next_after(now).timestamp())  # fmt: skip
            return 0
        # A changed schedule: its slots in the grace before now were never due (only the
        # one in the deploy's gap: the latest). Every on-time slot of an every-2-s job
        # redeployed under a grace of 300 s was 150 runs dated before the deploy.
        chosen = slots[-1:] if changed else self._apply_policy(job, slots, now, busy)
        job_id = state.last_job_id
        handled = last
        for slot in chosen:
            if go_on is not None and slot is not chosen[0] and not go_on():
                break  # leadership lost mid catch-up: the next leader goes on from here
            handle = self._insert(job.for_slot(slot))
            job_id, handled = handle.id, slot
            if not handle.deduplicated:
                count += 1
                log.info("cron %s: enqueued slot %s as job %s", job.name, slot.isoformat(), job_id)
        else:
            handled = slots[-1]  # every chosen slot inserted: the skipped ones are handled
            skipped = len(slots) - len(chosen)
            if skipped:
                log.warning(
                    "cron %s: skipped %d missed slot(s) (misfire policy)", job.name, skipped
                )
        backend.cron_save(job.name, job.expression, job.timezone, handled.timestamp(),
                          job_id, job.next_after(now).timestamp())  # fmt: skip
        return count

    def _insert(self, bound: BoundJob) -> JobHandle:
        """Enqueue one slot. The app's before_insert hooks are user code, which never runs
        on the leader's thread (a hung one stopped every rescue and every other periodic
        job): with any, the insert runs on the ``inserts`` lane, within ``hook_timeout``.
        A slot not inserted in time is tried again at the next tick (its key makes one
        that landed late count once)."""
        app = self.app
        if not app.events.inserters:
            [handle] = app.enqueue_many([bound])
            return handle
        lane = app.hooks.lane("inserts")
        what = f"cron insert of {bound.definition.name}"
        [handle] = lane.call(app.enqueue_many, [bound], timeout=app.hooks.hook_timeout, what=what)
        return handle  # type: ignore[no-any-return]

    def _apply_policy(
        self, job: Periodic, slots: list[datetime], now: datetime, busy: float = 0.0
    ) -> list[datetime]:
        """The slots to insert, oldest first. Every slot seen within the grace runs, each
        one (a 300 s tick sees five of a minutely job, a failover a few of an every-2-s
        one: only the newest ran), and so does each that fell due while the leader was
        busy since its last look (``busy`` seconds); of the missed ones, older than that,
        the default runs the latest, catch_up=True each, catch_up=False none."""
        if job.catch_up is True:
            return slots
        late = self.grace + busy
        on_time = [s for s in slots if (now - s).total_seconds() <= late]
        if job.catch_up is False:
            return on_time
        missed = slots[: len(slots) - len(on_time)]
        return missed[-1:] + on_time


@dataclass(frozen=True)
class PeriodicInfo:
    name: str
    expression: str
    timezone: str
    catch_up: bool | None
    next_run: datetime
    last_slot: datetime | None
    last_job_id: int | None
    queue: str = ""  # where its runs are enqueued
    served: bool = True  # some live worker serves that queue (else the runs wait there)


def describe(app: App) -> list[PeriodicInfo]:
    from ..fleet import live_served_queues

    now = datetime.fromtimestamp(app.backend.db_now(), tz=UTC)
    states = {s.name: s for s in app.backend.cron_states()}
    served = live_served_queues(app) if app.schedules else set()
    infos = []
    for job in app.schedules.values():
        state = states.get(job.name)
        queue = job.bound.request.queue
        infos.append(
            PeriodicInfo(
                name=job.name,
                expression=job.expression,
                timezone=job.timezone,
                catch_up=job.catch_up,
                next_run=job.next_after(now),
                last_slot=None
                if state is None or state.last_slot is None
                else datetime.fromtimestamp(state.last_slot, tz=UTC),
                last_job_id=None if state is None else state.last_job_id,
                queue=queue,
                served=queue in served,
            )
        )
    return infos
