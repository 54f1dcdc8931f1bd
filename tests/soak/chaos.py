"""The chaos driver: one fault at a time, at random intervals, each healed and timed.

Fault kinds (RELIABILITY.md):

==============  ====  ============================================================
``sigkill``     F1    SIGKILL a random worker mid-run, restart it
``sigstop``     F5    SIGSTOP a random worker for 3 x lease, then SIGCONT
``conn_kill``   F7    ``pg_terminate_backend`` on the workers' sessions, 3 rounds
``pg_restart``  F6    ``pg_ctl restart`` of the tests' own cluster, ``-m immediate``/``fast``
``proxy_cut``   F8    blackhole one worker's TCP proxy for 2-3 x lease, then heal it
                      (half the time resetting every connection through it)
``cancel``      F19   freeze the worker of a running job and cancel that job right
                      around its lease expiry, racing the rescue
``sigterm``     F4    SIGTERM the worker of a long job (a graceful stop mid-job): the
                      job outlives the grace period and is released; restart the worker
==============  ====  ============================================================

The long jobs these faults aim at are, in turn, a sync handler that raises when asked to
stop (``soak.slow``), one that returns normally (``soak.slow_return``) and an async one
(``soak.aslow``); while one runs, the driver reads its stored ``ctx.progress``.

The driver draws kinds from a shuffled deck (every kind once per round), so a short run
still injects each kind; between faults it waits a random gap. After each heal it
enqueues a *canary* (a job of the highest priority): the seconds from the heal to the
canary's first pickup are the fault's recovery time (I9).
"""

from __future__ import annotations

import random
import re
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import soak_app

import errands
from errands.faults import CRASH_EXIT_CODE

from .cluster import Cluster, Slot
from .store import Store
from .workload import Workload

SQLITE_KINDS = ("sigkill", "sigstop", "cancel", "sigterm")
POSTGRES_KINDS = (
    "sigkill", "sigstop", "conn_kill", "pg_restart", "proxy_cut", "cancel", "sigterm",
)  # fmt: skip
# Generous waits for events (a canary's pickup, a target job starting): the machine may be
# loaded; only the full-size run holds the recovery times to I9's bound.
CANARY_TIMEOUT = 180.0
TARGET_WAIT = 90.0
WARMUP = 2.0  # seconds of calm before the first fault
TARGET_SECONDS = 5.0  # the jobs the cancel fault cancels run this long
RELEASE_TARGET_SECONDS = 15.0  # ... and the ones a graceful stop releases (> the grace)
TARGET_KINDS = ("slow", "slow_return", "aslow")
STOP_TIMEOUT = 60.0  # seconds a SIGTERMed worker may take to exit (grace 5 s + hooks)

# (mode) -> seconds the server was away: restarts PostgreSQL, returns once it accepts
# connections again
Restarter = Callable[[str], float]


@dataclass
class Episode:
    kind: str
    started: float  # epoch seconds (the machine's clock, which the database also reads)
    healed: float = 0.0
    victim: str | None = None  # worker id
    detail: str = ""
    recovery: float | None = None  # heal -> canary's first pickup
    canary_id: int | None = None


@dataclass
class CancelRecord:
    job_id: int
    worker: str
    lease_expires_at: float
    requested_at: float = 0.0  # when the cancel call was made
    committed_at: float = 0.0  # when it returned: its transaction had committed
    previous_state: str = ""
    state: str = ""  # what the cancel call answered
    error: str = ""


@dataclass
class Chaos:
    cluster: Cluster
    store: Store
    workload: Workload
    app: errands.App
    rng: random.Random
    kinds: tuple[str, ...]
    lease: float
    gap: tuple[float, float]
    pg_restart: Restarter | None = None
    episodes: list[Episode] = field(default_factory=list)
    cancels: list[CancelRecord] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    terminated: int = 0  # sessions ended by conn_kill
    log: list[str] = field(default_factory=list)
    stop_exits: list[int | None] = field(default_factory=list)  # exit codes after SIGTERM
    # graceful stops cut short by an armed fault point (F2) firing in the jobs the worker
    # was finishing: a crash the soak injected, not a failed stop (exit 86, the point named)
    stops_crashed: list[str] = field(default_factory=list)
    released_targets: list[int] = field(default_factory=list)  # running at the SIGTERM
    progress_seen: Counter[str] = field(default_factory=Counter)  # target kind -> runs seen

    def __post_init__(self) -> None:
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="soak-chaos")
        self._restart_mode = 0

    def close(self) -> None:
        self._helper.shutdown(wait=True)

    # -- the loop --------------------------------------------------------------------------
    def run(
        self,
        *,
        min_each: int,
        workload_done: Callable[[], bool],
        on_plan_done: Callable[[], None],
        deadline: float,
    ) -> None:
        """Inject faults until every kind ran ``min_each`` times and the workload has
        enqueued everything (``on_plan_done`` is called once the first holds)."""
        deck: list[str] = []
        planned = False
        self.idle(WARMUP)  # a calm start: the baseline the faults are measured against
        while True:
            enough = all(self.counts[k] >= min_each for k in self.kinds)
            if enough and not planned:
                planned = True
                on_plan_done()
            if enough and workload_done():
                return
            if time.monotonic() > deadline:
                self.log.append("chaos deadline reached before the plan was complete")
                return
            if not deck:
                deck = list(self.kinds)
                self.rng.shuffle(deck)
            kind = deck.pop()
            episode = getattr(self, f"_{kind}")()
            if episode is not None:
                self.counts[kind] += 1
                self._measure_recovery(episode)
                self.episodes.append(episode)
            self.idle(self.rng.uniform(*self.gap))

    def idle(self, seconds: float) -> None:
        """Wait, restarting any worker that died meanwhile (fault points, crashes)."""
        end = time.monotonic() + seconds
        while True:
            self.cluster.supervise()
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.1, left))

    def _slot(self) -> tuple[Slot, str]:
        """A random live worker (waiting, should every one be just restarting)."""
        deadline = time.monotonic() + 60
        while not (live := self.cluster.live_ids()) and time.monotonic() < deadline:
            self.idle(0.2)
        worker_id = self.rng.choice(sorted(live))
        return live[worker_id], worker_id

    # -- recovery (I9) ----------------------------------------------------------------------
    def _measure_recovery(self, episode: Episode) -> None:
        seq, key = self.workload.next_key()
        job_id = self.workload.enqueue_extra("canary", soak_app.canary.bind(n=seq, key=key))
        episode.canary_id = job_id
        deadline = time.monotonic() + CANARY_TIMEOUT
        while time.monotonic() < deadline:
            rows = self.store.query(
                "SELECT min(claimed_at) FROM {s}soak_effects WHERE job_id = %s AND kind = 'run'",
                (job_id,),
            )
            if rows and rows[0][0] is not None:
                episode.recovery = max(float(rows[0][0]) - episode.healed, 0.0)
                return
            self.idle(0.02)
        self.log.append(f"canary {job_id} after {episode.kind} not picked up in time")

    # -- the faults ----------------------------------------------------------------------------
    def _sigkill(self) -> Episode:
        slot, victim = self._slot()
        episode = Episode("sigkill", time.time(), victim=victim)
        self.cluster.sigkill(slot)
        time.sleep(self.rng.uniform(0.0, 0.5))
        self.cluster.spawn(slot)
        episode.healed = time.time()
        return episode

    def _sigstop(self) -> Episode:
        slot, victim = self._slot()
        episode = Episode("sigstop", time.time(), victim=victim)
        self.cluster.sigstop(slot)
        self.idle(3 * self.lease)
        self.cluster.sigcont(slot)
        episode.healed = time.time()
        return episode

    def _conn_kill(self) -> Episode:
        episode = Episode("conn_kill", time.time())
        ended = 0
        for _ in range(3):
            ended += self.cluster.terminate_backends()
            self.idle(self.rng.uniform(0.3, 1.0))
        self.terminated += ended
        episode.detail = f"{ended} sessions"
        episode.healed = time.time()
        return episode

    def _pg_restart(self) -> Episode | None:
        if self.pg_restart is None:
            return None
        mode = ("immediate", "fast")[self._restart_mode % 2]
        self._restart_mode += 1
        episode = Episode("pg_restart", time.time(), detail=f"-m {mode}")
        away = self.pg_restart(mode)
        episode.detail += f", away {away:.1f} s"
        episode.healed = time.time()
        self.store.forget()
        return episode

    def _proxy_cut(self) -> Episode:
        # Cut off a worker that runs a long handler: it must stop that handler before the
        # lease runs out (self-fencing), and its late writes must be rejected (F8).
        target = self._running_target()
        if target is None:
            slot, victim = self._slot()
        else:
            _, victim, slot = target
        assert slot.proxy is not None
        reset = self.rng.random() < 0.5
        episode = Episode("proxy_cut", time.time(), victim=victim)
        slot.proxy.cut()
        self.idle(self.rng.uniform(2.0, 3.0) * self.lease)
        slot.proxy.heal(reset=reset)
        episode.detail = "healed with reset" if reset else "healed, held bytes delivered"
        episode.healed = time.time()
        return episode

    def _cancel(self) -> Episode | None:
        for _ in range(3):
            target = self._running_target()
            if target is None:
                break
            job_id, owner, slot = target
            episode = Episode("cancel", time.time(), victim=owner)
            self.cluster.sigstop(slot)
            expires = self._lease_expiry(job_id)
            if expires is None:  # it ended just before the freeze: pick another
                self.cluster.sigcont(slot)
                continue
            return self._cancel_frozen(episode, job_id, owner, slot, expires)
        self.log.append("cancel: found no running target to cancel; skipped this round")
        return None

    def _cancel_frozen(
        self, episode: Episode, job_id: int, owner: str, slot: Slot, expires: float
    ) -> Episode:
        record = CancelRecord(job_id, owner, expires)
        # Cancel right around the lease's expiry: before, during or just after the rescue.
        self.idle(max(expires - time.time() + self.rng.uniform(-0.5, 1.0), 0.0))
        record.requested_at = time.time()

        def cancel() -> Any:
            result = self.app.cancel(job_id, actor="soak-chaos")
            record.committed_at = time.time()
            return result

        future: Future[Any] = self._helper.submit(cancel)
        # Keep the worker frozen past the rescue (on SQLite the cancel may wait for the
        # frozen worker's write lock: it lands after SIGCONT, still a cancel racing a rescue).
        self.idle(max(expires - time.time(), 0.0) + 1.5)
        self.cluster.sigcont(slot)
        episode.healed = time.time()
        try:
            result = future.result(timeout=120)
            record.previous_state, record.state = result.previous_state, result.state
        except Exception as exc:  # e.g. it completed first: InvalidTransition
            record.error = f"{type(exc).__name__}: {exc}"
        self.cancels.append(record)
        episode.detail = (
            f"job {job_id} was {record.previous_state}: {record.state}"
            if record.state
            else f"job {job_id}: {record.error}"
        )
        return episode

    def _sigterm(self) -> Episode:
        """A graceful stop mid-job (F4): the long job outlives the grace period, so the
        worker releases it (recorded on the job, the attempt not charged) and exits 0."""
        target = self._running_target(RELEASE_TARGET_SECONDS)
        if target is None:
            slot, victim = self._slot()
        else:
            _, victim, slot = target
            self.released_targets.append(target[0])
        episode = Episode("sigterm", time.time(), victim=victim)
        proc = slot.proc
        code = self.cluster.stop(slot, STOP_TIMEOUT)
        point = _fault_point_fired(proc.stderr()) if proc and code == CRASH_EXIT_CODE else None
        if point is None:
            self.stop_exits.append(code)
        else:  # the stop became an injected crash: its release cannot be asked of it (A10)
            self.stops_crashed.append(point)
            if target is not None:
                self.released_targets.remove(target[0])
        self.cluster.spawn(slot)
        episode.healed = time.time()
        episode.detail = f"exit {code}" + (f", job {target[0]} was running" if target else "")
        if point is not None:
            episode.detail += f" (fault point {point} fired while it finished its jobs)"
        return episode

    def _lease_expiry(self, job_id: int) -> float | None:
        rows = self.store.query(
            f"SELECT {self.store.epoch('lease_expires_at')} FROM {{s}}errands_jobs "
            "WHERE id = %s AND state = 'running'",
            (job_id,),
        )
        return float(rows[0][0]) if rows and rows[0][0] is not None else None

    def _running_target(self, seconds: float = TARGET_SECONDS) -> tuple[int, str, Slot] | None:
        """A long job (enqueued here, ahead of the backlog) running on a live worker: two
        of one of TARGET_KINDS, in turn. Notes whether its ctx.progress was stored."""
        kind = TARGET_KINDS[sum(self.counts.values()) % len(TARGET_KINDS)]
        definition = {
            "slow": soak_app.slow, "slow_return": soak_app.slow_return, "aslow": soak_app.aslow,
        }[kind]  # fmt: skip
        ids = []
        for _ in range(2):
            seq, key = self.workload.next_key()
            job = definition.bind(n=seq, seconds=seconds, key=key, priority=500)
            ids.append(self.workload.enqueue_extra(kind, job))
        deadline = time.monotonic() + TARGET_WAIT
        marks = ", ".join(["%s"] * len(ids))
        while time.monotonic() < deadline:
            live = self.cluster.live_ids()
            rows = self.store.query(
                f"SELECT id, lease_owner, progress FROM {{s}}errands_jobs "
                f"WHERE state = 'running' AND id IN ({marks})",
                tuple(ids),
            )
            # Only a job whose handler has begun (its ctx.progress stored by a heartbeat): a
            # job claimed but still waiting for a handler thread is given back unrecorded at
            # a graceful stop, as it should be, and was taken for a target (A10 failed).
            choices = [(int(i), str(o)) for i, o, p in rows if o in live and p is not None]
            if choices:
                self.progress_seen[kind] += 1
                job_id, owner = self.rng.choice(choices)
                return job_id, owner, live[owner]
            self.idle(0.05)
        return None


def _fault_point_fired(stderr: str) -> str | None:
    """The fault point that ended a worker (its last line, see errands.faults.crash)."""
    found = re.findall(r"errands fault point (\w+): crashing", stderr[-4000:])
    return found[-1] if found else None
