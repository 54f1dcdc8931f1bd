"""The noisy-neighbour benchmark (issue 19): fair claiming against FIFO, on one store.

``python -m bench.fairness --url URL [--backlog 100000] [--seconds 60]`` runs, each in a
fresh queue of the store, with one in-process worker (``--concurrency`` threads):

1. **idle**: the quiet tenants alone (``--quiet`` tenants, each sending one job a
   second): their dwell (enqueue to start) on an idle queue, the baseline.
2. **fair** and **fifo**: tenant ``noisy`` dumps ``--backlog`` jobs at t0, then the quiet
   tenants send as in 1, in a queue declared ``fair=True`` and in a plain one (errands
   without fairness). The quiet tenants' dwell p50/p99 (a job not started by the end
   counts with its wait so far, a lower bound, and is reported as such), against the
   target: p99 at most 2x the idle one (FIFO's is about backlog / throughput).
3. **shares**: four backlogged tenants in a fair queue: ``a`` and ``d`` (weight 1),
   ``c`` (weight 2) and ``slow`` (weight 1, jobs 10x longer). Jain's index over worker
   time per unit of weight (target >= 0.95), ``c``'s worker time against ``a``'s (target
   2, within 5 %), and ``slow``'s share against its weighted share (1/5).
4. **keys**: ``--keys`` tenants (1,000) with a backlog each, drained by a fair queue and
   by a plain one: throughput of each (target: fair within 10 % of plain), with no-op
   jobs (the claim is all the work: its cost shows in full) and with jobs of
   ``--keys-work`` seconds (2 ms of waiting, as a job that calls a service does).
5. **peer** (``--peer pgqueuer``, PostgreSQL only): the dwell run of 2 in a peer without
   fair claiming (bench/peers/pgqueuer_fairness.py, in the peer's own venv and database),
   its worker as many jobs at a time as ours: what its users get behind a backlog.

Worker time and dwell are measured by the handlers (one clock: the benchmark's process).
It prints one JSON document; it reports, it does not assert.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import errands

WORK_SECONDS = 0.05  # one job's handler time (--work); the slow tenant's is 10 times this


@dataclass
class Record:
    """What the handlers saw: per tenant, dwells (enqueue -> start) and worker seconds."""

    dwell: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    busy: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    started: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, tenant: str, sent: float, seq: int, seconds: float) -> None:
        start = time.time()
        time.sleep(seconds)
        with self.lock:
            self.dwell[tenant].append(start - sent)
            self.busy[tenant] += time.time() - start
            self.started.add(seq)


class Bench:
    def __init__(self, url: str, concurrency: int, express: int | None = None) -> None:
        self.app = errands.App(url)
        self.app.migrate()  # a fresh PostgreSQL database has no tables yet
        self.concurrency = concurrency
        self.express = express  # None: the worker's default
        self.express_used: dict[str, int] = {}  # queue -> its worker's express lane
        self.record = Record()
        self._serial = 0

    def queue(self, kind: str, *, fair: bool) -> Callable[..., Any]:
        """A fresh queue and its job type (``tenant``, ``sent``, ``seq``, ``seconds``)."""
        self._serial += 1
        name = f"bench_{kind}_{int(time.time())}_{self._serial}"
        if fair:
            self.app.queue(name, fair=True)
        record = self.record

        @self.app.job(name=f"{name}.job", queue=name, fair_key="{tenant}", retries=0)
        def job(tenant: str, sent: float, seq: int, seconds: float) -> None:
            record.run(tenant, sent, seq, seconds)

        return job  # type: ignore[no-any-return]

    @contextmanager
    def worker(self, queue: str, *, lane: bool = True) -> Iterator[None]:
        """A worker of ``queue``; ``lane=False``: without an express lane."""
        express = self.express if lane else 0
        worker = self.app.worker(concurrency=self.concurrency, queues=[queue], express=express)
        self.express_used[queue] = worker.express
        thread = threading.Thread(target=worker.run, kwargs={"install_signals": False})
        thread.start()
        try:
            yield
        finally:
            worker.stop()
            thread.join(timeout=120)

    def fresh(self) -> None:
        self.record = Record()

    def settle(self) -> None:
        """After a prefill, on PostgreSQL: VACUUM ANALYZE the jobs and the keys' usage,
        what autovacuum would do after a bulk load (this machine's server runs with it
        off). Each run then starts from the same tables, fair and FIFO alike: without it
        the earlier runs' dead rows piled up (1.5 M after ten runs) and the leader's
        lease scan read them all (185 ms a scan), and a run planned its claims with
        whatever statistics the last ANALYZE left."""
        backend: Any = self.app.backend
        if not self.app.url.startswith("postgres"):
            return
        import psycopg

        with psycopg.connect(backend.config.conninfo, autocommit=True) as conn:
            schema = '"' + backend.schema + '"'
            conn.execute(f"VACUUM (ANALYZE) {schema}.errands_jobs, {schema}.errands_fair_usage")
            # Every run starts right after a checkpoint, so each pays the full-page images
            # of the pages it touches first alike (one that spanned a timed checkpoint
            # paid them twice: pairs of one setting ranged 0.69-1.16 without it).
            with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
                conn.execute("CHECKPOINT")


def _quiet_traffic(
    job: Any,
    quiet: int,
    seconds: float,
    work: float,
    stop: threading.Event,
    sent: list[tuple[int, float]],
) -> None:
    """Each quiet tenant sends one job a second, spread over the second."""
    seq = 1_000_000_000
    t0 = time.time()
    tick = 0
    while not stop.is_set() and time.time() - t0 < seconds:
        for i in range(quiet):
            due = t0 + tick + i / quiet
            pause = due - time.time()
            if pause > 0 and stop.wait(pause):
                return
            seq += 1
            now = time.time()
            job.enqueue(tenant=f"quiet{i}", sent=now, seq=seq, seconds=work)
            sent.append((seq, now))
        tick += 1


def quiet_dwell(bench: Bench, *, kind: str, fair: bool, backlog: int, args: Any) -> dict[str, Any]:
    bench.fresh()
    job = bench.queue(kind, fair=fair)
    if backlog:
        now = time.time()
        for start in range(0, backlog, 5000):
            bench.app.enqueue_many(
                [
                    job.bind(tenant="noisy", sent=now, seq=n, seconds=args.work)
                    for n in range(start, min(backlog, start + 5000))
                ]
            )
    bench.settle()
    sent: list[tuple[int, float]] = []
    stop = threading.Event()
    producer = threading.Thread(
        target=_quiet_traffic, args=(job, args.quiet, args.seconds, args.work, stop, sent)
    )
    t0 = time.time()
    with bench.worker(job.queue):
        producer.start()
        producer.join()
        grace = time.time() + args.grace  # let the last quiet jobs start
        while time.time() < grace:
            with bench.record.lock:
                if all(seq in bench.record.started for seq, _ in sent):
                    break
            time.sleep(0.05)
        end = time.time()
    rec = bench.record
    with rec.lock:
        dwells = [d for t, ds in rec.dwell.items() if t != "noisy" for d in ds]
        waiting = [end - at for seq, at in sent if seq not in rec.started]
        noisy_done = len(rec.dwell.get("noisy", []))
    every = sorted(dwells + waiting)
    return {
        "queue": "fair" if fair else "fifo",
        "backlog": backlog,
        "quiet_jobs": len(sent),
        "quiet_not_started": len(waiting),
        "quiet_dwell_p50": _pct(every, 50),
        "quiet_dwell_p99": _pct(every, 99),
        "quiet_dwell_p99_is_lower_bound": bool(waiting),
        "noisy_started": noisy_done,
        "throughput_per_s": (noisy_done + len(dwells)) / max(end - t0, 1e-9),
    }


def shares(bench: Bench, args: Any) -> dict[str, Any]:
    bench.fresh()
    job = bench.queue("shares", fair=True)
    weights = {"a": 1.0, "c": 2.0, "d": 1.0, "slow": 1.0}
    bench.app.fair_weight("c", 2.0, actor="bench")
    per = max(int(args.seconds * bench.concurrency / args.work), 1000)
    now = time.time()
    for tenant in weights:
        seconds = args.work * (10 if tenant == "slow" else 1)
        count = per // (10 if tenant == "slow" else 1)
        for start in range(0, count, 5000):
            bench.app.enqueue_many(
                [
                    job.bind(tenant=tenant, sent=now, seq=n, seconds=seconds)
                    for n in range(start, min(count, start + 5000))
                ]
            )
    bench.settle()
    with bench.worker(job.queue):
        time.sleep(args.seconds)
        with bench.record.lock:
            busy = dict(bench.record.busy)
    bench.app.fair_weight("c", None, actor="bench")
    total = sum(busy.values()) or 1e-9
    normalised = [busy.get(t, 0.0) / w for t, w in weights.items()]
    jain = sum(normalised) ** 2 / (len(normalised) * sum(x * x for x in normalised) or 1e-9)
    return {
        "worker_seconds": {t: round(busy.get(t, 0.0), 3) for t in weights},
        "share": {t: round(busy.get(t, 0.0) / total, 4) for t in weights},
        "weighted_share": {t: w / sum(weights.values()) for t, w in weights.items()},
        "jain_index_per_weight": round(jain, 4),
        "weight_2_over_weight_1": round(busy.get("c", 0.0) / max(busy.get("a", 0.0), 1e-9), 3),
        "slow_share_over_its_weighted_share": round(
            busy.get("slow", 0.0) / total / (weights["slow"] / sum(weights.values())), 3
        ),
    }


def many_keys(bench: Bench, *, fair: bool, args: Any, work: float = 0.0) -> dict[str, Any]:
    bench.fresh()
    job = bench.queue("keys", fair=fair)
    per_key = max(args.keys_jobs // args.keys, 1)
    now = time.time()
    requests = [
        job.bind(tenant=f"k{k}", sent=now, seq=k * per_key + n, seconds=work)
        for n in range(per_key)
        for k in range(args.keys)
    ]
    for start in range(0, len(requests), 5000):
        bench.app.enqueue_many(requests[start : start + 5000])
    bench.settle()
    t0 = time.time()
    with bench.worker(job.queue, lane=False):  # the plain queue's threads, no more
        deadline = t0 + args.seconds * 5
        while time.time() < deadline:
            with bench.record.lock:
                if len(bench.record.started) >= len(requests):
                    break
            time.sleep(0.05)
        elapsed = time.time() - t0
        with bench.record.lock:
            done = len(bench.record.started)
    return {"queue": "fair" if fair else "fifo", "keys": args.keys, "jobs": done, "work": work,
            "throughput_per_s": round(done / elapsed, 1)}  # fmt: skip


def keys_rounds(bench: Bench, args: Any, work: float) -> dict[str, Any]:
    """The keys part's ``--keys-rounds`` pairs of runs (fair, then FIFO, on the same
    load), for jobs of ``work`` seconds: each system's median throughput and the median
    and range of the pairs' ratios (the first pair's runs in full, as one pair gave)."""
    pairs = []
    for _ in range(max(args.keys_rounds, 1)):
        fair = many_keys(bench, fair=True, args=args, work=work)
        fifo = many_keys(bench, fair=False, args=args, work=work)
        pairs.append((fair, fifo, _ratio(fair["throughput_per_s"], fifo["throughput_per_s"])))
    ratios = sorted(r for _, _, r in pairs if r is not None)
    out: dict[str, Any] = {
        "fair": pairs[0][0] if len(pairs) == 1 else _median_run([p[0] for p in pairs]),
        "fifo": pairs[0][1] if len(pairs) == 1 else _median_run([p[1] for p in pairs]),
        "fair_over_fifo": statistics.median(ratios) if ratios else None,
    }
    if len(pairs) > 1:
        out["rounds"] = len(pairs)
        out["fair_over_fifo_range"] = [ratios[0], ratios[-1]] if ratios else None
        out["fair_over_fifo_each"] = [r for _, _, r in pairs]
        out["throughput_each"] = [  # (fair, FIFO) jobs a second, pair by pair
            [f["throughput_per_s"], o["throughput_per_s"]] for f, o, _ in pairs
        ]
    return out


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The first of ``runs`` with the median throughput of them all."""
    return {**runs[0], "throughput_per_s": statistics.median(r["throughput_per_s"] for r in runs)}


PEER_TIMEOUT = 900.0  # seconds a peer's dwell run may take (its backlog drains past it)


def peer_dwell(peer: str, url: str, args: Any) -> dict[str, Any]:
    """The dwell run behind the backlog in ``peer`` (bench/peers/PEER_fairness.py), on a
    fresh database of ``url``'s server, with this run's traffic and concurrency."""
    import subprocess
    from urllib.parse import urlsplit, urlunsplit

    import psycopg

    from .systems import PEERS, by_name, python_for

    parts = urlsplit(url)
    db = f"{parts.path.lstrip('/') or 'errands'}_{peer}"
    with psycopg.connect(urlunsplit(parts._replace(path="/postgres")), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{db}"')
    spec = {
        "url": urlunsplit(parts._replace(path=f"/{db}", query="")),
        "backlog": args.backlog, "quiet": args.quiet, "seconds": args.seconds,
        "grace": args.grace, "concurrency": args.concurrency, "work": args.work,
    }  # fmt: skip
    try:
        done = subprocess.run(
            [python_for(by_name(peer)), str(PEERS / f"{peer}_fairness.py"), json.dumps(spec)],
            cwd=PEERS,
            capture_output=True,
            text=True,
            timeout=PEER_TIMEOUT,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{peer}'s dwell run failed: {done.stderr.strip()[-500:]}")
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return result
    finally:
        with psycopg.connect(urlunsplit(parts._replace(path="/postgres")), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


def _pct(values: list[float], pct: float) -> float | None:
    if not values:
        return None
    index = min(len(values) - 1, max(0, math.ceil(pct / 100 * len(values)) - 1))
    return round(values[index], 4)


def main(argv: list[str] | None = None, *, echo: bool = True) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.fairness", description=__doc__)
    parser.add_argument("--url", default="sqlite:///bench-fairness.db")
    parser.add_argument("--backlog", type=int, default=100_000)
    parser.add_argument("--quiet", type=int, default=50, help="quiet tenants, 1 job/s each")
    parser.add_argument("--seconds", type=float, default=60.0, help="quiet traffic per run")
    parser.add_argument("--grace", type=float, default=10.0, help="wait for the last quiet jobs")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--work", type=float, default=WORK_SECONDS, help="a job's seconds")
    parser.add_argument(
        "--express",
        type=int,
        help="the worker's express lane (default: the worker's, -c / 2 with a fair queue)",
    )
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument(
        "--keys-jobs",
        type=int,
        default=50_000,
        help="jobs in the keys part's runs (50,000: ~15 s a run; 20,000 gave 5 s windows, "
        "whose pairs of one setting ranged 0.69-1.16)",
    )
    parser.add_argument(
        "--keys-work",
        type=float,
        default=0.002,
        help="a job's seconds in the keys part's second pair of runs (the first: no-op)",
    )
    parser.add_argument(
        "--keys-rounds",
        type=int,
        default=3,
        help="pairs of runs (fair, then FIFO) per job length in the keys part: the ratio "
        "reported is the median of the pairs' ratios, with their range (a pair's two runs "
        "meet the same load; one pair's ratio on a busy machine varied 0.63-1.16)",
    )
    parser.add_argument(
        "--peer",
        choices=["pgqueuer"],
        help="also run the dwell behind the backlog in this peer (PostgreSQL --url only)",
    )
    parser.add_argument(
        "--only",
        default="dwell,shares,keys",
        help="the parts to run, comma-separated: dwell (idle, fair, fifo), shares, keys",
    )
    args = parser.parse_args(argv)
    parts = set(args.only.split(","))
    unknown = parts - {"dwell", "shares", "keys"}
    if unknown:
        parser.error(f"--only: unknown part(s) {sorted(unknown)}; choose among dwell, shares, keys")
    if args.peer and not args.url.startswith("postgresql"):
        parser.error("--peer: the peer runs on PostgreSQL; give a postgresql:// --url")
    bench = Bench(args.url, args.concurrency, args.express)
    result: dict[str, Any] = {
        "store": args.url.split(":", 1)[0],
        "settings": {k: v for k, v in vars(args).items() if k != "url"},
    }
    try:
        if "dwell" in parts:
            idle = quiet_dwell(bench, kind="idle", fair=True, backlog=0, args=args)
            fair = quiet_dwell(bench, kind="fair", fair=True, backlog=args.backlog, args=args)
            fifo = quiet_dwell(bench, kind="fifo", fair=False, backlog=args.backlog, args=args)
            result |= {
                "idle": idle,
                "fair": fair,
                "fifo": fifo,
                "quiet_p99_fair_over_idle": _ratio(
                    fair["quiet_dwell_p99"], idle["quiet_dwell_p99"]
                ),
                "quiet_p99_fifo_over_idle": _ratio(
                    fifo["quiet_dwell_p99"], idle["quiet_dwell_p99"]
                ),
            }
            if args.peer:
                peer = peer_dwell(args.peer, args.url, args)
                result["peer"] = peer
                result["quiet_p99_peer_over_idle"] = _ratio(
                    peer["quiet_dwell_p99"], idle["quiet_dwell_p99"]
                )
        if "shares" in parts:
            result["shares"] = shares(bench, args)
        if "keys" in parts:
            for part, work in (("keys", 0.0), ("keys_work", args.keys_work)):
                result[part] = keys_rounds(bench, args, work)
    finally:
        bench.app.close()
    result["express_lane"] = sorted(set(bench.express_used.values()))  # the workers' lanes
    if echo:
        print(json.dumps(result, indent=2))
    return result


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


if __name__ == "__main__":  # pragma: no cover
    main()
