"""A batch of plain completions is written by job_complete_many on PostgreSQL: the same
write as job_finish_many's for completions (three arrays instead of seven, none of a
failure's cases), chosen only where the two agree: every outcome a completion without an
error, of a job known to have no fair key, outside workflows. Counted on the client and
read back from the rows; not timed."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

import errands
from errands.backends.base import FinishParams
from errands.jobs import JobRow
from tests.conformance.support import claim, error, get, insert
from tests.conformance.test_workflows import batch, callbacks

from .counting import statements


@pytest.fixture
def backend(pg_url: str) -> Iterator[Any]:
    app = errands.App(pg_url)
    app.migrate()
    yield app.backend
    app.close()


def _done(row: JobRow, result: str | None = None, **fields: Any) -> FinishParams:
    fields.setdefault("fair", False)
    return FinishParams(row.id, row.lease_token or "", "completed", result_json=result, **fields)


LEAN = "job_complete_many: job_finish_many f"
GENERAL = "A cancel requested while the job ran"


def _written_by(backend: Any, outcomes: list[FinishParams]) -> tuple[list[bool], list[str]]:
    answers, sent = statements(lambda: backend.job_finish_many(outcomes))
    return answers, [s.removeprefix("-- ")[: len(LEAN)] for s in sent]


def _comparable(row: JobRow) -> dict[str, Any]:
    """A row's fields but its id and the times that differ between two jobs."""
    fields = dataclasses.asdict(row)
    for name in ("id", "inserted_at", "attempted_at", "finished_at", "run_at", "updated_at"):
        fields.pop(name, None)
    return fields


def test_a_batch_of_plain_completions_is_one_lean_statement_that_writes_the_same(
    backend: Any,
) -> None:
    """The same three completions (a result, a job whose cancel was requested while it
    ran, no result) written by the lean statement and by the general one give the same
    rows; run_at is left as it was, finished_at is set."""
    for _ in range(6):
        insert(backend)
    rows = claim(backend, limit=6)
    lean, general = rows[:3], rows[3:]
    before = {r.id: get(backend, r.id) for r in rows}
    for jobs, fair, expected in ((lean, False, LEAN), (general, None, GENERAL)):
        backend.job_cancel(jobs[1].id, "test")
        outcomes = [
            _done(jobs[0], '{"n": 1}', fair=fair),
            _done(jobs[1], "2", fair=fair),
            _done(jobs[2], fair=fair),
        ]
        answers, sent = _written_by(backend, outcomes)
        assert answers == [True, True, True]
        assert sent[0] == expected, sent
    for one, other in zip(lean, general, strict=True):
        written, also = get(backend, one.id), get(backend, other.id)
        assert _comparable(written) == _comparable(also)
        assert written.state == "completed" and written.finished_at is not None
        assert written.run_at == before[one.id].run_at
    assert get(backend, lean[1].id).cancel_requested


def test_a_stale_completion_is_refused(backend: Any) -> None:
    insert(backend)
    (row,) = claim(backend, limit=1)
    assert backend.job_finish_many(
        [FinishParams(row.id, "not-its-token", "completed", fair=False)]
    ) == [False]
    assert get(backend, row.id).state == "running"


@pytest.mark.parametrize(
    "odd_one",
    ["a failure", "a job whose fair key is not known", "a job with a fair key"],
)
def test_any_other_outcome_in_the_batch_takes_the_general_statement(
    backend: Any, odd_one: str
) -> None:
    for _ in range(2):
        insert(backend)
    a, b = claim(backend, limit=2)
    other = {
        "a failure": FinishParams(b.id, b.lease_token or "", "dead", error=error(), fair=False),
        "a job whose fair key is not known": _done(b, fair=None),
        "a job with a fair key": _done(b, fair=True),
    }[odd_one]
    answers, sent = _written_by(backend, [_done(a), other])
    assert answers == [True, True]
    assert GENERAL in sent and LEAN not in sent, sent
    assert get(backend, a.id).state == "completed"


def test_a_workflow_member_completed_in_a_plain_batch_still_fans_in(backend: Any) -> None:
    """A member whose row did not say so (member=None) is left by the lean statement and
    written with its fan-in, like job_finish_many's plain statement leaves it."""
    backend.workflow_insert(batch(1))
    (member,) = claim(backend, limit=1)
    answers, _ = _written_by(backend, [_done(member, "1")])
    assert answers == [True]
    assert get(backend, member.id).state == "completed"
    assert callbacks(backend) == ["on_settled", "on_success"]
