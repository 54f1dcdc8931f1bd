"""A batch of completions is written by job_complete_many on PostgreSQL: the same write
as job_finish_many's for completions (four arrays instead of seven, none of a failure's
cases), chosen only where the two agree: every outcome a completion without an error,
outside workflows; the attempts of fair keys folded as job_finish_many folds them (its
variant without the fold where every job is known to have no fair key). Counted on the
client and read back from the rows; not timed."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import errands
from errands.backends.base import FinishParams
from errands.jobs import JobRow
from tests.conformance.support import claim, error, get, insert
from tests.conformance.test_fair import add_keyed, fair_queue, take
from tests.conformance.test_workflows import batch, callbacks

from .counting import messages, statements


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
    ran, no result) written by the lean statement and by the general one (a failure in
    its batch) give the same rows; run_at is left as it was, finished_at is set."""
    for _ in range(7):
        insert(backend)
    rows = claim(backend, limit=7)
    lean, general, failing = rows[:3], rows[3:6], rows[6]
    before = {r.id: get(backend, r.id) for r in rows}
    failed = FinishParams(failing.id, failing.lease_token or "", "dead", error=error())
    for jobs, others, expected in ((lean, [], LEAN), (general, [failed], GENERAL)):
        backend.job_cancel(jobs[1].id, "test")
        outcomes = [
            _done(jobs[0], '{"n": 1}'),
            _done(jobs[1], "2"),
            _done(jobs[2]),
            *others,
        ]
        answers, sent = _written_by(backend, outcomes)
        assert answers == [True] * len(outcomes)
        assert sent[0] == expected, sent
    # jobs known to have no fair key: the variant that touches no fairness table
    insert(backend)
    (plain,) = claim(backend, limit=1)
    _, whole = messages(lambda: backend.job_finish_many([_done(plain)]))
    assert whole and "errands_fair_usage" not in " ".join(whole), whole
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


def test_a_failure_in_the_batch_takes_the_general_statement(backend: Any) -> None:
    for _ in range(2):
        insert(backend)
    a, b = claim(backend, limit=2)
    failed = FinishParams(b.id, b.lease_token or "", "dead", error=error(), fair=False)
    answers, sent = _written_by(backend, [_done(a), failed])
    assert answers == [True, True]
    assert GENERAL in sent and LEAN not in sent, sent
    assert get(backend, a.id).state == "completed"
    assert get(backend, b.id).state == "dead"


@pytest.mark.parametrize("known", [True, None], ids=["fair key known", "fair key not known"])
def test_completions_of_fair_jobs_are_the_lean_statement_folding_as_the_general_one(
    backend: Any, known: bool | None
) -> None:
    """Completions of a fair queue's jobs (the worker knows they have a key, or does not
    know) take the lean statement, which folds each attempt into its key's usage as the
    general statement does: the handlers' seconds, the dwell from the due time."""
    queue = fair_queue(backend)
    lean_ids, general_ids = add_keyed(backend, queue, "lean", 2), add_keyed(backend, queue, "g", 2)
    with psycopg.connect(backend.config.conninfo, autocommit=True) as conn:  # due 30 s ago
        conn.execute(
            f"UPDATE \"{backend.schema}\".errands_jobs SET run_at = now() - interval '30 s' "
            "WHERE id = ANY(%s)",
            ([*lean_ids, *general_ids],),
        )
    rows = {r.id: r for r in take(backend, queue, 4)}
    lean = [_done(rows[i], "1", fair=known, ran=0.25) for i in lean_ids]
    answers, sent = _written_by(backend, lean)
    assert answers == [True, True] and sent[0] == LEAN, sent
    failed = FinishParams(
        rows[general_ids[1]].id, rows[general_ids[1]].lease_token or "", "dead",
        error=error(), fair=known, ran=0.25,
    )  # fmt: skip
    answers, sent = _written_by(
        backend, [_done(rows[general_ids[0]], "1", fair=known, ran=0.25), failed]
    )
    assert answers == [True, True] and GENERAL in sent, sent
    figures = {f.key: f for f in backend.fair_figures(queue)}
    for key in ("lean", "g"):
        assert figures[key].attempts == 2 and figures[key].running == 0
        assert figures[key].seconds_total == pytest.approx(0.5)
    # each attempt's dwell from the due time it had: 30 s before its claim
    assert figures["lean"].dwell_total == pytest.approx(60.0, abs=5.0)
    assert figures["g"].dwell_total == pytest.approx(60.0, abs=5.0)
    assert {get(backend, i).run_at for i in lean_ids} == {rows[i].run_at for i in lean_ids}


def test_a_workflow_member_completed_in_a_plain_batch_still_fans_in(backend: Any) -> None:
    """A member whose row did not say so (member=None) is left by the lean statement and
    written with its fan-in, like job_finish_many's plain statement leaves it."""
    backend.workflow_insert(batch(1))
    (member,) = claim(backend, limit=1)
    answers, _ = _written_by(backend, [_done(member, "1")])
    assert answers == [True]
    assert get(backend, member.id).state == "completed"
    assert callbacks(backend) == ["on_settled", "on_success"]
