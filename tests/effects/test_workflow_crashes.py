"""The workflow fan-in holds while real worker processes die at its commit points, and
when every member is delivered twice (issue 18), on SQLite and PostgreSQL.

Crash-point explorer: at the points of the fan-in path — a member's end written and its
fan-in about to run (``before_fan_in``), a workflow settling with its callbacks about to
be inserted (``before_callback_insert``), both inside the member's transaction, and just
after that transaction committed (``after_fan_in_commit``) — real ``errands worker``
processes crash (``os._exit``, no cleanup: a SIGKILL's effect) with some probability,
while they run every workflow shape: a batch, a chain, a diamond, a wide fan-out/fan-in
and a member adding members. ``make test`` arms the three points at once; ``make soak``
(marker ``soak``) arms each point in turn, with SIGKILLs at random moments on top. Each
run ends with every workflow settled succeeded, each callback fired exactly once and
after the last member, no member run before its parents completed, and every member
completed once.

Duplicate delivery: every member and callback is delivered a second time as a stale
worker would run it (``Tester.drain_duplicated``), and, separately, crashed just before
its completion commits and delivered again: the same invariants hold.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import effects_app
import pytest
from effects_store import WORKFLOW_TABLES, EffectsStore

import errands
from errands.testing import Tester

from .storm import Storm, settled

WIDE = 10  # the wide fan-out's width
GROW = 3  # members the growing batch's first member adds, one after the other


@pytest.fixture
def app(store_url: str) -> Iterator[errands.App]:
    """``effects_app.app`` (the workers' app) pointed at this test's store."""
    application = effects_app.app
    application.close()
    application.url = store_url
    application.migrate()
    yield application
    application.close()


def _callbacks() -> dict[str, errands.BoundJob]:
    step = effects_app.wf_callback
    return {event: step.bind(event=event) for event in ("on_success", "on_settled")}


def shapes() -> dict[str, tuple[errands.Workflow, int]]:
    """Each workflow shape, with how many members it ends with."""
    step = effects_app.wf_step
    batch = errands.Batch("batch", **_callbacks())
    for n in range(6):
        batch.add(step.bind(n=n))
    chain = errands.Workflow("chain", **_callbacks())
    previous = None
    for n in range(5):
        previous = chain.add(step.bind(n=n), after=[previous] if previous else [])
    diamond = errands.Workflow("diamond", **_callbacks())
    top = diamond.add(step.bind(n=0))
    sides = [diamond.add(step.bind(n=n), after=[top]) for n in (1, 2)]
    diamond.add(step.bind(n=3), after=sides)
    wide = errands.Workflow("wide", **_callbacks())
    root = wide.add(step.bind(n=0))
    fan = [wide.add(step.bind(n=n), after=[root]) for n in range(1, WIDE + 1)]
    wide.add(step.bind(n=WIDE + 1), after=fan)
    growing = errands.Batch("growing", **_callbacks())
    growing.add(step.bind(n=0, grow=GROW))
    inner = errands.Batch("inner", **_callbacks())
    for n in range(3):
        inner.add(step.bind(n=n))
    outer = errands.Workflow("outer", **_callbacks())
    inner_node = outer.add(inner, name="inner")
    outer.add(step.bind(n=9), after=[inner_node])
    return {
        "batch": (batch, 6),
        "chain": (chain, 5),
        "diamond": (diamond, 4),
        "wide": (wide, WIDE + 2),
        "growing": (growing, GROW + 1),
        "nested": (outer, 2),
    }


def check(app: errands.App, effects: EffectsStore, expected: dict[int, int]) -> None:
    """The workflow invariants, for workflows ``{id: members it ends with}``."""
    for workflow_id, total in expected.items():
        status = app.workflow_status(workflow_id)
        assert (status.state, status.total, status.completed, status.pending) == (
            "succeeded", total, total, 0,
        ), status  # fmt: skip
        members = app.workflow_members(workflow_id)
        assert [m.outcome for m in members] == ["completed"] * total
        assert all(m.state == "completed" for m in members if m.workflow_id is None)
        assert all(cb is not None for cb in status.callbacks.values()), status
    runs = effects.execute("SELECT job_id, workflow_id, early FROM wf_runs")
    assert [r for r in runs if r[2]] == [], "a member ran before its parents completed"
    ran = {(int(r[1]), int(r[0])) for r in runs}
    for workflow_id in expected:
        members = app.workflow_members(workflow_id)
        assert {m.job_id for m in members if m.workflow_id is None} == {
            job for wf, job in ran if wf == workflow_id
        }
    fired = effects.execute("SELECT job_id, workflow_id, event, pending FROM wf_callbacks")
    assert [r for r in fired if r[3] != 0] == [], "a callback ran before its workflow settled"
    jobs_per_event = Counter((int(r[1]), r[2]) for r in {(r[0], r[1], r[2]) for r in fired})
    assert jobs_per_event == Counter(
        {(wf, event): 1 for wf in expected for event in ("on_success", "on_settled")}
    ), "a callback fired twice, or never"
    callback_jobs = app.jobs(name="wf_callback", limit=1000)
    assert len(callback_jobs) == 2 * len(expected)
    assert {j.state.value for j in callback_jobs} == {"completed"}


def _describe(app: errands.App) -> str:
    """The workflows still running, each with its pending members' states."""
    lines = []
    for w in app.workflows(state="running"):
        pending = [f"{m.node}={m.state}" for m in app.workflow_members(w.id) if m.outcome is None]
        lines.append(f"{w.name} {w.pending}/{w.total} pending: {', '.join(pending)}")
    return "\n".join(lines)


def _enqueue_all(app: errands.App) -> dict[int, int]:
    """Every shape enqueued: ``{workflow id: members it ends with}``, nested ones too."""
    expected = {}
    for wf, total in shapes().values():
        handle = app.enqueue_workflow(wf)
        expected[handle.id] = total
        for child in handle.children.values():
            expected[child.id] = len(child.members())
    return expected


# Each point's crash probability: every member's end reaches the first and the last, only
# the ten settling transactions reach before_callback_insert (so it crashes more often).
POINTS = {"before_fan_in": 0.15, "before_callback_insert": 0.4, "after_fan_in_commit": 0.15}


def _storm(
    app: errands.App,
    effects: EffectsStore,
    storm: Storm,
    backend: str,
    points: list[str],
    kill_every: tuple[float, float] | None = None,
) -> None:
    effects.create(WORKFLOW_TABLES)
    expected = _enqueue_all(app)

    def done() -> bool:
        pending = app.jobs(name="wf_callback", limit=1000)
        return not app.workflows(state="running") and all(
            j.state.value == "completed" for j in pending
        )

    storm.run(done, workers=2, concurrency=4, kill_every=kill_every, timeout=280.0,
              describe=lambda: _describe(app))  # fmt: skip
    settled(lambda: check(app, effects, expected))
    crashes = storm.fault_crashes()
    for point in points:
        assert crashes[point] >= 1, f"the fault point {point} never fired: {dict(crashes)}"
    print(f"\n[{backend}] crashes {dict(crashes)}, {storm.kills} SIGKILLs")


def test_every_callback_fires_once_and_no_dependent_runs_early_when_workers_die_in_the_fan_in(
    app: errands.App,
    backend: str,
    store_url: str,
    effects: EffectsStore,
    storm_factory: Callable[..., Storm],
) -> None:
    # At most 3 crashes a point: each is a worker restart, and a few prove the point. With
    # the budget the probabilities are doubled, so each point fires early and surely (one
    # run saw after_fan_in_commit, reached by fewer finishes, never fire at 0.15).
    faults = ",".join(f"{point}:{min(p * 2, 0.8)}:3" for point, p in POINTS.items())
    _storm(app, effects, storm_factory(store_url, store_url, faults=faults), backend, [*POINTS])


@pytest.mark.soak
@pytest.mark.parametrize("point", POINTS)
def test_the_fan_in_holds_with_workers_dying_at_each_point_in_turn(
    app: errands.App,
    backend: str,
    store_url: str,
    effects: EffectsStore,
    storm_factory: Callable[..., Storm],
    point: str,
) -> None:
    faults = f"{point}:{min(POINTS[point] * 2, 0.5)}"
    storm = storm_factory(store_url, store_url, faults=faults)
    # SIGKILLs at random moments too, far enough apart that a restarted worker (slow to
    # start on a loaded machine) gets work done between them.
    _storm(app, effects, storm, backend, [point], kill_every=(4.0, 8.0))


@pytest.mark.parametrize("crash", [False, True], ids=["stale-duplicate", "crash-then-again"])
def test_every_callback_fires_once_when_every_member_is_delivered_twice(
    app: errands.App,
    effects: EffectsStore,
    errands_testing: Callable[..., Tester],
    monkeypatch: pytest.MonkeyPatch,
    store_url: str,
    crash: bool,
) -> None:
    effects.create(WORKFLOW_TABLES)
    monkeypatch.setenv("EFFECTS_URL", store_url)
    effects_app._effects = None  # the handlers' store: this test's
    tester = errands_testing(app)
    expected = _enqueue_all(app)

    def snapshot() -> Any:
        return sorted(effects.execute("SELECT workflow_id, event FROM wf_callbacks"))

    try:
        report = tester.drain_duplicated(snapshot, crash=crash)
    finally:
        if effects_app._effects is not None:  # the handlers' connections
            effects_app._effects.close()
            effects_app._effects = None
    assert report.drain.runs, "nothing ran"
    check(app, effects, expected)
