"""A workflow member's end costs a fixed handful of statements on PostgreSQL.

The fan-in runs in the transaction of the member's own terminal write. On PostgreSQL its
steps that follow one another without a decision in between are one statement each
(wf_leave_count: out of the pending set, the outcome, the workflow's counts;
wf_resolve_ready: the edges' outcomes and the dependents now ready), so a chain step's
finish is the member's write, the workflow's lock, those two, the release and its wake-up:
counted here on the client, not timed.
"""

from __future__ import annotations

from typing import Any

import errands
from errands.backends.base import ClaimParams, FinishParams, QueueClaim

from .counting import statements
from .harness import wait_until

# A chain step's finish with its fan-in: the member's write, the workflows' lock, the two
# fused statements, the release with its wake-up (9 before they were fused, counted alike;
# 6 while the wake-up was a statement of its own).
MOST = 5


CLAIM = ClaimParams([QueueClaim("default", 10)], 10, "w", 30.0)


def _finish_the_first(backend: Any) -> list[str]:
    """Claim the one job due, complete it; the statements its finish sent."""
    [row] = backend.job_claim(CLAIM)
    finish = FinishParams(row.id, row.lease_token or "", "completed", member=True)
    answers, sent = statements(lambda: backend.job_finish_many([finish]))
    assert answers == [True]
    return sent


def test_a_chain_steps_finish_and_fan_in_run_a_fixed_handful_of_statements(pg_url: str) -> None:
    app = errands.App(pg_url)

    @app.job(name="statements.step")
    def step(n: int) -> int:
        return n

    try:
        wf = errands.Workflow("chain")
        first = wf.add(step.bind(n=0))
        second = wf.add(step.bind(n=1), after=[first])
        wf.add(step.bind(n=2), after=[second])
        app.enqueue_workflow(wf)
        backend: Any = app.backend
        heard: list[str | None] = []
        notifier = backend.listener(heard.append)
        notifier.start()
        try:
            wait_until(lambda: notifier.self_test_passed is True, 10, "the LISTEN self-test")
            heard.clear()
            backend._last_notify.clear()  # the enqueue's NOTIFY may be within the window
            sent = _finish_the_first(backend)
            # The release's NOTIFY (in its statement) wakes the other workers.
            wait_until(lambda: "default" in heard, 5, "the release's notification")
        finally:
            notifier.stop()
        assert len(sent) <= MOST, sent
        [released] = backend.job_claim(CLAIM)  # the next step, and only it
        assert released.args == '{"n": 1}'
        assert backend.job_claim(CLAIM) == []
    finally:
        app.close()


# A batch's last member's finish: the member's write, the workflows' lock, the fused
# leave-and-count, the callback's keyed insert, the settling write (7 before the insert
# stopped releasing a key it had not found taken, and a lone workflow stopped looking up
# a parent it cannot have).
LAST_MEMBER_MOST = 5


def test_a_batchs_last_member_settles_it_and_inserts_its_callback_in_a_handful(
    pg_url: str,
) -> None:
    app = errands.App(pg_url)

    @app.job(name="statements.member")
    def member(n: int) -> int:
        return n

    @app.job(name="statements.done")
    def done() -> None: ...

    try:
        batch = errands.Batch("last", on_success=done.bind())
        batch.add(member.bind(n=0))
        handle = app.enqueue_workflow(batch)
        backend: Any = app.backend
        sent = _finish_the_first(backend)
        assert len(sent) <= LAST_MEMBER_MOST, sent
        [callback] = backend.job_claim(CLAIM)
        assert callback.name == "statements.done"
        assert handle.status().callbacks["on_success"] == callback.id
    finally:
        app.close()
