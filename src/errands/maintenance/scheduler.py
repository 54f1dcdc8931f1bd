"""Cron: the leader inserts each slot of each periodic job exactly once.

Each tick the leader computes, per periodic job, the slots between the last slot it
handled (``errands_cron.last_slot``) and now — by the database clock — and inserts the
job for the slots the misfire policy keeps, with the slot as idempotency key
(``cron:<slot ISO time>``). Two schedulers (a leader change, a paused leader waking up)
compute the same slots and the same keys, so a slot can never be inserted twice.

Misfire policy, for slots that passed while no leader ran (``catch_up``):

- ``None`` (default): run the latest missed slot once;
- ``True``: run every missed slot (at most ``CATCH_UP_MAX``);
- ``False``: skip missed slots; only a slot seen within ``MISFIRE_GRACE`` seconds runs.

A periodic job seen for the first time starts from now: slots before its first
deployment never run.

No user code runs here (the maintenance thread): a periodic job's arguments are
validated and encoded once, when ``@app.periodic`` registers it, and each slot inserts a
copy with its own key and time. One periodic job whose slot cannot be inserted is logged
and retried next tick; it never holds the others back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
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
        found: list[datetime] = []
        for slot in CronSim(self.expression, after.astimezone(self.zone())):
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


def check_schedule(expression: str, timezone: str, name: str) -> None:
    """Fail at definition with a clear error for a bad expression or time zone."""
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


def slot_key(slot: datetime) -> str:
    return "cron:" + slot.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Scheduler:
    """Inserts due cron slots. Run by the maintenance leader; ``clock`` is injectable."""

    def __init__(self, app: App, clock: Callable[[], datetime] | None = None) -> None:
        self.app = app
        self.clock = clock or (lambda: datetime.fromtimestamp(app.backend.db_now(), tz=UTC))
        self.inserted = 0
        self._first = 0  # the periodic job a tick starts with

    def run_once(self, now: datetime | None = None, go_on: Callable[[], bool] | None = None) -> int:
        """Insert the due slots of every periodic job; the number inserted. ``go_on``
        (the leader's renewal) is asked before each periodic job: a tick whose inserts
        wait on slow hooks stops when the leadership is lost. After one insert timed out
        on its lane, the others of this tick are left to the next (each could take a
        whole hook_timeout, N of them far past the leader's lease)."""
        periodic = list(self.app.schedules.values())
        if not periodic:
            return 0
        now = now or self.clock()
        backend = self.app.backend
        states = {s.name: s for s in backend.cron_states()}
        count = 0
        # The next tick starts after one that timed out: a hook hanging on one job's slots
        # never keeps the others waiting for ever.
        first = self._first % len(periodic)
        for index, job in enumerate(periodic[first:] + periodic[:first]):
            if go_on is not None and not go_on():
                break
            try:
                count += self._run_one(job, states.get(job.name), now)
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

    def _run_one(self, job: Periodic, state: Any, now: datetime) -> int:
        backend = self.app.backend
        count = 0
        changed = state is not None and (
            (state.expression, state.timezone) != (job.expression, job.timezone)
        )
        if state is None or state.last_slot is None or changed:
            # Seen for the first time, or its schedule (or time zone) changed: it starts
            # from now. Its new schedule's slots since the old one's last were never due
            # (a 03:00 job moved to 04:00 at 14:00 ran at once; catch_up=True ran each).
            if changed:
                log.info(
                    "cron %s: schedule changed to %r (%s); its slots start from now",
                    job.name, job.expression, job.timezone,
                )  # fmt: skip
            backend.cron_save(job.name, job.expression, job.timezone, now.timestamp(), None,
                              job.next_after(now).timestamp())  # fmt: skip
            return 0
        last = datetime.fromtimestamp(state.last_slot, tz=UTC)
        slots = job.slots_after(last, now)
        if not slots:
            return 0
        chosen = self._apply_policy(job, slots, now)
        job_id = state.last_job_id
        for slot in chosen:
            handle = self._insert(job.for_slot(slot))
            job_id = handle.id
            if not handle.deduplicated:
                count += 1
                log.info("cron %s: enqueued slot %s as job %s", job.name, slot.isoformat(), job_id)
        skipped = len(slots) - len(chosen)
        if skipped:
            log.warning("cron %s: skipped %d missed slot(s) (misfire policy)", job.name, skipped)
        backend.cron_save(job.name, job.expression, job.timezone, slots[-1].timestamp(),
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

    @staticmethod
    def _apply_policy(job: Periodic, slots: list[datetime], now: datetime) -> list[datetime]:
        if job.catch_up is True:
            return slots
        on_time = [s for s in slots if (now - s).total_seconds() <= MISFIRE_GRACE]
        if job.catch_up is False:
            return on_time[-1:]
        return slots[-1:]


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
