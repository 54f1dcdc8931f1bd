"""A property test over random interleavings of claim, edit, cancel, signal, suspension and
completion on a few jobs, on every backend. After every step:

- no attempt runs with arguments from before an edit that succeeded (a claim returns the
  arguments of the last successful edit);
- no edit lands on a running or finished job (an edit reports a job only while pending,
  and a job not reported is unchanged);
- no signal is lost (a job never waits for a signal that is stored; the first payload
  sent is the one ``signal_get`` returns);
- a suspended job holds no slot (a waiting job has no lease, and no claim takes it).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from errands.backends import Backend
from errands.backends.base import EditParams, FinishParams, JobEdit
from errands.errors import InvalidTransition

from .support import claim, get, request

JOBS = 3
OPS = ("claim", "edit", "cancel", "signal", "suspend", "complete")
PENDING = ("scheduled", "available", "retryable")
_queues = itertools.count()


@dataclass
class Model:
    """What the store must say about each job, from the answers it gave."""

    version: dict[int, int] = field(default_factory=dict)  # args of the last successful edit
    token: dict[int, str] = field(default_factory=dict)  # the live attempt's lease token
    signalled: dict[int, str] = field(default_factory=dict)  # first payload of "go"


def _step(backend: Backend, queue: str, ids: list[int], model: Model, op: str, n: int) -> None:
    job_id = ids[n % len(ids)]
    row = get(backend, job_id)
    if op == "claim":
        for claimed in claim(backend, queue, 1):
            assert json.loads(claimed.args) == {"v": model.version[claimed.id]}, "stale args"
            assert get(backend, claimed.id).state == "running"
            model.token[claimed.id] = claimed.lease_token or ""
    elif op == "edit":
        version = model.version[job_id] + 1
        edit = JobEdit(job_id, json.dumps({"v": version}))
        result = backend.job_edit(EditParams("prop", [edit], priority=version))
        if result.matched:
            assert row.state in PENDING, f"edit landed on a {row.state} job"
            model.version[job_id] = version
        else:
            assert row.state not in PENDING
            assert get(backend, job_id).args == row.args, "a refused edit changed the job"
    elif op == "cancel":
        try:
            backend.job_cancel(job_id, "prop")
        except InvalidTransition:
            assert row.state in ("completed", "cancelled", "dead", "discarded")
    elif op == "signal":
        payload = json.dumps(n)
        try:
            backend.job_signal(job_id, "go", payload, "prop")
        except InvalidTransition:
            assert row.state in ("completed", "cancelled", "discarded")
        else:
            model.signalled.setdefault(job_id, payload)
    elif op in ("suspend", "complete") and row.state == "running":
        token = model.token[job_id]
        outcome = (
            FinishParams(job_id, token, "waiting", wait_signal="go", wait_timeout=3600.0)
            if op == "suspend"
            else FinishParams(job_id, token, "completed", result_json="1")
        )
        assert backend.job_finish_many([outcome]) == [True]


def _check(backend: Backend, ids: list[int], model: Model) -> None:
    for job_id in ids:
        row = get(backend, job_id)
        stored = backend.signal_get(job_id, "go")
        expected = model.signalled.get(job_id)
        assert (stored is None) == (expected is None), "a signal was lost (or invented)"
        if stored is not None:
            assert json.loads(stored) == json.loads(expected or "null"), "not the first payload"
        if row.state == "waiting":
            assert row.lease_token is None and row.lease_owner is None, "waiting holds a lease"
            assert stored is None, "waiting for a signal that is stored"
        if row.state in PENDING or row.state == "running":
            assert json.loads(row.args) == {"v": model.version[job_id]}


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, JOBS - 1)), max_size=30))
def test_random_interleavings_keep_edits_signals_and_suspensions_sound(
    backend: Backend, steps: list[tuple[str, int]]
) -> None:
    """Claims, edits, cancels, signals, suspensions and completions in any order keep
    every invariant of the module docstring, on every backend."""
    queue = f"prop{next(_queues)}"  # each example has its own jobs and queue
    results = backend.job_insert_many(
        [request(queue=queue, args_json='{"v": 0}') for _ in range(JOBS)]
    )
    ids = [r.id for r in results]
    model = Model(version=dict.fromkeys(ids, 0))
    for op, n in steps:
        _step(backend, queue, ids, model, op, n)
        _check(backend, ids, model)
    # a waiting job is never claimed: with every job waiting, a claim takes nothing
    waiting = [i for i in ids if get(backend, i).state == "waiting"]
    if len(waiting) == len(ids):
        assert claim(backend, queue, JOBS) == []
