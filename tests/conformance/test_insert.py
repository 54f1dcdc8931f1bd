"""Enqueue: inserts, schedules, idempotency keys and the caller's own transaction."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from errands.backends import Backend
from errands.backends.base import ListParams
from errands.errors import ConfigurationError

from .conftest import Harness
from .support import JOB, get, insert, request


def test_insert_stores_one_available_job_with_every_field(backend: Backend) -> None:
    """A job without delay is available at once and stores what the request carried."""
    before = backend.db_now()
    (result,) = backend.job_insert_many(
        [
            request(
                name="shop.send",
                queue="emails",
                args_json='{"user_id":42}',
                priority=5,
                max_attempts=4,
                key="welcome:42",
                timeout=12.5,
                lease_seconds=60.0,
                meta={"sensitive": ["email"]},
            )
        ]
    )
    assert result.deduplicated is False
    row = get(backend, result.id)
    assert (row.name, row.queue, row.state) == ("shop.send", "emails", "available")
    assert json.loads(row.args) == {"user_id": 42}
    assert json.loads(row.meta) == {"sensitive": ["email"]}
    assert (row.priority, row.max_attempts, row.attempt) == (5, 4, 0)
    assert row.idempotency_key == "welcome:42"
    assert (row.timeout, row.lease_seconds) == (12.5, 60.0)
    assert json.loads(row.errors) == []
    assert row.result is None and row.finished_at is None and row.lease_token is None
    assert before - 1 <= row.inserted_at <= backend.db_now() + 1
    assert row.run_at <= backend.db_now()


def test_insert_many_returns_one_result_per_request_in_order(backend: Backend) -> None:
    """Several requests in one call are all stored, ids ascending in request order."""
    results = backend.job_insert_many([request(args_json=f'{{"n":{n}}}') for n in range(5)])
    ids = [r.id for r in results]
    assert ids == sorted(ids) and len(set(ids)) == 5
    assert [json.loads(get(backend, i).args)["n"] for i in ids] == list(range(5))


def test_insert_many_is_one_transaction_so_a_bad_row_stores_none(
    backend: Backend, harness: Harness
) -> None:
    """When one request of a batch violates the schema, none of the batch is stored."""
    with pytest.raises(harness.driver_errors):
        backend.job_insert_many([request(key="first"), request(max_attempts=0)])
    assert backend.job_list(ListParams()) == []


def test_insert_with_delay_is_scheduled_at_now_plus_delay(backend: Backend) -> None:
    """A delay makes the job scheduled, due that many seconds after database now."""
    job_id = insert(backend, delay=120.0)
    row = get(backend, job_id)
    now = backend.db_now()
    assert row.state == "scheduled"
    assert now + 115 <= row.run_at <= now + 121


def test_insert_with_future_run_at_is_scheduled_at_that_time(backend: Backend) -> None:
    """An explicit run_at in the future is stored as given and the job waits for it."""
    at = backend.db_now() + 3600.0
    row = get(backend, insert(backend, run_at=at))
    assert row.state == "scheduled"
    assert row.run_at == pytest.approx(at, abs=0.01)


def test_insert_with_past_run_at_is_available_at_once(backend: Backend) -> None:
    """A run_at already in the past makes the job available immediately."""
    row = get(backend, insert(backend, run_at=backend.db_now() - 60.0))
    assert row.state == "available"


def test_same_name_and_key_returns_the_existing_job_as_deduplicated(backend: Backend) -> None:
    """A second enqueue of one name and key gets the first job's id, marked deduplicated."""
    (first,) = backend.job_insert_many([request(key="order:7", args_json='{"v":1}')])
    (second,) = backend.job_insert_many([request(key="order:7", args_json='{"v":2}')])
    assert (second.id, second.deduplicated) == (first.id, True)
    assert first.deduplicated is False
    assert json.loads(get(backend, first.id).args) == {"v": 1}  # the first one's args stay
    assert len(backend.job_list(ListParams())) == 1


def test_same_key_twice_in_one_batch_stores_one_job(backend: Backend) -> None:
    """Two requests with one key inside a single batch dedupe against each other."""
    first, second = backend.job_insert_many([request(key="k"), request(key="k")])
    assert second.id == first.id and (first.deduplicated, second.deduplicated) == (False, True)


def test_same_key_on_different_job_names_does_not_collide(backend: Backend) -> None:
    """Idempotency keys are scoped to the job name."""
    (a,) = backend.job_insert_many([request(name="jobs.a", key="shared")])
    (b,) = backend.job_insert_many([request(name="jobs.b", key="shared")])
    assert a.id != b.id and not a.deduplicated and not b.deduplicated


def test_jobs_without_key_are_never_deduplicated(backend: Backend) -> None:
    """Identical requests without a key are separate jobs."""
    results = backend.job_insert_many([request(), request()])
    assert len({r.id for r in results}) == 2 and not any(r.deduplicated for r in results)


def test_sixteen_threads_enqueuing_one_key_create_exactly_one_job(backend: Backend) -> None:
    """Concurrent enqueues of one key give one row, and every caller gets its id (I8)."""
    barrier = threading.Barrier(16)
    results: list[tuple[int, bool]] = []
    failures: list[BaseException] = []
    lock = threading.Lock()

    def enqueue() -> None:
        try:
            barrier.wait()
            (result,) = backend.job_insert_many([request(key="race")])
            with lock:
                results.append((result.id, result.deduplicated))
        except BaseException as exc:
            with lock:
                failures.append(exc)

    threads = [threading.Thread(target=enqueue) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert failures == []
    assert len(results) == 16
    assert len({job_id for job_id, _ in results}) == 1
    assert sorted(dedup for _, dedup in results) == [False] + [True] * 15
    assert len(backend.job_list(ListParams(name=JOB))) == 1


# -- the caller's own transaction ------------------------------------------------------


def _require_caller_connection(backend: Backend) -> None:
    """Every backend must take part in the caller's transaction (DESIGN: enqueue inside
    the caller's own database transaction)."""
    assert backend.capabilities.caller_connection, type(backend).__name__


def test_enqueue_on_callers_connection_rolls_back_with_the_caller(
    backend: Backend, harness: Harness, tmp_path: Path
) -> None:
    """A job enqueued in the caller's transaction vanishes when that transaction rolls back."""
    _require_caller_connection(backend)
    with harness.caller_connection(backend, tmp_path, same_store=True) as conn:
        harness.execute(conn, "CREATE TEMP TABLE orders (id INTEGER PRIMARY KEY)")
        harness.begin(conn)
        harness.execute(conn, "INSERT INTO orders (id) VALUES (1)")
        (result,) = backend.job_insert_many([request(key="order:1")], conn=conn)
        harness.rollback(conn)
        assert harness.execute(conn, "SELECT count(*) FROM orders") == [(0,)]
    assert backend.job_get(result.id) is None
    assert backend.job_list(ListParams()) == []


def test_enqueue_on_callers_connection_commits_with_the_caller(
    backend: Backend, harness: Harness, tmp_path: Path
) -> None:
    """A job enqueued in the caller's transaction exists once that transaction commits."""
    _require_caller_connection(backend)
    with harness.caller_connection(backend, tmp_path, same_store=True) as conn:
        harness.execute(conn, "CREATE TEMP TABLE orders (id INTEGER PRIMARY KEY)")
        harness.begin(conn)
        harness.execute(conn, "INSERT INTO orders (id) VALUES (1)")
        (result,) = backend.job_insert_many([request(key="order:1")], conn=conn)
        harness.commit(conn)
    assert [r.id for r in backend.job_list(ListParams())] == [result.id]
    assert get(backend, result.id).state == "available"


def test_job_get_on_callers_connection_sees_its_uncommitted_enqueue(
    backend: Backend, harness: Harness, tmp_path: Path
) -> None:
    """``job_get(conn=)`` reads on the caller's connection: inside the caller's open
    transaction it returns the job that transaction enqueued (as the same row the store
    gives after commit), where the backend's own connections do not see it yet."""
    _require_caller_connection(backend)
    with harness.caller_connection(backend, tmp_path, same_store=True) as conn:
        harness.begin(conn)
        (result,) = backend.job_insert_many([request(key="order:1")], conn=conn)
        inside = backend.job_get(result.id, conn=conn)
        assert inside is not None
        assert (inside.id, inside.idempotency_key, inside.state) == (
            result.id,
            "order:1",
            "available",
        )
        assert backend.job_get(424242, conn=conn) is None
        assert backend.job_get(result.id) is None  # not committed yet
        harness.commit(conn)
    assert get(backend, result.id) == inside


def test_enqueue_refuses_a_connection_to_another_database(
    backend: Backend, harness: Harness, tmp_path: Path
) -> None:
    """A caller's connection to a different store raises ConfigurationError and writes nothing."""
    _require_caller_connection(backend)
    with (
        harness.caller_connection(backend, tmp_path, same_store=False) as conn,
        pytest.raises(ConfigurationError, match="same"),
    ):
        backend.job_insert_many([request()], conn=conn)
    assert backend.job_list(ListParams()) == []


def test_enqueue_refuses_a_closed_connection_naming_the_fix(
    backend: Backend, harness: Harness, tmp_path: Path
) -> None:
    """A caller's connection already closed is refused with ConfigurationError saying so
    (the driver's own error came from deep inside), and nothing is written."""
    _require_caller_connection(backend)
    with harness.caller_connection(backend, tmp_path, same_store=True) as conn:
        pass  # closed on leaving
    with pytest.raises(ConfigurationError, match="the connection is closed"):
        backend.job_insert_many([request()], conn=conn)
    assert backend.job_list(ListParams()) == []


def test_enqueue_refuses_a_connection_of_the_wrong_type(backend: Backend) -> None:
    """Something that is not the backend's connection type is refused, naming the type."""
    _require_caller_connection(backend)
    with pytest.raises(ConfigurationError, match="got object"):
        backend.job_insert_many([request()], conn=object())


def test_a_mixed_batch_stores_each_job_as_a_batch_of_one_would(backend: Backend) -> None:
    """A batch mixing plain, delayed, timed, keyed and duplicate requests stores every job
    with the same state, times and fields as inserting it alone (the PostgreSQL backend
    COPYs the unkeyed ones and INSERTs the keyed ones in the same transaction)."""
    (existing,) = backend.job_insert_many([request(key="taken")])
    now = backend.db_now()
    specs: list[dict[str, Any]] = [
        {"args_json": '{"n":1}', "priority": 3, "timeout": 2.5, "lease_seconds": 9.0},
        {"delay": 120.0},
        {"run_at": now + 3600.0},
        {"run_at": now - 60.0},
        {"key": "fresh", "delay": 30.0},
        {"key": "taken"},
        {"meta": {"sensitive": ["card"]}, "args_json": '{"card":"4242\\t\\\\x"}'},
        {"queue": "other", "max_attempts": 7},
    ]
    alone = [get(backend, backend.job_insert_many([request(**s)])[0].id) for s in specs[:4]]
    results = backend.job_insert_many([request(**s) for s in specs])
    assert [r.deduplicated for r in results] == [False] * 5 + [True] + [False] * 2
    assert results[5].id == existing.id
    fresh = [r.id for r in results if not r.deduplicated]
    assert fresh == sorted(fresh)  # ids ascend in request order
    rows = [get(backend, r.id) for r in results]
    for single, batched in zip(alone, rows[:4], strict=True):
        assert (batched.state, batched.priority, batched.timeout, batched.lease_seconds) == (
            single.state,
            single.priority,
            single.timeout,
            single.lease_seconds,
        )
        assert batched.run_at - batched.inserted_at == pytest.approx(
            single.run_at - single.inserted_at, abs=0.5
        )
    assert [r.state for r in rows] == [
        "available",
        "scheduled",
        "scheduled",
        "available",
        "scheduled",
        "available",
        "available",
        "available",
    ]
    assert rows[2].run_at == pytest.approx(now + 3600.0, abs=0.01)
    assert rows[4].idempotency_key == "fresh"
    assert json.loads(rows[6].meta) == {"sensitive": ["card"]}
    assert json.loads(rows[6].args) == {"card": "4242\t\\x"}
    assert (rows[7].queue, rows[7].max_attempts) == ("other", 7)


def test_a_batch_where_one_job_sets_a_field_stores_the_defaults_for_the_others(
    backend: Backend,
) -> None:
    """Fields that only some jobs of a batch set (PostgreSQL COPYs only the columns some
    job sets) land on those jobs; the others keep the defaults a batch of one gives."""
    parent = insert(backend)
    plain = [request(args_json=f'{{"n":{i}}}') for i in range(3)]
    special = replace(request(priority=4, timeout=1.5), parent_id=parent)
    results = backend.job_insert_many([plain[0], special, *plain[1:]])
    rows = [get(backend, r.id) for r in results]
    assert [(r.priority, r.timeout, r.parent_id) for r in rows] == [
        (0, None, None),
        (4, 1.5, parent),
        (0, None, None),
        (0, None, None),
    ]
    assert [json.loads(r.meta) for r in rows] == [{}] * 4
    assert [r.lease_seconds for r in rows] == [None] * 4
    assert [json.loads(r.args) for r in rows] == [{"n": 0}, {}, {"n": 1}, {"n": 2}]
