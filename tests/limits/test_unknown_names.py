"""A mistyped queue or job name: filters that match nothing suggest the close names, and a
queue nobody uses is not paused (and listed) for ever; ``queues forget`` removes one."""

from __future__ import annotations

import pytest

import errands
from errands.errors import InvalidTransition
from errands.suggest import close_names

from .helpers import run_cli


def define(store: errands.App) -> None:
    @store.job(name="shop.charge_order", queue="payments")
    def charge_order(order_id: int) -> None: ...

    @store.job(name="shop.send_receipt", queue="emails")
    def send_receipt(order_id: int) -> None: ...

    charge_order.enqueue(order_id=1)
    send_receipt.enqueue(order_id=1)


def test_close_names_find_the_name_under_its_module_prefix_and_near_spellings() -> None:
    names = ["shop.charge_order", "shop.send_receipt", "emails", "payments"]
    assert close_names("charge_order", names) == ["shop.charge_order"]
    assert close_names("email", names) == ["emails"]
    assert close_names("paymnets", names) == ["payments"]
    assert close_names("zzz", names) == []


def test_a_jobs_list_filter_that_matches_nothing_suggests_the_close_names(
    store: errands.App,
) -> None:
    define(store)
    store.registry.clear()  # the CLI without -A: names come from the store itself
    by_name = run_cli("jobs", "list", "--url", store.url, "--name", "charge_order")
    by_queue = run_cli("jobs", "list", "--url", store.url, "--queue", "email")
    dead = run_cli("dlq", "list", "--url", store.url, "--name", "charge_order")
    real_but_empty = run_cli(
        "jobs", "list", "--url", store.url, "--queue", "emails", "--state", "dead"
    )

    assert by_name.output.strip() == (
        "no matching jobs; no job name 'charge_order' (did you mean shop.charge_order?)"
    )
    assert by_queue.output.strip() == "no matching jobs; no queue 'email' (did you mean emails?)"
    assert "(did you mean shop.charge_order?)" in dead.output
    assert real_but_empty.output.strip() == "no matching jobs"  # a real queue: no hint


def test_a_replay_filter_that_matches_nothing_warns_with_the_close_names(
    store: errands.App,
) -> None:
    define(store)
    result = run_cli("dlq", "replay", "--all", "--queue", "paymnets", "--url", store.url)
    assert result.exit_code == 0, result.output
    assert "warning: nothing matched; no queue 'paymnets' (did you mean payments?)" in (
        result.output
    )


def test_pausing_a_queue_nobody_uses_is_refused_naming_the_close_ones(store: errands.App) -> None:
    define(store)
    refused = run_cli("queues", "pause", "email", "--url", store.url)
    assert refused.exit_code == 1
    assert "error: cannot pause: no queue 'email' (did you mean emails?)" in refused.output
    assert "--force" in refused.output
    assert [s.name for s in store.queue_settings()] == []  # nothing stored

    with pytest.raises(errands.ConfigurationError, match="did you mean emails"):
        store.pause("email")
    forced = run_cli("queues", "pause", "newqueue", "--force", "--url", store.url)
    assert forced.exit_code == 0, forced.output
    assert [s.name for s in store.queue_settings()] == ["newqueue"]


def test_queues_forget_removes_a_paused_queue_so_it_is_no_longer_listed(
    store: errands.App,
) -> None:
    define(store)
    store.pause("typo", force=True)
    listed = run_cli("queues", "--url", store.url)
    forgotten = run_cli("queues", "forget", "typo", "--url", store.url, "--actor", "ops:eve")
    again = run_cli("queues", "forget", "typo", "--url", store.url)
    after = run_cli("queues", "--url", store.url)

    assert "typo" in listed.output
    assert forgotten.output.strip() == "queue typo: forgotten (its stored settings are deleted)"
    assert again.output.strip() == "queue typo: nothing stored, nothing to forget"
    assert "typo" not in after.output
    last = store.audit()[0]
    assert (last.action, last.actor, last.detail) == (
        "forget",
        "ops:eve",
        {"queue": "typo"},
    )


def test_forgetting_a_queue_with_waiting_jobs_is_refused(store: errands.App) -> None:
    define(store)
    store.pause("emails")
    with pytest.raises(InvalidTransition, match=r"queue 'emails' still has jobs \(1 available\)"):
        store.forget_queue("emails")
    refused = run_cli("queues", "forget", "emails", "--url", store.url)
    assert refused.exit_code == 1
    assert [s.name for s in store.queue_settings()] == ["emails"]


def test_forgetting_a_queue_whose_only_jobs_wait_is_refused(store: errands.App) -> None:
    """A workflow's dependent waits for its parent (state ``waiting``, as a job waiting
    for a signal): the check and the delete counted pending and running jobs only, so a
    paused queue with only such jobs was forgotten, and resumed under them."""
    define(store)
    store.cancel(store.jobs(queue="emails")[0].id)
    wf = errands.Workflow("order-1")
    charged = wf.add(store.registry["shop.charge_order"].bind(order_id=2))
    wf.add(store.registry["shop.send_receipt"].bind(order_id=2), after=[charged])
    store.enqueue_workflow(wf)
    assert [j.state.value for j in store.jobs(queue="emails", state="waiting")] == ["waiting"]
    store.pause("emails")
    with pytest.raises(InvalidTransition, match=r"queue 'emails' still has jobs \(1 waiting\)"):
        store.forget_queue("emails")
    assert not store.backend.queue_forget("emails", "test")  # the delete's own check
    assert [(s.name, s.paused) for s in store.queue_settings()] == [("emails", True)]


def test_a_job_enqueued_after_the_check_still_keeps_the_queues_settings(
    store: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check and the delete were two steps: a job enqueued between them went on in a
    queue whose paused flag was just deleted (it ran). The delete checks again now."""
    define(store)
    store.pause("emails")
    store.cancel(store.jobs(queue="emails")[0].id)  # the queue is empty: the check passes
    real = store.backend.queue_forget

    def enqueue_first(name: str, actor: str) -> bool:
        store.registry["shop.send_receipt"].enqueue(order_id=2)  # between the two
        return real(name, actor)

    monkeypatch.setattr(store.backend, "queue_forget", enqueue_first)
    with pytest.raises(InvalidTransition, match="got jobs while it was being forgotten"):
        store.forget_queue("emails")
    assert [(s.name, s.paused) for s in store.queue_settings()] == [("emails", True)]
