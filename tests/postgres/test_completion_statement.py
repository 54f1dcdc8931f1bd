"""A batch of plain completions is written by job_complete_many on PostgreSQL: the same
write as job_finish_many's for completions (three arrays instead of seven, none of a
failure's cases), chosen only where the two agree: every outcome a completion without an
error, of a job known to have no fair key, outside workflows. Counted on the client and
read back from the rows; not timed."""

from __future__ import annotations

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


def _written_by(backend: Any, outcomes: list[FinishParams]) -> tuple[list[bool], list[str]]:
    answers, sent = statements(lambda: backend.job_finish_many(outcomes))
    return answers, [s.removeprefix("-- ").split(":")[0][:40] for s in sent]


def test_a_batch_of_plain_completions_is_one_lean_statement_that_writes_the_same(
    backend: Any,
) -> None:
    """Results stored, finished, lease cleared; a job whose cancel was requested while it
    ran still completes; a stale token is refused."""
    for _ in range(4):
        insert(backend)
    a, b, c, stale = claim(backend, limit=4)
    backend.job_cancel(b.id, "test")
    answers, sent = _written_by(backend, [_done(a, '{"n": 1}'), _done(b, "2"), _done(c)])
    assert answers == [True, True, True]
    assert sent == ["job_finish_many for a batch of completio"]
    stale_outcome = FinishParams(stale.id, "not-its-token", "completed", fair=False)
    assert backend.job_finish_many([stale_outcome]) == [False]
    for row, result in ((a, '{"n": 1}'), (b, "2"), (c, None)):
        stored = get(backend, row.id)
        assert (stored.state, stored.result) == ("completed", result)  # JSON as stored
        assert stored.finished_at is not None and stored.lease_token is None
    assert get(backend, stale.id).state == "running"


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
    assert not any(s.startswith("job_finish_many for a batch") for s in sent), sent
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
