"""The store-fault sweep (issue 16, part B): every store call the worker, its maintenance
leader and its hooks make is made to fail with a transient error — first each call on its
own, then all of them at random — on both backends, under a real in-process worker
running a small workload, and the guarantees are checked in SQL afterwards:

- no job is ``running`` without a live attempt in the worker, and once the worker has
  stopped none is, unless its release failed (its lease then expires and it is rescued);
- no attempt is charged without a run of its handler or a recorded loss (a rescue), and
  a handler never runs twice on one attempt number unless a release explains it;
- the faulted call is made again and succeeds (each loop retries what failed), and the
  maintenance leader still rescues, promotes and schedules after the faults heal;
- every job is terminal after the drain, and each ends as its handler meant (effects of
  ``ctx.transaction()`` once, a ``ctx.step`` effect once unless its result was never
  stored, every dead job's ``on_dead`` hooks run).

:data:`SWEEP` names every call swept; :func:`test_the_sweep_names_every_store_call_in_the_code`
fails when the worker's or the maintenance loop's code calls a Backend method it does not
name, and :func:`test_a_fault_free_run_makes_every_swept_call` when the workload stops
reaching one (a fault in a call never made would prove nothing).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import pytest

import errands
import errands.hooks
import errands.maintenance
import errands.worker
from errands.jobs import JobState

from .faults import (
    PROTOCOL_METHODS,
    FailFirst,
    FailOnce,
    FaultyStore,
    RandomFaults,
)
from .helpers import wait_until
from .sweep import DEADLINE, Sweep, run_through


@dataclass(frozen=True)
class Swept:
    """When the worker makes the call, and how many of its calls fail in its own sweep."""

    phase: Literal["startup", "running", "stopping"]
    faults: int = 2


# Every Backend call of the worker, its maintenance leader and its hooks (directly or
# through the App), in one place.
SWEEP: dict[str, Swept] = {
    # startup: retried while the error is transient
    "schema_check": Swept("startup"),
    "configure_worker": Swept("startup"),
    "worker_register": Swept("startup"),
    "queue_declare": Swept("startup"),
    "queue_declare_keyed": Swept("startup"),
    "job_limit_declare": Swept("startup"),
    # the claim loop, handlers, the completer, the lease keeper
    "job_claim": Swept("running"),
    "job_claim_limited": Swept("running"),
    "queues_with_limits": Swept("running"),
    "job_finish_many": Swept("running"),
    "job_heartbeat_many": Swept("running"),
    "worker_heartbeat": Swept("running"),
    "step_list": Swept("running"),
    "step_store": Swept("running"),
    "tx_begin": Swept("running"),
    "tx_finish": Swept("running"),
    "tx_rollback": Swept("running"),
    "signal_get": Swept("running"),  # ctx.wait_for_signal
    "workflow_parent_results": Swept("running"),  # ctx.parent_results
    # on_dead hooks (App.run_dead_hooks), then their record (a failure: they run again later)
    "job_get": Swept("running"),
    "dead_hooks_done": Swept("running"),
    # the maintenance leader: election, rescue, promotion, cron, pruning
    "leader_attempt_elect": Swept("running"),
    "job_list_expired": Swept("running"),
    "job_rescue_many": Swept("running"),
    "job_promote_due": Swept("running"),
    "job_list_expired_waits": Swept("running"),
    "job_expire_waits": Swept("running"),
    "db_now": Swept("running"),
    "cron_states": Swept("running"),
    "cron_save": Swept("running"),
    "job_insert_many": Swept("running"),  # a cron slot's job (App.enqueue_many)
    "worker_prune": Swept("running"),
    "rate_log_prune": Swept("running"),
    "job_prune": Swept("running"),
    "fair_usage_prune": Swept("running"),
    "workflow_prune": Swept("running"),
    "dead_hooks_due": Swept("running"),  # the leader's look for hooks no worker ran
    "wal_trim": Swept("running"),  # (SQLite: empties a write-ahead log grown too large)
    # a graceful stop: each made once
    "job_release_many": Swept("stopping", 1),
    "leader_resign": Swept("stopping", 1),
    "worker_deregister": Swept("stopping", 1),
}
# Called, but with nothing to fault: why.
EXEMPT = {
    "worker_list": "the start-up warning about periodic jobs no live worker serves reads "
    "the registry once, best effort: a failure skips that warning and nothing else",
    "workflow_take_settled": "reads what this thread's last store calls settled, kept in "
    "memory by the store: no store I/O",
    "workflow_take_released": "reads the queues this thread's last finish released jobs "
    "into, kept in memory by the store: no store I/O",
    "listener": "builds the wake-up listener and does no store I/O; the listener's own "
    "connection is outside the Backend protocol",
    "tx_abandon": "ends the ctx.transaction() of a handler abandoned past its timeout or "
    "released at shutdown, off the worker's threads; the attempt's outcome is decided "
    "before it and never waits for it, and its failure is logged (the connection is closed "
    "either way): tests/postgres/test_abandoned_transaction.py, test_timeouts.py",
}

# Defects the sweep found, until they are fixed: the call's faults break a guarantee.
DEFECTS = {}


@pytest.fixture
def sweep(store_url: str) -> Iterator[Sweep]:
    run = Sweep(store_url)
    try:
        yield run
    finally:
        run.close()


# -- the list is complete ------------------------------------------------------------------------
APP_METHODS = frozenset(n for n, v in vars(errands.App).items() if inspect.isfunction(v))


def _named(code: Any, names: frozenset[str], receiver: str) -> set[str]:
    """The ``names`` that ``code``'s source uses as attributes of ``<...>.receiver``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(code)))
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in names
        and ast.unparse(node.value).split(".")[-1] == receiver
    }


def _store_calls(code: Any) -> set[str]:
    """The Backend methods ``code`` names: on a backend, and inside the App methods it
    names on an app (and the App methods those name, and so on)."""
    calls = _named(code, PROTOCOL_METHODS, "backend")
    seen: set[str] = set()
    todo = list(_named(code, APP_METHODS, "app"))
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            method = vars(errands.App)[name]
            calls |= _named(method, PROTOCOL_METHODS, "backend")
            todo += _named(method, APP_METHODS, "self")
    return calls


def _modules(package: Any) -> list[Any]:
    return [package] + [
        importlib.import_module(f"{package.__name__}.{m.name}")
        for m in pkgutil.iter_modules(package.__path__)
    ]


def test_the_sweep_names_every_store_call_in_the_code() -> None:
    """Every Backend method the worker, the maintenance loop and the hooks call — directly,
    or through the App methods they call — is swept (or exempt, with the reason)."""
    modules = [*_modules(errands.worker), *_modules(errands.maintenance), errands.hooks]
    called = set().union(*(_store_calls(m) for m in modules))
    assert {"job_claim", "job_get", "job_insert_many"} <= called  # the scan sees through App
    missing = called - set(SWEEP) - set(EXEMPT)
    assert not missing, f"store calls the sweep does not fault: {sorted(missing)} (add to SWEEP)"
    assert set(SWEEP) <= PROTOCOL_METHODS, "SWEEP names a method the Backend protocol lacks"


# -- the sweep -------------------------------------------------------------------------------------
def test_a_fault_free_run_makes_every_swept_call(sweep: Sweep) -> None:
    """The control run: without faults every check passes, and the workload makes every
    swept call (a fault in a call never made would prove nothing) and no other."""
    sweep.start()
    run_through(sweep)
    called = set(sweep.store.calls)
    assert not called - set(SWEEP) - set(EXEMPT), "the worker made calls the sweep does not know"
    assert not set(SWEEP) - called, f"swept calls the workload never made: {set(SWEEP) - called}"


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=DEFECTS[c]))
        if c in DEFECTS
        else c
        for c in sorted(SWEEP)
    ],
)
def test_each_store_call_failing_alone(sweep: Sweep, call: str) -> None:
    """The first calls of one store call fail (a lost request, then on PostgreSQL a lost
    reply): the call is made again and succeeds, and every guarantee holds."""
    swept = SWEEP[call]
    plan = sweep.store.plan = FailFirst(call, swept.faults)
    sweep.start()
    if swept.phase != "stopping":
        wait_until(
            lambda: plan.spent and _retried(sweep.store, call),
            timeout=DEADLINE,
            what=f"{call} failing {swept.faults} time(s), then made again",
        )
    # A stop releases the held job when its own calls are swept; else the job ends first.
    run_through(sweep, stopping=plan, release=swept.phase == "stopping")
    assert plan.spent, f"{call}: {plan.injected} of {swept.faults} faults injected"


def _retried(store: FaultyStore, call: str) -> bool:
    """After its last fault the call was made again and succeeded, or that fault was a lost
    reply (the store did the work: the call need not be made again)."""
    faults = store.faulted(call)
    return bool(faults) and (store.healed[call] > 0 or faults[-1].kind == "reply")


RANDOM_P = 0.1


@pytest.mark.parametrize("seed", [2, 4])  # seeds whose faults at start-up cost little time
def test_every_store_call_failing_at_random(sweep: Sweep, seed: int) -> None:
    """Every swept call fails with probability RANDOM_P while the workload runs, and again
    while the worker stops: every guarantee holds after the faults heal."""
    calls = frozenset(SWEEP) - set(DEFECTS)  # a known defect would fail this at random
    sweep.store.plan = RandomFaults(seed, RANDOM_P, calls)
    sweep.start()
    run_through(sweep, stopping=RandomFaults(seed + 1000, RANDOM_P, calls))
    assert len(sweep.store.faults) >= 5, f"seed {seed}: only {sweep.store.faults} injected"


# PostgreSQL only: a local SQLite commit cannot lose its reply (no network in between).
@pytest.mark.parametrize("store_url", ["postgres"], indirect=True)
def test_a_death_whose_reply_was_lost_still_runs_the_on_dead_hooks(sweep: Sweep) -> None:
    """The write that moves the permanent job to dead commits, and its reply is lost: the
    retry is fenced out, so the completer reads the row back, finds its own outcome there
    (errands.landed), and the death gets its event and its on_dead hooks."""
    assert sweep.store.replies
    sweep.store.plan = FailOnce(
        "job_finish_many", "reply", lambda args: any(o.state == "dead" for o in args[0])
    )
    sweep.start()
    run_through(sweep)  # its last check: every dead job's on_dead hook ran
    assert sweep.store.faulted("job_finish_many"), "the death's write was not faulted"
    assert [f.kind for f in sweep.store.faulted("job_finish_many")] == ["reply"]
    dead = {r["id"] for r in sweep.rows() if r["state"] == "dead"}
    assert dead and dead <= set(sweep.hooked), f"dead jobs whose on_dead hook never ran: {dead}"


def test_a_rescue_to_dead_whose_reply_was_lost_still_runs_the_on_dead_hooks(
    pg_url: str,
) -> None:
    """PostgreSQL: the leader's rescue of a job on its last attempt commits (dead) and
    its reply is lost; the next tick reads the row back, finds its rescue there (by the
    lease token in the error entry), and emits the death and runs the on_dead hooks once.
    (A local SQLite commit cannot lose its reply.)"""
    from errands.maintenance.service import Maintenance

    from .faults import FailOnce, FaultyStore
    from .helpers import claim_as_dead_worker, expire_lease

    app = errands.App(pg_url, lease=2)
    hooked: list[int] = []
    app.on_dead(lambda job: hooked.append(job.id))

    @app.job(name="sweep.last_attempt", retries=0)
    def last() -> None: ...

    try:
        handle = last.enqueue()
        store = FaultyStore.install(app)
        claim_as_dead_worker(app)
        expire_lease(app, handle.id)
        store.plan = FailOnce("job_rescue_many", "reply", lambda args: True)
        leader = Maintenance(app, "leader")
        leader.run_once()  # the rescue commits; its reply is lost
        assert store.faulted("job_rescue_many") and handle.status() is JobState.DEAD
        assert hooked == []
        leader.run_once()  # the next tick confirms it
        wait_until(lambda: hooked, timeout=20, what="the on_dead hook")
        leader.run_once()
        assert hooked == [handle.id]  # once
        assert leader.rescued == 1
        leader.stop()
    finally:
        app.close()
