"""The worker processes' app for tests/limits: a queue limited cluster-wide to 2, two
queues for per-worker limits (``-q emails=3,payments=1``), a fair queue, slow jobs for ``--pool
process`` timeouts and cancels, and a job with every policy option.

Every handler records its start and its end in the acceptance harness's effects file
(``acc_support.record``), so the test computes overlaps from what the handlers saw. The
store comes from ``ERRANDS_URL``.
"""

from __future__ import annotations

import time

from acc_support import record

import errands

app = errands.App(lease=5.0)
app.queue("capped", limit=2)


def _run(ctx: errands.Context, seconds: float) -> None:
    record(ctx, "start")
    time.sleep(seconds)
    record(ctx, "end")


@app.job(name="capped.work", queue="capped", retries=0)
def capped_work(ctx: errands.Context, seconds: float) -> None:
    _run(ctx, seconds)


@app.job(name="emails.send", queue="emails", retries=0)
def send_email(ctx: errands.Context, seconds: float) -> None:
    _run(ctx, seconds)


@app.job(name="payments.charge", queue="payments", retries=0)
def charge(ctx: errands.Context, seconds: float) -> None:
    _run(ctx, seconds)


@app.job(name="slow.timed", queue="slow", retries=0, timeout=1)
def slow_timed(ctx: errands.Context, seconds: float) -> None:
    """Runs past its 1 s timeout (a blocking sleep that never looks at ctx.cancelled)."""
    _run(ctx, seconds)


@app.job(name="slow.untimed", queue="slow", retries=3, backoff=0.1)
def slow_untimed(ctx: errands.Context, seconds: float) -> None:
    _run(ctx, seconds)


class CardDeclined(Exception):
    pass


app.queue("billing", limit=5, rate="100/m")


@app.job(
    name="billing.charge",
    queue="billing",
    priority=3,
    retries=2,
    timeout=30,
    lease=10,
    permanent=(CardDeclined,),
    sensitive={"card"},
    concurrency_key="account:{account_id}",
    rate="20/s",
)
def charge_card(account_id: int, card: str) -> None:
    """``errands jobs policy billing.charge`` shows all of these options."""


app.queue("tenants", fair=True)


@app.job(name="tenants.work", queue="tenants", retries=2, fair_key="tenant:{tenant}")
def tenants_work(ctx: errands.Context, tenant: str, seconds: float) -> None:
    """A fair queue's job (tests/limits/test_fairness.py: a rescued job on the lane)."""
    _run(ctx, seconds)
