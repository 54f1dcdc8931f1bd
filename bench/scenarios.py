"""Issue 17, item 5: the chaos and pressure scenarios of the third-party PostgreSQL
job-queue benchmark (hardbyte/postgresql-job-queue-benchmarking, ``bench_harness/
phases.py`` and ``hooks.py``), re-created for errands beside pgqueuer and awa-pg.

Each cell: a fresh database, two worker replicas of the system (its tuned configuration,
started from the argv its adapter prints, so a replica can be SIGKILLed and started
again), one producer enqueueing one job per call at a steady rate (``--scenario-rate``,
reconnecting after errors), and a sampler reading once a second how many handlers ran
(the probe files), how many jobs the producer had acknowledged, and, every 2 s, the
database's dead tuples. Phases, as in the third-party harness (durations scaled by
``--scenario-scale``; the pressure phase lasts ``--pressure-seconds``):

=================  ===========================================================
crash_recovery     warmup 30 s, baseline 60, SIGKILL replica 0 and wait 60,
                   start it again and wait 60, recovery 60
postgres_restart   warmup 30, baseline 60, stop PostgreSQL (fast) for half of
                   60 s then start it, recovery 60
repeated_kills     warmup 30, baseline 60, SIGKILL + restart replica 0 every
                   20 s for 120, recovery 60
pg_backend_kill    warmup 30, baseline 60, pg_terminate_backend of the
                   system's active / idle-in-transaction backends 2 x a second
                   for 60, recovery 60
pool_exhaustion    warmup 30, baseline 60, 300 idle connections (as many as
                   fit) held for 60, recovery 60
idle_in_tx         warmup, clean 60, one transaction holding an XID (BEGIN;
                   SELECT txid_current()) for the pressure phase, recovery 60
active_readers     warmup, clean 60, 4 REPEATABLE READ readers repeating a
                   count(*) of the system's busiest table every 0.1 s for the
                   pressure phase, recovery 60
=================  ===========================================================

Figures per cell: the completion rate of each phase (median of the 1-s samples), the
recovery ratio (recovery phase / baseline, the third-party table), the time from the
disruption's start until the backlog is back to its baseline level, the jobs acknowledged
but never run once the producer stopped and the queue had ``--drain-seconds`` to
drain (lost), the jobs run more than once (duplicates), and the time until the last job
stranded by the disruption ran; for pressure cells, dead tuples at the end of the clean
phase, at the end of the pressure phase, and their peak.

``postgres_restart`` and ``pool_exhaustion`` act on the whole server: they run only on a
cluster the harness owns (``--scratch-pg``) or with ``--pg-stop-cmd``/``--pg-start-cmd``
given for a quiet machine's own server; otherwise they are skipped with that reason.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .systems import PEERS, System

sys.path.insert(0, str(PEERS))
import _probe  # stdlib only; shared with the adapters

HARNESS_APP = "errands-bench-harness"
CHAOS = ("crash_recovery", "postgres_restart", "repeated_kills", "pg_backend_kill",
         "pool_exhaustion")  # fmt: skip
PRESSURE = ("idle_in_tx", "active_readers")
SERVER_WIDE = ("postgres_restart", "pool_exhaustion")


@dataclass
class Phase:
    label: str
    seconds: float
    action: str = ""  # what starts with the phase


def phases(name: str, scale: float, pressure: float) -> list[Phase]:
    # Phases last at least 5 s, or less at a scale under 0.02 (the suite's smoke test).
    s = lambda x: max(x * scale, min(5.0, 250 * scale))  # noqa: E731
    head = [Phase("warmup", s(30)), Phase("baseline", s(60))]
    tail = [Phase("recovery", s(60))]
    if name == "crash_recovery":
        return [*head, Phase("kill", s(60), "kill"), Phase("restart", s(60), "start"), *tail]
    if name == "postgres_restart":
        return [*head, Phase("restart", s(60), "pg_restart"), *tail]
    if name == "repeated_kills":
        return [*head, Phase("repeated", s(120), "repeated_kill"), *tail]
    if name == "pg_backend_kill":
        return [*head, Phase("kills", s(60), "backend_kill"), *tail]
    if name == "pool_exhaustion":
        return [*head, Phase("exhaustion", s(60), "pool_exhaustion"), *tail]
    if name == "idle_in_tx":
        return [*head[:1], Phase("clean", s(60)), Phase("idle_in_tx", pressure, "idle_in_tx"),
                *tail]  # fmt: skip
    if name == "active_readers":
        return [*head[:1], Phase("clean", s(60)), Phase("readers", pressure, "readers"), *tail]
    raise KeyError(name)


class Cell:
    """One scenario for one system: replicas, producer, sampler and the disruptions."""

    def __init__(
        self,
        runner: Any,
        system: System,
        name: str,
        rate: float,
        restarter: Any,
        log: Callable[[str], None],
        work_ms: float = 1.0,
    ) -> None:
        self.runner, self.system, self.name, self.rate = runner, system, name, rate
        self.work_ms = work_ms
        self.restarter, self.log = restarter, log
        self.url = runner.store_url(system)
        self.db = runner.db(system)
        self.samples: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.replicas: dict[int, _probe.Workers] = {}
        self.threads: list[threading.Thread] = []
        self.holders: list[Any] = []

    # -- the pieces --------------------------------------------------------------------

    def argv(self) -> tuple[list[str], dict[str, str]]:
        config = (self.system.best or (self.system.default,))[0]
        out = self.runner.adapter(self.system, "commands", {"procs": 1, "config": config.options})
        return out["argv"], out["env"]

    def start_replica(self, i: int) -> None:
        argv, env = self.worker
        env = {**env, **self.probe.env(), "BENCH_WORK_MS": str(self.work_ms)}
        self.replicas[i] = _probe.Workers([argv], env, str(PEERS))
        self.event(f"replica {i} started")

    def kill_replica(self, i: int) -> None:
        w = self.replicas.get(i)
        if w is None:
            return
        for p in w.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        self.event(f"replica {i} SIGKILLed")

    def event(self, what: str) -> None:
        self.events.append({"t": time.monotonic() - self.t0, "what": what})
        self.log(f"  {self.system.name} {self.name}: {what}")

    def start_producer(self) -> None:
        python = self.runner.pythons[self.system.name]
        self.progress = os.path.join(self.probe.dir, "producer.progress")
        spec = {"url": self.url, "cwd": str(PEERS), "rate": self.rate, "progress": self.progress}
        self.producer = subprocess.Popen(
            [python, str(PEERS / self.system.adapter), "produce", json.dumps(spec)],
            cwd=PEERS,
            env={**os.environ, "PYTHONPATH": str(PEERS)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def stop_producer(self) -> dict[str, Any]:
        self.producer.send_signal(signal.SIGTERM)
        try:
            out, err = self.producer.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.producer.kill()
            out, err = self.producer.communicate()
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if not lines:
            raise RuntimeError("producer: " + err.strip()[-400:])
        result = json.loads(lines[-1])
        result["errors"] = [ln for ln in err.splitlines() if ln.startswith("produce:")][-10:]
        return result

    def sample_loop(self) -> None:
        conn = None
        last_db = 0.0
        dead = None
        while not self.stop.is_set():
            now = time.monotonic()
            done = self.probe.totals()[0]
            sent, failures = _probe.progress(self.progress)
            if now - last_db >= 2.0:
                last_db = now
                try:
                    if conn is None:
                        conn = _connect(self.url)
                    row = conn.execute(
                        "SELECT coalesce(sum(n_dead_tup), 0), coalesce(sum(n_live_tup), 0) "
                        "FROM pg_stat_user_tables"
                    ).fetchone()
                    dead = int(row[0])
                except Exception:
                    conn = None
                    dead = None
            self.samples.append(
                {
                    "t": now - self.t0,
                    "done": done,
                    "sent": sent,
                    "failures": failures,
                    "dead": dead,
                    "phase": self.phase,
                }
            )
            self.stop.wait(1.0)
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    # -- disruptions ---------------------------------------------------------------------

    def begin(self, action: str, seconds: float) -> None:
        if action == "kill":
            self.kill_replica(0)
        elif action == "start":
            self.start_replica(0)
        elif action == "pg_restart":
            info = self.restarter.restart(down_seconds=seconds / 2)
            self.event(f"PostgreSQL restarted ({info['down_s']:.1f} s down)")
        elif action == "repeated_kill":
            self._thread(self._repeated_kill, 20.0)
        elif action == "backend_kill":
            self._thread(self._backend_kill, 2.0)
        elif action == "pool_exhaustion":
            self._thread(self._pool, 300)
        elif action == "idle_in_tx":
            self._thread(self._idle_in_tx)
        elif action == "readers":
            table = self._busiest_table()
            self.event(f"4 REPEATABLE READ readers on {table}")
            for _ in range(4):
                self._thread(self._reader, table)

    def end_disruptions(self) -> None:
        self.phase_stop.set()
        for t in self.threads:
            t.join(timeout=30)
        self.threads = []
        self.phase_stop = threading.Event()

    def _thread(self, fn: Callable[..., None], *args: Any) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        t.start()
        self.threads.append(t)

    def _repeated_kill(self, period: float) -> None:
        while not self.phase_stop.wait(period):
            self.kill_replica(0)
            stopping = self.phase_stop.wait(1.0)
            self.start_replica(0)
            if stopping:
                return

    def _backend_kill(self, per_second: float) -> None:
        kills = 0
        with _connect(self.runner.pg.url("postgres")) as conn:
            while not self.phase_stop.wait(1.0 / per_second):
                with contextlib.suppress(Exception):
                    rows = conn.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                        "datname = %s AND pid <> pg_backend_pid() AND application_name <> %s "
                        "AND state IN ('active', 'idle in transaction')",
                        (self.db, HARNESS_APP),
                    ).fetchall()
                    kills += len(rows)
        self.event(f"{kills} backends terminated")

    def _pool(self, wanted: int) -> None:
        conns = []
        with _connect(self.runner.pg.url("postgres")) as admin:
            limit, used = admin.execute(
                "SELECT current_setting('max_connections')::int, count(*) FROM pg_stat_activity"
            ).fetchone()
        room = max(0, min(wanted, limit - used - 10))
        for _ in range(room):
            try:
                conns.append(_connect(self.url))
            except Exception:
                break
        self.event(f"{len(conns)} idle connections held (asked {wanted})")
        self.phase_stop.wait()
        for c in conns:
            with contextlib.suppress(Exception):
                c.close()

    def _idle_in_tx(self) -> None:
        import psycopg

        with psycopg.connect(self.url, application_name=HARNESS_APP) as conn:
            xid = conn.execute("SELECT txid_current()").fetchone()[0]
            self.event(f"idle in transaction holding xid {xid}")
            self.phase_stop.wait()
            conn.rollback()

    def _busiest_table(self) -> str:
        with _connect(self.url) as conn:
            row = conn.execute(
                "SELECT schemaname || '.' || relname FROM pg_stat_user_tables "
                "ORDER BY n_tup_ins + n_tup_upd + n_tup_del DESC LIMIT 1"
            ).fetchone()
        return row[0] if row else "pg_stat_user_tables"

    def _reader(self, table: str) -> None:
        import psycopg

        with psycopg.connect(self.url, application_name=HARNESS_APP) as conn:
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            while not self.phase_stop.is_set():
                with contextlib.suppress(psycopg.Error):
                    conn.execute(f"SELECT count(*) FROM {table}").fetchall()
                self.phase_stop.wait(0.1)
            conn.rollback()

    # -- the run -------------------------------------------------------------------------

    def run(self, scale: float, pressure: float, drain: float) -> dict[str, Any]:
        self.runner.fresh(self.system)
        self.worker = self.argv()
        plan = phases(self.name, scale, pressure)
        self.probe = _probe.Probe(slots=int(self.rate * (sum(p.seconds for p in plan) + 60)))
        self.phase = "setup"
        self.phase_stop = threading.Event()
        self.t0 = time.monotonic()
        bounds: dict[str, tuple[float, float]] = {}
        sampler = threading.Thread(target=self.sample_loop, daemon=True)
        try:
            try:
                for i in (0, 1):
                    self.start_replica(i)
                self.start_producer()
                sampler.start()
                for phase in plan:
                    self.phase = phase.label
                    start = time.monotonic() - self.t0
                    if phase.action:
                        self.begin(phase.action, phase.seconds)
                    remaining = phase.seconds - (time.monotonic() - self.t0 - start)
                    time.sleep(max(remaining, 0))
                    if phase.action and phase.action not in ("kill", "start", "pg_restart"):
                        self.end_disruptions()
                    bounds[phase.label] = (start, time.monotonic() - self.t0)
                    for i, w in self.replicas.items():
                        dead = [p for p in w.procs if p.poll() is not None]
                        if dead and phase.action != "kill":
                            self.event(f"replica {i} exited with {dead[0].returncode}")
                self.phase = "drain"
                produced = self.stop_producer()
                sent = produced["sent"]
                deadline = time.monotonic() + drain
                while time.monotonic() < deadline and self._distinct(sent) < sent:
                    time.sleep(1.0)
                drained_s = drain - max(deadline - time.monotonic(), 0)
            finally:
                self.stop.set()
                self.end_disruptions()
                if sampler.is_alive():
                    sampler.join(timeout=10)
                for w in self.replicas.values():
                    with contextlib.suppress(Exception):
                        w.stop(grace=5)
                producer = getattr(self, "producer", None)
                if producer is not None and producer.poll() is None:  # failed mid-cell
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(producer.pid, signal.SIGKILL)
                    producer.wait()
            starts = self.probe.starts(sent)
            lasts = self.probe.starts(sent, last=True)
            hits = self.probe.totals()[0]
        finally:
            self.probe.cleanup()
        return self.figures(plan, bounds, produced, starts, lasts, hits, drained_s)

    def _distinct(self, n: int) -> int:
        if self.probe.totals()[0] < n:
            return 0
        return sum(1 for s in self.probe.starts(n) if s)

    def figures(
        self,
        plan: list[Phase],
        bounds: dict[str, tuple[float, float]],
        produced: dict[str, Any],
        starts: list[float],
        lasts: list[float],
        hits: int,
        drained_s: float,
    ) -> dict[str, Any]:
        rates = per_second(self.samples)
        out: dict[str, Any] = {
            "rate": self.rate,
            "work_ms": self.work_ms,
            "phases": {},
            "events": self.events,
            "sent": produced["sent"],
            "producer_failures": produced["failures"],
            "producer_errors": produced.get("errors", []),
            "ran": sum(1 for s in starts if s),
            "duplicates": hits - sum(1 for s in starts if s),
            "drain_s": drained_s,
        }
        out["lost"] = out["sent"] - out["ran"]
        # The 1-s series itself, for the plots and for checking any figure above.
        out["series"] = [[round(x["t"], 2), x["done"], x["sent"], x["dead"]] for x in self.samples]
        for label, (a, b) in bounds.items():
            in_phase = [r for t, r in rates if a <= t < b]
            dead = [s["dead"] for s in self.samples if a <= s["t"] < b and s["dead"] is not None]
            out["phases"][label] = {
                "seconds": b - a,
                "rate": statistics.median(in_phase) if in_phase else None,
                "dead_end": dead[-1] if dead else None,
                "dead_max": max(dead) if dead else None,
            }
        base = out["phases"].get("baseline") or out["phases"].get("clean") or {}
        rec = out["phases"].get("recovery", {})
        if base.get("rate") and rec.get("rate") is not None:
            out["recovery_ratio"] = rec["rate"] / base["rate"]
        disruption = next((p for p in plan if p.action), None)
        if disruption is not None:
            t_event = bounds[disruption.label][0]
            chaos_end = max(b for label, (a, b) in bounds.items() if label not in
                            ("warmup", "baseline", "clean", "recovery"))  # fmt: skip
            threshold = 0.9 * (base.get("rate") or 0.0)
            # The third-party definition: from the end of the chaos phases to the first
            # recovery-phase second at >= 90 % of the baseline's median completion rate.
            out["recovery_s"] = back_to_rate(rates, chaos_end, threshold, run=1)
            # From the disruption's start until 3 seconds in a row are back at >= 90 %:
            # the outage as the producer and workers lived it.
            out["outage_s"] = back_to_rate(rates, t_event, threshold, run=3)
            out["backlog_back_s"] = recovered_after(self.samples, bounds, t_event, self.rate)
            # Jobs enqueued before the disruption that had not run when it started: the
            # ones a dead worker held, or ones delayed by it; when did the last of them run?
            t_abs = self.t0 + t_event
            sent_then = max((s["sent"] for s in self.samples if s["t"] <= t_event), default=0)
            late = [s - t_abs for s in starts[:sent_then] if s > t_abs]
            out["stranded"] = len(late)
            out["stranded_last_s"] = max(late) if late else 0.0
            # Jobs that started before and ran again after it (a killed handler's job
            # re-run once its lease or heartbeat expired): when did the last re-run start?
            again = [b - t_abs for a, b in zip(starts, lasts, strict=True) if a and b > a + 1e-6]
            out["reruns"] = len(again)
            out["rerun_last_s"] = max(again) if again else 0.0
            out["rerun_s"] = sorted(again)  # each, from the disruption's start
        return out


def per_second(samples: list[dict[str, Any]]) -> list[tuple[float, float]]:
    out = []
    for a, b in itertools.pairwise(samples):
        dt = b["t"] - a["t"]
        if dt > 0:
            out.append((b["t"], (b["done"] - a["done"]) / dt))
    return out


def back_to_rate(
    rates: list[tuple[float, float]], t_from: float, threshold: float, run: int
) -> float | None:
    """Seconds from ``t_from`` to the first of ``run`` 1-s samples in a row whose
    completion rate is at least ``threshold``; None if it never gets there."""
    streak: list[float] = []
    for t, r in rates:
        if t <= t_from:
            continue
        streak = [*streak, t] if r >= threshold else []
        if len(streak) >= run:
            return max(streak[0] - 1.0 - t_from, 0.0)  # a sample covers the second before it
    return None


def recovered_after(
    samples: list[dict[str, Any]],
    bounds: dict[str, tuple[float, float]],
    t_event: float,
    rate: float,
) -> float | None:
    """Seconds from ``t_event`` until the backlog (acknowledged - run) is back to its
    baseline level (its baseline median + 1 s of offered load) for 3 samples in a row."""
    base = bounds.get("baseline") or bounds.get("clean")
    if not base:
        return None
    backlog = [s["sent"] - s["done"] for s in samples if base[0] <= s["t"] < base[1]]
    if not backlog:
        return None
    limit = statistics.median(backlog) + rate
    run = 0
    disrupted = False
    for s in samples:
        if s["t"] < t_event:
            continue
        ok = s["sent"] - s["done"] <= limit
        if not ok:
            disrupted = True
        run = run + 1 if ok else 0
        if run >= 3 and (disrupted or s["t"] > t_event + 3):
            return max(s["t"] - 2 - t_event, 0.0) if disrupted else 0.0
    return None


def _connect(url: str) -> Any:
    import psycopg

    return psycopg.connect(url, autocommit=True, connect_timeout=5, application_name=HARNESS_APP)


def run_scenarios(
    runner: Any,
    systems: list[System],
    names: list[str],
    rate: float,
    scale: float,
    pressure: float,
    drain: float,
    restarter: Any,
    log: Callable[[str], None],
    work_ms: float = 1.0,
) -> dict[str, Any]:
    """Every scenario for every system, the systems interleaved scenario by scenario."""
    out: dict[str, Any] = {
        "rate": rate,
        "scale": scale,
        "pressure_seconds": pressure,
        "drain_seconds": drain,
        "work_ms": work_ms,
        "cells": {},
    }
    for name in names:
        for system in systems:
            cell_key = f"{name}/{system.name}"
            if name in SERVER_WIDE and restarter is None:
                out["cells"][cell_key] = {
                    "skipped": "acts on the whole server: needs --scratch-pg, or "
                    "--pg-stop-cmd/--pg-start-cmd on a quiet machine"
                }
                continue
            log(f"scenario {name}: {system.name}")
            try:
                cell = Cell(runner, system, name, rate, restarter, log, work_ms)
                out["cells"][cell_key] = cell.run(scale, pressure, drain)
                r = out["cells"][cell_key]
                log(
                    f"scenario {name} {system.name}: recovery ratio "
                    f"{r.get('recovery_ratio') or 0:.2f}, outage {r.get('outage_s')} s, "
                    f"back to 90 % {r.get('recovery_s')} s after the chaos phases, "
                    f"last stranded job {r.get('stranded_last_s')} s, "
                    f"last re-run {r.get('rerun_last_s')} s, lost {r['lost']}, "
                    f"duplicates {r['duplicates']}, producer errors {r['producer_failures']}"
                )
            except Exception as exc:
                out["cells"][cell_key] = {"error": str(exc)[:500]}
                log(f"scenario {name} {system.name}: FAILED: {str(exc)[:300]}")
                if restarter is not None:
                    with contextlib.suppress(Exception):
                        runner.pg.wait_ready()
    return out
