"""The workload generator: a steady stream of mixed jobs while the chaos runs.

Runs in a thread of the test process. Every job it enqueues carries an idempotency key
(``soak:<n>``), so an enqueue that failed on a killed connection or a restarting server
is simply retried: if the first try had committed, the retry returns the same job
(DESIGN §3). Only enqueues that returned are written in the :class:`Ledger` — those
are the jobs I1 says must never be lost.

Besides the plain mix it does what the checker needs:

- transactional enqueues (RELIABILITY I2): an ``soak_orders`` row and its job inserted
  in one transaction of the generator's own connection, committed or (about a third of
  the time) rolled back;
- bursts of concurrent enqueues of one idempotency key from many threads (I8);
- bursts of transactional handlers (``soak.tx_hold``), one per slot of the whole cluster,
  so every handler of a worker holds a ``ctx.transaction()`` at once, as many as its pool
  has connections or more (issue 16 A2);
- a second enqueue of each ``unique_for`` key once the first job's key has expired (the
  first job's retry then runs beside a second job that took its key: A6);
- the signals the ``soak.signalled`` jobs wait for, some sent before the job runs.
"""

from __future__ import annotations

import contextlib
import random
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import soak_app

import errands
from errands.errors import DatabaseBusy, EnqueueUncertain, InvalidTransition

from .store import Store, is_connection_error
from .workflows import Sizes, WorkflowFeed

# kind -> weight in the mix (orders, unique bursts, canaries and cron come on their own)
MIX = {
    "fast": 48,
    "delayed": 5,
    "slow": 3,
    "flaky": 10,
    "doomed": 3,
    "exhaust": 3,
    "pay": 14,
    "tx": 14,
    # issue 16 part B: the shapes of the defects of part A
    "slow_return": 2,
    "aslow": 2,
    "keyed": 2,
    "plain": 3,
    "uniq_retry": 1,
    "bad_backoff": 1,
    "hooked": 0.3,
    "signalled": 1.5,
    "signal_never": 0.3,
    "tenant": 1.5,  # a quiet tenant's job in the fair queue (issue 19)
}
BATCH = 100
ORDER_EVERY = 2  # batches between two transactional enqueues
ORDER_ROLLBACK = 0.35
UNIQUE_THREADS = 24
TX_BURST = 24  # one per slot of the cluster (3 workers x 8)
TX_BURST_EVERY = 10  # batches between two bursts
TX_HOLD = (0.2, 0.5)  # seconds each holds its transaction (PostgreSQL; SQLite: 0, see below)
SIGNAL_AFTER = (-0.5, 2.0)  # seconds after the enqueue; <= 0: at once, before any run
NOISY_BURST = 100  # the noisy tenant's jobs at once, in the fair queue (issue 19): ~4 % of the load
NOISY_EVERY = 25  # batches between two bursts
TENANT_JOB = (0.01, 0.04)  # seconds a tenant's job works


@dataclass
class UniqueBurst:
    group: int
    key: str
    ids: list[int] = field(default_factory=list)
    fresh: int = 0  # callers told deduplicated=False
    retried: int = 0  # calls retried after an error (may then see deduplicated=True)


@dataclass
class Ledger:
    jobs: dict[int, str] = field(default_factory=dict)  # acknowledged enqueues: id -> kind
    orders_committed: dict[int, int] = field(default_factory=dict)  # order id -> job id
    orders_rolled_back: dict[int, int] = field(default_factory=dict)  # order id -> job id
    orders_unknown: set[int] = field(default_factory=set)  # the commit itself failed
    bursts: list[UniqueBurst] = field(default_factory=list)
    enqueue_retries: int = 0
    signals: dict[int, Any] = field(default_factory=dict)  # job id -> payload sent
    # unique_for keys enqueued twice: (key, first job id, second job id)
    unique_pairs: list[tuple[str, int, int]] = field(default_factory=list)
    tx_bursts: int = 0
    workflows: dict[int, str] = field(default_factory=dict)  # acknowledged: id -> shape
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, ids: list[int], kinds: list[str]) -> None:
        with self.lock:
            for job_id, kind in zip(ids, kinds, strict=True):
                self.jobs[job_id] = kind


def transient(exc: BaseException) -> bool:
    """An error the generator retries its call after: the store away or busy, or an
    enqueue whose commit was lost (EnqueueUncertain: the mix's jobs carry keys, so the
    retry stores them once; a workflow retried may be stored twice, which the checker
    allows: W1)."""
    return is_connection_error(exc) or isinstance(exc, DatabaseBusy | EnqueueUncertain)


class Workload:
    def __init__(
        self,
        store: Store,
        app: errands.App,
        ledger: Ledger,
        *,
        total: int,
        planned_seconds: float,
        backlog_cap: int,
        unique_every: float,
        rng: random.Random,
        workflows: Sizes,
    ) -> None:
        self.store = store
        self.app = app
        self.ledger = ledger
        self.total = total
        self.planned = max(planned_seconds, 1.0)
        self.backlog_cap = backlog_cap
        self.unique_every = unique_every
        self.rng = rng
        self.seq = 0
        self._seq_lock = threading.Lock()
        self.order_seq = 0
        self.enqueued = 0  # jobs of the mix (orders and bursts not counted)
        self.stop = threading.Event()
        self.hurry = threading.Event()  # the chaos plan is done: enqueue the rest now
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="soak-workload", daemon=True)
        self._pool = ThreadPoolExecutor(UNIQUE_THREADS, thread_name_prefix="soak-unique")
        self._order_conn: Any = None
        self._to_signal: list[tuple[float, int, int]] = []  # (due, job id, seq)
        self._to_reenqueue: list[tuple[float, int, str, int]] = []  # (due, seq, key, first id)
        self.workflows = WorkflowFeed(
            app, rng, self._retrying, lambda: self.next_key()[0], ledger.workflows, workflows
        )

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def close(self) -> None:
        self.stop.set()
        self._thread.join(30)
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._order_conn is not None:
            with contextlib.suppress(Exception):
                self._order_conn.close()

    # -- the loop ------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # surfaced by the orchestrator
            self.error = exc
        finally:
            self.done.set()

    def _run(self) -> None:
        started = time.monotonic()
        next_unique = started + self.unique_every / 2
        batches = 0
        while self.enqueued < self.total and not self.stop.is_set():
            elapsed = time.monotonic() - started
            target = self.total if self.hurry.is_set() else self.total * elapsed / self.planned
            if self.enqueued >= target + BATCH or self._backlog() >= self.backlog_cap:
                time.sleep(0.05)
                continue
            self._enqueue_batch(min(BATCH, self.total - self.enqueued))
            batches += 1
            if batches % ORDER_EVERY == 0:
                self._transactional_enqueue()
            if batches % TX_BURST_EVERY == 1:
                self._tx_burst()
            if batches % NOISY_EVERY == 2:
                self._noisy_burst()
            if time.monotonic() >= next_unique:
                self._unique_burst()
                next_unique = time.monotonic() + self.unique_every
            self._due_followups(time.monotonic())
            self.workflows.after_batch(self.enqueued / max(self.total, 1))
        if not self.ledger.bursts and not self.stop.is_set():
            self._unique_burst()  # at least one, however short the run
        while (self._to_signal or self._to_reenqueue) and not self.stop.is_set():
            self._due_followups(time.monotonic())  # every signal sent, every key re-used
            time.sleep(0.05)

    def _backlog(self) -> int:
        return int(
            self.store.scalar(
                "SELECT count(*) FROM {s}errands_jobs "
                "WHERE state IN ('available', 'scheduled', 'retryable')"
            )
        )

    def _retrying(self, call: Callable[[], Any]) -> Any:
        pause = 0.05
        while True:
            try:
                return call()
            except Exception as exc:
                if not transient(exc) or self.stop.is_set():
                    raise
                with self.ledger.lock:
                    self.ledger.enqueue_retries += 1
                time.sleep(pause * (1 + self.rng.random()))
                pause = min(pause * 2, 2.0)

    def bind(self, kind: str, seq: int) -> errands.BoundJob:
        rng, key = self.rng, f"soak:{seq}"
        if kind == "fast":
            return soak_app.fast.bind(n=seq, key=key)
        if kind == "delayed":
            return soak_app.fast.bind(n=seq, key=key, delay=rng.uniform(0.5, 3.0))
        if kind == "slow":
            return soak_app.slow.bind(n=seq, seconds=round(rng.uniform(0.2, 1.5), 2), key=key)
        if kind == "flaky":
            return soak_app.flaky.bind(n=seq, fail_times=rng.choice((1, 2)), key=key)
        if kind == "doomed":
            return soak_app.doomed.bind(n=seq, key=key)
        if kind == "exhaust":
            return soak_app.exhaust.bind(n=seq, key=key)
        if kind == "pay":
            return soak_app.pay.bind(order=seq, amount=100 + seq % 900, key=key)
        if kind == "tx":
            return soak_app.tx.bind(n=seq, key=key)
        if kind in ("slow_return", "aslow"):
            job = soak_app.slow_return if kind == "slow_return" else soak_app.aslow
            return job.bind(n=seq, seconds=round(rng.uniform(0.2, 1.5), 2), key=key)
        if kind == "keyed":
            # keyed_a and keyed_b share the key template; a third run in a queue not their
            # own: the other's, or the plain queue, where no keyed job type lives (not the
            # default queue: its claims would then all take the limited path, see
            # docs/reliability.md, known issues)
            job, other = rng.choice(((soak_app.keyed_a, "keys_b"), (soak_app.keyed_b, "keys_a")))
            queue = rng.choice((None, None, None, None, other, "plain"))
            return job.bind(
                n=seq, account=rng.randrange(soak_app.KEY_ACCOUNTS),
                seconds=round(rng.uniform(0.02, 0.1), 3), key=key, queue=queue,
            )  # fmt: skip
        if kind == "plain":
            return soak_app.plain.bind(n=seq, key=key)
        if kind == "tenant":
            return soak_app.tenant.bind(
                n=seq, tenant=f"quiet{rng.randrange(soak_app.QUIET_TENANTS)}",
                seconds=round(rng.uniform(*TENANT_JOB), 3), key=key,
            )  # fmt: skip
        if kind == "uniq_retry":
            return soak_app.uniq_retry.bind(n=seq, key=key, unique_for=soak_app.UNIQUE_FOR)
        if kind == "bad_backoff":
            return soak_app.bad_backoff.bind(n=seq, key=key)
        if kind == "hooked":
            return soak_app.hooked.bind(n=seq, key=key)
        if kind == "signalled":
            return soak_app.signalled.bind(n=seq, key=key)
        if kind == "signal_never":
            return soak_app.signal_never.bind(n=seq, key=key)
        raise ValueError(kind)

    def _enqueue_batch(self, size: int) -> None:
        kinds = self.rng.choices(list(MIX), weights=list(MIX.values()), k=size)
        seqs = [self.next_key()[0] for _ in kinds]
        bound = [self.bind(kind, seq) for kind, seq in zip(kinds, seqs, strict=True)]
        handles = self._retrying(lambda: self.app.enqueue_many(bound))
        self.ledger.add([h.id for h in handles], kinds)
        self.enqueued += size
        now = time.monotonic()
        for kind, seq, handle in zip(kinds, seqs, handles, strict=True):
            if kind == "signalled":
                self._to_signal.append((now + self.rng.uniform(*SIGNAL_AFTER), handle.id, seq))
            elif kind == "uniq_retry":
                due = now + soak_app.UNIQUE_FOR + self.rng.uniform(0.1, 0.8)
                self._to_reenqueue.append((due, seq, f"soak:{seq}", handle.id))

    def _due_followups(self, now: float) -> None:
        """Send the signals that are due; enqueue again the unique_for keys that expired."""
        due, self._to_signal = (
            [s for s in self._to_signal if s[0] <= now],
            [s for s in self._to_signal if s[0] > now],
        )
        for _, job_id, seq in due:
            payload = {"seq": seq}
            # InvalidTransition: a retried signal whose first try had landed; it is done
            with contextlib.suppress(InvalidTransition):
                self._retrying(lambda j=job_id, p=payload: self.app.signal(j, soak_app.SIGNAL, p))
            with self.ledger.lock:
                self.ledger.signals[job_id] = payload
        again, self._to_reenqueue = (
            [r for r in self._to_reenqueue if r[0] <= now],
            [r for r in self._to_reenqueue if r[0] > now],
        )
        for _, seq, key, first in again:
            job = soak_app.uniq_retry.bind(n=seq, key=key, unique_for=soak_app.UNIQUE_FOR)
            second = self.enqueue_extra("uniq_retry", job)
            with self.ledger.lock:
                self.ledger.unique_pairs.append((key, first, second))

    # -- A2: as many open ctx.transaction() as slots ------------------------------------------
    def _tx_burst(self) -> None:
        """One tx_hold job per slot of the cluster at once. On SQLite a transaction holds
        the file's write lock, so there they hold it for no longer than the write."""
        jobs, kinds = [], []
        for _ in range(TX_BURST):
            seq, key = self.next_key()
            hold = 0.0 if self.store.sqlite else round(self.rng.uniform(*TX_HOLD), 2)
            jobs.append(soak_app.tx_hold.bind(n=seq, hold=hold, key=key))
            kinds.append("tx_hold")
        handles = self._retrying(lambda: self.app.enqueue_many(jobs))
        self.ledger.add([h.id for h in handles], kinds)
        with self.ledger.lock:
            self.ledger.tx_bursts += 1

    # -- issue 19: a noisy tenant dumps a burst into the fair queue ---------------------------
    def _noisy_burst(self) -> None:
        jobs = []
        for _ in range(NOISY_BURST):
            seq, key = self.next_key()
            seconds = round(self.rng.uniform(*TENANT_JOB), 3)
            jobs.append(
                soak_app.tenant.bind(n=seq, tenant=soak_app.NOISY, seconds=seconds, key=key)
            )
        handles = self._retrying(lambda: self.app.enqueue_many(jobs))
        self.ledger.add([h.id for h in handles], ["tenant_noisy"] * len(handles))

    def enqueue_extra(self, kind: str, job: errands.BoundJob) -> int:
        """Enqueue one job for the chaos driver (slow targets, canaries); ledgered."""
        (handle,) = self._retrying(lambda: self.app.enqueue_many([job]))
        self.ledger.add([handle.id], [kind])
        return int(handle.id)

    def next_key(self) -> tuple[int, str]:
        with self._seq_lock:
            self.seq += 1
            return self.seq, f"soak:{self.seq}"

    # -- I2: enqueue inside the caller's transaction ----------------------------------------
    def _order_connection(self) -> Any:
        if self._order_conn is None:
            if self.store.sqlite:
                conn = sqlite3.connect(self.store.path, timeout=120, isolation_level=None)
                conn.execute("PRAGMA busy_timeout = 120000")
            else:
                import psycopg

                conn = psycopg.connect(self.store.conninfo, connect_timeout=5)
            self._order_conn = conn
        return self._order_conn

    def _transactional_enqueue(self) -> None:
        self.order_seq += 1
        order_id = self.order_seq
        rollback = self.rng.random() < ORDER_ROLLBACK
        insert = self.store.sql("INSERT INTO {s}soak_orders (order_id, at) VALUES (%s, NOW())")
        try:
            conn = self._order_connection()
            if self.store.sqlite:
                conn.execute("BEGIN IMMEDIATE")
            conn.execute(insert, (order_id,))
            handle = soak_app.order.enqueue(order_id=order_id, conn=conn)
        except Exception as exc:
            self._drop_order_connection()
            if not transient(exc):
                raise
            return  # never committed: neither the order nor its job exists (checked)
        if rollback:
            try:
                if self.store.sqlite:
                    conn.execute("ROLLBACK")
                else:
                    conn.rollback()
            except Exception as exc:
                self._drop_order_connection()  # a dead connection's transaction is gone too
                if not transient(exc):
                    raise
            with self.ledger.lock:
                self.ledger.orders_rolled_back[order_id] = handle.id
            return
        try:
            if self.store.sqlite:
                conn.execute("COMMIT")
            else:
                conn.commit()
        except Exception as exc:
            self._drop_order_connection()
            if not transient(exc):
                raise
            with self.ledger.lock:
                self.ledger.orders_unknown.add(order_id)
            return
        with self.ledger.lock:
            self.ledger.orders_committed[order_id] = handle.id
            self.ledger.jobs[handle.id] = "order"

    def _drop_order_connection(self) -> None:
        conn, self._order_conn = self._order_conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    # -- I8: one key, many callers at once -----------------------------------------------------
    def _unique_burst(self) -> None:
        group = len(self.ledger.bursts) + 1
        burst = UniqueBurst(group, f"unique:{group}")
        barrier = threading.Barrier(UNIQUE_THREADS)
        lock = threading.Lock()

        def call() -> None:
            barrier.wait(timeout=30)
            tries = 0
            while True:
                try:
                    handle = soak_app.unique.enqueue(group=group, key=burst.key)
                    break
                except Exception as exc:
                    if not transient(exc) or tries > 200:
                        raise
                    tries += 1
                    time.sleep(0.05)
            with lock:
                burst.ids.append(handle.id)
                burst.fresh += not handle.deduplicated
                burst.retried += tries > 0

        for future in [self._pool.submit(call) for _ in range(UNIQUE_THREADS)]:
            future.result(timeout=180)
        with self.ledger.lock:
            self.ledger.bursts.append(burst)
            for job_id in set(burst.ids):
                self.ledger.jobs[job_id] = "unique"
