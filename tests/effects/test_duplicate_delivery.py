"""The duplicate-delivery mode finds handlers that are not idempotent.

Written only against the public testing API (``errands.testing.Tester`` through the
``errands_testing`` fixture, ``drain_duplicated``, the report), on SQLite and PostgreSQL.
The "recorded effects" are the rows of a ``sent`` table, snapshotted by the test.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from effects_store import EffectsStore

import errands
from errands.testing import Tester

Make = Callable[..., Any]


@pytest.fixture
def mail_app(make_app: Make, effects: EffectsStore, store_url: str) -> errands.App:
    """Four welcome-mail handlers, one effect each: a row in ``sent``."""
    effects.execute(
        "CREATE TABLE IF NOT EXISTS sent (handler TEXT NOT NULL, user_id INTEGER NOT NULL)"
    )
    table = EffectsStore.qualified(store_url, "sent")
    sql = f"INSERT INTO {table} (handler, user_id) VALUES (%s, %s)"
    app = make_app()

    def send(handler: str, user_id: int) -> None:  # the mail provider, its own connection
        effects.execute("INSERT INTO sent (handler, user_id) VALUES (%s, %s)", (handler, user_id))

    def sent_before(handler: str, user_id: int) -> bool:
        return bool(
            effects.execute(
                "SELECT 1 FROM sent WHERE handler = %s AND user_id = %s", (handler, user_id)
            )
        )

    @app.job(name="plain", retries=2)
    def plain(user_id: int) -> None:
        """Not idempotent: every delivery sends again."""
        send("plain", user_id)

    @app.job(name="stepped", retries=2)
    def stepped(ctx: errands.Context, user_id: int) -> None:
        """Idempotent: the send is a durable step."""
        ctx.step("send", send, "stepped", user_id)

    @app.job(name="transactional", retries=2)
    def transactional(ctx: errands.Context, user_id: int) -> None:
        """Idempotent: the effect row commits with the completion (an outbox)."""
        conn = ctx.transaction()
        params = ("transactional", user_id)
        conn.execute(sql.replace("%s", "?") if effects.sqlite else sql, params)

    @app.job(name="check_then_act", retries=2)
    def check_then_act(ctx: errands.Context, user_id: int) -> None:
        """Looks idempotent but is not: it sends outside the store, then records "sent" in
        the completion transaction — a crash in between forgets the record, not the mail."""
        if not sent_before("check_then_act:mark", user_id):
            send("check_then_act", user_id)
            conn = ctx.transaction()
            params = ("check_then_act:mark", user_id)
            conn.execute(sql.replace("%s", "?") if effects.sqlite else sql, params)

    return app


def _snapshot(effects: EffectsStore) -> Callable[[], list[tuple[Any, ...]]]:
    return lambda: sorted(effects.execute("SELECT handler, user_id FROM sent"))


def test_duplicate_delivery_reports_the_non_idempotent_handler_only(
    mail_app: errands.App,
    effects: EffectsStore,
    errands_testing: Callable[..., Tester],
) -> None:
    tester = errands_testing(mail_app)
    for name in ("plain", "stepped", "transactional", "check_then_act"):
        mail_app.registry[name].enqueue(user_id=1)

    report = tester.drain_duplicated(_snapshot(effects))

    assert report.non_idempotent == ["plain"]
    assert len(report.checked) == 4
    [difference] = report.differences
    assert difference.variant == "duplicate"
    assert difference.before.count(("plain", 1)) == 1
    assert difference.after.count(("plain", 1)) == 2
    with pytest.raises(AssertionError, match="not idempotent under duplicate delivery: plain"):
        report.assert_idempotent()
    assert report.drain.completed == 4  # every job still completed once


def test_crash_after_the_side_effect_then_again_also_catches_check_then_act(
    mail_app: errands.App,
    effects: EffectsStore,
    errands_testing: Callable[..., Tester],
) -> None:
    tester = errands_testing(mail_app)
    for name in ("plain", "stepped", "transactional", "check_then_act"):
        mail_app.registry[name].enqueue(user_id=2)

    report = tester.drain_duplicated(_snapshot(effects), crash=True)

    assert report.non_idempotent == ["check_then_act", "plain"]
    assert report.drain.crashed == 4  # each job's first returning attempt, crashed
    assert report.drain.completed == 4  # then rescued and completed
    snapshot = _snapshot(effects)()
    assert snapshot.count(("stepped", 2)) == 1
    assert snapshot.count(("transactional", 2)) == 1


def test_an_idempotent_app_passes_both_variants(
    mail_app: errands.App,
    effects: EffectsStore,
    errands_testing: Callable[..., Tester],
) -> None:
    tester = errands_testing(mail_app)
    for user_id in (3, 4):
        mail_app.registry["stepped"].enqueue(user_id=user_id)
        mail_app.registry["transactional"].enqueue(user_id=user_id)

    tester.drain_duplicated(_snapshot(effects)).assert_idempotent()

    for user_id in (5, 6):
        mail_app.registry["stepped"].enqueue(user_id=user_id)
        mail_app.registry["transactional"].enqueue(user_id=user_id)
    report = tester.drain_duplicated(_snapshot(effects), crash=True)
    report.assert_idempotent()
    assert report.ok and len(report.checked) == 4
    rows = _snapshot(effects)()
    assert all(rows.count(row) == 1 for row in rows)
