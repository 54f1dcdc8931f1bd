"""Fair-queue options: ``@app.job(fair_key=...)``, ``app.queue(fair=, aging=)`` and
``app.fair_weight``, checked at declaration with errors that name the fix."""

from __future__ import annotations

import logging
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import pytest

import errands
from errands import ConfigurationError
from errands.backends.fair import CallableWeights
from errands.errors import InvalidPayload
from tests.integration.helpers import run_script


def _handler(tenant_id: int, n: int = 0) -> None: ...


def _define(app: errands.App, **options: Any) -> errands.JobDefinition[Any, Any]:
    options.setdefault("name", "t.job")
    return app.job(**options)(_handler)  # type: ignore[no-any-return]


def test_a_fair_key_template_naming_an_unknown_parameter_is_refused(app: errands.App) -> None:
    with pytest.raises(ConfigurationError, match=r"fair_key='t:\{tenant\}' names \['tenant'\]"):
        _define(app, fair_key="t:{tenant}")


def test_a_fair_key_that_is_not_a_template_is_refused(app: errands.App) -> None:
    with pytest.raises(ConfigurationError, match="not a valid template"):
        _define(app, fair_key="t:{tenant_id")
    with pytest.raises(ConfigurationError, match="must be a str template"):
        _define(app, fair_key=5)


def test_a_fair_key_template_that_formats_to_nothing_gives_no_key(app: errands.App) -> None:
    """tenant="" made a real key "", the name the claim gives the unkeyed jobs: they were
    then left out of the lookahead. An empty key is no key: the job is unkeyed."""

    @app.job(name="t.named", fair_key="{tenant}")
    def named(tenant: str) -> None: ...

    assert named.bind(tenant="").request.fair_key is None
    assert named.bind(tenant="acme").request.fair_key == "acme"


def test_the_fair_key_is_built_from_the_arguments_at_enqueue(app: errands.App) -> None:
    job = _define(app, fair_key="tenant:{tenant_id}")
    assert job.bind(tenant_id=7).request.fair_key == "tenant:7"
    padded = _define(app, name="t.padded", fair_key="tenant:{tenant_id:02000d}")
    with pytest.raises(InvalidPayload, match="cannot build fair_key"):
        padded.bind(tenant_id=1)  # a key of at most 1000 bytes


def test_job_types_without_a_template_are_their_own_key_in_a_queue_declared_fair(
    app: errands.App,
) -> None:
    app.queue("reports", fair=True)
    plain = _define(app, name="t.plain", queue="reports")
    elsewhere = _define(app, name="t.elsewhere")
    assert plain.bind(tenant_id=1).request.fair_key == "job:t.plain"
    assert elsewhere.bind(tenant_id=1).request.fair_key is None


def test_aging_needs_a_fair_queue_and_at_least_one_second(app: errands.App) -> None:
    with pytest.raises(ConfigurationError, match="aging applies to fair queues; pass fair=True"):
        app.queue("q", aging=30)
    with pytest.raises(ConfigurationError, match="at least 1 second"):
        app.queue("q", fair=True, aging=0.5)
    with pytest.raises(ConfigurationError, match="fair must be a bool"):
        app.queue("q", fair="yes")  # type: ignore[arg-type]
    app.queue("q", fair=True, aging=timedelta(minutes=1))
    assert (app.queues["q"].fair, app.queues["q"].aging) == (True, 60.0)


def test_fair_weights_are_stored_audited_and_checked(app: errands.App) -> None:
    app.fair_weight("tenant:acme", 5, actor="ops:alice")
    assert [(w.key, w.weight, w.updated_by) for w in app.backend.fair_weights()] == [
        ("tenant:acme", 5.0, "ops:alice")
    ]
    event = app.audit(limit=1)[0]
    assert (event.action, event.actor, event.detail) == (
        "fair_weight",
        "ops:alice",
        {"key": "tenant:acme", "weight": 5.0},
    )
    app.fair_weight("tenant:acme", None)
    assert app.backend.fair_weights() == []
    with pytest.raises(ConfigurationError, match="weight must be a number above 0"):
        app.fair_weight("tenant:acme", 0)


def test_a_weight_for_the_empty_key_is_refused_as_the_mark_of_jobs_without_a_key(
    app: errands.App,
) -> None:
    """'' is how a fair claim marks the jobs without a fair key: a weight stored for it
    was taken, and weighed them all. Refused, saying so; a reset is allowed (a weight
    stored before)."""
    with pytest.raises(ConfigurationError, match=r"fair_weight\(''\): the empty key is how"):
        app.fair_weight("", 2)
    assert app.backend.fair_weights() == []
    app.fair_weight("", None)


def test_weights_given_by_a_callable_are_asked_once_per_key_and_cached() -> None:
    asked: list[str] = []

    def weight(key: str) -> float:
        asked.append(key)
        return {"tenant:acme": 5.0}.get(key, 1.0)

    weights = CallableWeights(weight, budget=30.0)
    try:
        assert weights(["tenant:acme", "tenant:zed"]) == {"tenant:acme": 5.0, "tenant:zed": 1.0}
        assert weights(["tenant:acme"]) == {"tenant:acme": 5.0}
        assert sorted(asked) == ["tenant:acme", "tenant:zed"]
    finally:
        weights.close()


@pytest.mark.parametrize("answer", [RuntimeError("no plan table"), 0, -2.0, "5", float("nan")])
def test_a_weight_callable_that_raises_or_gives_a_bad_value_gives_weight_1_and_logs(
    answer: object, caplog: pytest.LogCaptureFixture
) -> None:
    def weight(key: str) -> float:
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[return-value]

    weights = CallableWeights(weight, budget=30.0)
    try:
        with caplog.at_level(logging.WARNING, "errands.fair"):
            assert weights(["tenant:acme"]) == {"tenant:acme": 1.0}
    finally:
        weights.close()
    assert "fair weight callable" in caplog.text and "'tenant:acme'" in caplog.text
    assert "gets weight 1" in caplog.text


def test_a_slow_weight_callable_never_holds_a_claim_up(caplog: pytest.LogCaptureFixture) -> None:
    """The claim waits its budget at most: a callable still running is left behind (the
    key weighs 1 meanwhile, a warning says so), and its answer is used once it comes."""
    release = threading.Event()

    def weight(key: str) -> float:
        release.wait(60)
        return 3.0

    weights = CallableWeights(weight, budget=0.01)
    try:
        with caplog.at_level(logging.WARNING, "errands.fair"):
            assert weights(["tenant:acme"]) == {}  # no answer yet: the claim uses 1
        assert not release.is_set()  # the callable is still running: the claim went on
        assert "not answered within" in caplog.text
        release.set()
        deadline = time.monotonic() + 60
        while weights(["tenant:acme"]) != {"tenant:acme": 3.0}:
            assert time.monotonic() < deadline, "the late answer never came"
            time.sleep(0.01)
    finally:
        release.set()
        weights.close()


def test_fair_weight_takes_a_callable_as_a_decorator_and_names_the_mistakes(
    app: errands.App,
) -> None:
    @app.fair_weight
    def weight(key: str) -> float:
        return 2.0

    assert app.fair_weights is not None and app.fair_weights.fn is weight
    with pytest.raises(ConfigurationError, match=r"give the key's weight, as fair_weight"):
        app.fair_weight("tenant:acme")  # type: ignore[call-overload]
    with pytest.raises(ConfigurationError, match="pass it alone"):
        app.fair_weight(weight, 2)  # type: ignore[call-overload]


def test_a_key_asked_again_after_its_ttl_is_claimed_at_its_last_answer_without_waiting() -> None:
    """A key's answer is asked again after the ttl; a claim waited its whole budget for
    it (under the queue's claim lock: on SQLite, every writer's lock) though it had an
    answer. It now uses the last answer and gets the new one at a later claim."""
    release = threading.Event()
    calls: list[str] = []

    def weight(key: str) -> float:
        calls.append(key)
        if len(calls) > 1:
            release.wait(60)  # the second ask hangs
        return 4.0

    weights = CallableWeights(weight, ttl=0.0, budget=5.0)
    try:
        assert weights(["tenant:acme"]) == {"tenant:acme": 4.0}
        started = time.monotonic()
        assert weights(["tenant:acme"]) == {"tenant:acme": 4.0}  # asked again: not waited
        assert time.monotonic() - started < 4  # not the 5 s budget
    finally:
        release.set()
        weights.close()


def _hanging_on_first(n: int, release: threading.Event, calls: list[str]) -> Any:
    """A weight callable that hangs (until ``release``) on its first ``n`` keys, as a plan
    lookup with no timeout does during an outage; 2.0 for every other key."""
    lock = threading.Lock()

    def weight(key: str) -> float:
        with lock:
            calls.append(key)
            first = len(calls) <= n
        if first:
            release.wait(120)
        return 2.0

    return weight


def test_a_hung_weight_callable_costs_one_budget_not_one_per_later_claim_with_new_keys() -> None:
    """Given a callable hanging on its first 2 keys (both threads stuck), then 40 claims
    over new keys wait their budget at most once: the keys in flight when it hung. Each
    new key was queued to nobody, stayed "asking", and every claim waited its whole
    budget for it (under the queue's claim lock: 40 x 0.5 s here)."""
    release = threading.Event()
    calls: list[str] = []
    # stuck threads are not replaced within the test: the breaker alone is measured
    weights = CallableWeights(_hanging_on_first(2, release, calls), budget=0.5, stuck_after=600.0)
    try:
        assert weights(["t:0", "t:1"]) == {}  # both threads hang: the first claim waits
        waited = 0
        started = time.monotonic()
        for i in range(40):
            began = time.monotonic()
            weights([f"t:new{i}", f"t:other{i}"])
            waited += time.monotonic() - began >= 0.5
        assert waited <= 1, f"{waited} of 40 claims waited the whole budget"
        assert time.monotonic() - started < 10 * 0.5  # (before: 40 x 0.5 s)
    finally:
        release.set()
        weights.close()


def test_a_weight_callable_that_answers_again_is_waited_for_again() -> None:
    """The breaker closes at the callable's next answer: a claim after it waits for a new
    key's answer (within its budget) and gets it, not weight 1."""
    release = threading.Event()
    calls: list[str] = []
    weights = CallableWeights(_hanging_on_first(1, release, calls), budget=0.2, stuck_after=600.0)
    try:
        assert weights(["t:hung"]) == {}
        # its ask overran the budget (counted from when its thread took the key, which a
        # busy machine starts later than the claim's own clock: give it that margin)
        time.sleep(0.5)
        assert weights(["t:during"], budget=0.2) == {}  # hung: not waited for
        release.set()  # it answers again (the hung key, then the one queued)
        deadline = time.monotonic() + 60
        while weights(["t:hung"]) != {"t:hung": 2.0}:
            assert time.monotonic() < deadline, "the hung key was never answered"
            time.sleep(0.01)
        assert weights(["t:after"], budget=30.0) == {"t:after": 2.0}  # waited for
    finally:
        release.set()
        weights.close()


def test_threads_stuck_in_the_weight_callable_are_replaced_up_to_a_bound() -> None:
    """Given a callable hanging on every key, its stuck threads are replaced so that keys
    queued behind them are asked, but never more than ``threads_max`` threads run; given
    one hanging on its first 2 keys only, a new key gets its answer from a replacement."""
    before = set(threading.enumerate())
    release = threading.Event()
    calls: list[str] = []
    weights = CallableWeights(
        _hanging_on_first(10**6, release, calls),
        budget=0.01, stuck_after=0.05, threads=2, threads_max=5,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        i = 0
        while len(calls) < 5 and time.monotonic() < deadline:
            weights([f"t:{i}"])
            i += 1
            time.sleep(0.02)
        for j in range(50):  # more stuck keys: no more threads
            weights([f"t:more{j}"])
            time.sleep(0.005)
        mine = [t for t in set(threading.enumerate()) - before if t.name.startswith("errands-fair")]
        assert len(calls) == 5 and len(mine) == 5, (calls, mine)
    finally:
        release.set()
        weights.close()

    release = threading.Event()
    calls = []
    weights = CallableWeights(_hanging_on_first(2, release, calls), budget=0.01, stuck_after=0.05)
    try:
        weights(["t:0", "t:1"])  # both threads stuck
        deadline = time.monotonic() + 30
        while weights(["t:new"]) != {"t:new": 2.0}:
            assert time.monotonic() < deadline, "no replacement thread asked the new key"
            time.sleep(0.01)
    finally:
        release.set()
        weights.close()


@pytest.mark.skipif(sys.platform == "win32", reason="no os.fork on Windows")
def test_a_child_forked_while_weight_threads_run_asks_its_own_keys_on_threads_of_its_own() -> None:
    """The parent's asking threads run (one in the callable) at a fork, and then another
    thread holds the lock as the parent forks again. The first child had the count of
    threads running copied as it was: it started none, its new key was queued to nobody
    and the claim waited its whole budget for nothing; the second had the lock copied
    held, by a thread it does not have: its first claim hung for good. In a child the
    weights start afresh (new lock and queue, no thread): a new key is asked there, on a
    thread of the child's, and answered. Real os.fork, in a process of its own; a child
    still hung after 60 s is ended by its alarm."""
    script = """
        import os, signal, threading
        from errands.backends.fair import CallableWeights

        release, asking = threading.Event(), threading.Event()

        def weight(key: str) -> float:
            if key == "parent":  # a thread of the parent's, in the callable at the fork
                asking.set()
                release.wait(60)
            return 3.0

        weights = CallableWeights(weight, budget=0.01)
        assert weights(["parent"]) == {} and asking.wait(30)  # its threads run

        def child(key: str) -> None:
            signal.alarm(60)  # hung: killed by SIGALRM, the test fails
            answer = weights([key], budget=10.0)  # before: {} after 10 s
            print(f"child {key}:", answer, flush=True)
            os._exit(0 if answer == {key: 3.0} else 1)

        def fork(key: str) -> None:
            pid = os.fork()
            if pid == 0:
                child(key)
            _, status = os.waitpid(pid, 0)
            print(f"child {key} exit", os.waitstatus_to_exitcode(status), flush=True)

        fork("threads-running")

        held, forked = threading.Event(), threading.Event()

        def hold() -> None:  # the lock held across the fork
            with weights._cond:
                held.set()
                forked.wait(60)

        threading.Thread(target=hold, daemon=True).start()
        assert held.wait(30)
        fork("lock-held")
        forked.set()
        release.set()
        assert weights(["parent"], budget=30.0) == {"parent": 3.0}  # the parent's goes on
        print("parent answered", flush=True)
        """
    done = run_script(script)
    assert done.returncode == 0, (done.stdout, done.stderr[-3000:])
    for said in ("child threads-running exit 0", "child lock-held exit 0", "parent answered"):
        assert said in done.stdout, (done.stdout, done.stderr[-3000:])
