"""Rows no enqueue would write (DESIGN §5, §11): corrupted or mistyped JSON arguments, job
names no handler knows, payloads far over the size limit. Planted through the backend
(or raw SQL), each ends dead or retryable with a reason that says what is wrong, and the
worker keeps serving the good jobs around them. On SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import closing
from typing import Any

import pytest

import errands
from tests.conftest import running_worker

from .support import insert_raw, raw_request, wait_until

TERMINAL = {"completed", "dead", "discarded", "cancelled"}


@pytest.fixture(scope="module")
def app(store_url: str) -> Iterator[errands.App]:
    application = errands.App(store_url, lease=5)

    @application.job(name="rows.add", retries=0)
    def add(a: int, b: int = 0) -> int:
        return a + b

    @application.job(name="rows.text", retries=0, sensitive={"secret"})
    def text(body: str, secret: str = "") -> int:
        return len(body)

    @application.job(name="rows.items", retries=0)
    def items(values: list[dict[str, int]]) -> int:
        return len(values)

    application.migrate()
    yield application
    application.close()


def _run_until_settled(app: errands.App, ids: list[int], timeout: float = 30.0) -> dict[int, Any]:
    """Run a worker until every job in ``ids`` is terminal or has a recorded failure."""

    def settled() -> dict[int, Any] | None:
        jobs = {i: app.get_job(i) for i in ids}
        done = all(j.state.value in TERMINAL or j.errors for j in jobs.values())
        return jobs if done else None

    with running_worker(app, concurrency=4, poll_interval=0.02):
        return wait_until(settled, timeout, "every planted job to settle")


def _good_jobs(app: errands.App, n: int = 3) -> list[int]:
    add = app.registry["rows.add"]
    return [add.enqueue(a=i, b=1).id for i in range(n)]


WRONG_SHAPES = {
    "array": "[1, 2]",
    "string": '"a and b"',
    "null": "null",
    "number": "42",
    "missing_field": "{}",
    "wrong_type": '{"a": "one", "b": 2}',
    "unknown_field": '{"a": 1, "surprise": true}',
    "float_for_int": '{"a": 1.5}',
    "nested_object": '{"a": {"b": [1, {"c": null}]}}',
}
NOT_JSON = {  # only SQLite can hold these: PostgreSQL's jsonb refuses them at the door
    "truncated": '{"a": 1',
    "empty": "",
    "python_repr": "{'a': 1}",
    "trailing_garbage": '{"a": 1} DROP',
    "nan_literal": '{"a": NaN}',
    "binaryish": "\x01\x02\ufffd",
}


def test_rows_with_wrong_or_corrupted_json_args_die_at_once_naming_the_problem(
    app: errands.App,
) -> None:
    shapes = dict(WRONG_SHAPES)
    if app.url.startswith("sqlite"):
        shapes.update(NOT_JSON)
    planted = dict(
        zip(
            shapes,
            insert_raw(app, *(raw_request("rows.add", s, max_attempts=3) for s in shapes.values())),
            strict=True,
        )
    )
    good = _good_jobs(app)

    jobs = _run_until_settled(app, [*planted.values(), *good])

    for label, job_id in planted.items():
        job = jobs[job_id]
        assert job.state.value == "dead", (label, job.state, job.errors)
        assert job.attempt == 1, f"{label}: a payload that no longer validates must not retry"
        error = job.errors[-1]
        assert error.type == "InvalidPayload", (label, error)
        assert "rows.add: stored payload fails validation" in error.message, (label, error.message)
        assert "Traceback" not in error.message
    for job_id in good:
        assert jobs[job_id].state.value == "completed", jobs[job_id]


def test_a_row_naming_no_registered_job_is_never_claimed_and_charged_nothing(
    app: errands.App,
) -> None:
    """Rows naming job types the worker does not define (renamed long ago, miscased, with
    a trailing space, 200 characters) are never claimed: they keep attempt 0 and no error,
    while the worker settles the good jobs around them."""
    names = ["rows.renamed_long_ago", "Rows.Add", "rows.add ", "x" * 200]
    planted = insert_raw(app, *(raw_request(n, '{"a": 1}', max_attempts=5) for n in names))
    good = _good_jobs(app)

    jobs = _run_until_settled(app, good)

    for job_id in planted:
        job = app.get_job(job_id)
        assert (job.state.value, job.attempt, job.errors) == ("available", 0, []), job.name
    assert set(app.unrunnable_jobs()) == set(names)
    for job_id in good:
        assert jobs[job_id].state.value == "completed"


def test_rows_far_over_the_size_limit_are_settled_without_stopping_the_worker(
    app: errands.App,
) -> None:
    """The size limit guards enqueue; a row that got past it (an older errands, a manual
    insert) is still judged only by its content: valid ones run, broken ones die."""
    big = "é" * (app.max_payload_bytes * 2)  # 2 bytes each: 4x the limit
    nested = "[" * 3000 + "]" * 3000  # past any parser's recursion limit, Python's included
    valid, mistyped, deep, deep_secret = insert_raw(
        app,
        raw_request("rows.text", json.dumps({"body": big})),
        raw_request("rows.add", json.dumps({"a": big})),
        raw_request("rows.items", '{"values": ' + nested + "}"),
        raw_request("rows.text", '{"body": "b", "secret": ' + nested + "}", sensitive=["secret"]),
    )
    good = _good_jobs(app)

    jobs = _run_until_settled(app, [valid, mistyped, deep, deep_secret, *good])

    assert jobs[valid].state.value == "completed" and jobs[valid].result == len(big)
    for job_id in (mistyped, deep, deep_secret):
        assert jobs[job_id].state.value == "dead"
        assert jobs[job_id].errors[-1].type == "InvalidPayload"
        assert len(jobs[job_id].errors[-1].message) < 2000, "the reason quotes the whole payload"
    for job_id in good:
        assert jobs[job_id].state.value == "completed"


def test_a_stored_payload_corrupted_by_raw_sql_after_enqueue_dies_with_the_reason(
    app: errands.App,
) -> None:
    """Corruption after the fact (a bad migration, a manual UPDATE): same outcome, and the
    sensitive argument stays masked in what the job shows."""
    text_job = app.registry["rows.text"]
    handle = text_job.enqueue(body="hello", secret="s3cret-value", delay=3600)
    corrupted = '{"body": 17, "secret": "s3cret-value"}'
    if app.url.startswith("sqlite"):
        path = app.url.removeprefix("sqlite:///")
        with closing(sqlite3.connect(path)) as side:
            side.execute(
                "UPDATE errands_jobs SET args = ?, run_at = 0 WHERE id = ?", (corrupted, handle.id)
            )
            side.execute("UPDATE errands_jobs SET state = 'available' WHERE id = ?", (handle.id,))
            side.commit()
    else:
        import psycopg

        from tests.pg import pg_base_url

        schema = app.backend.schema  # type: ignore[attr-defined]
        with psycopg.connect(pg_base_url(), autocommit=True) as side:
            side.execute(
                f'UPDATE "{schema}".errands_jobs SET args = %s::jsonb, run_at = now(), '
                "state = 'available' WHERE id = %s",
                (corrupted, handle.id),
            )

    job = _run_until_settled(app, [handle.id])[handle.id]

    assert job.state.value == "dead"
    assert "body: Input should be a valid string" in job.errors[-1].message
    assert "s3cret-value" not in repr(job.errors)
    assert job.masked_args["secret"] == "***"
