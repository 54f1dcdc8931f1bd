"""``errands jobs policy NAME``: a job type's effective policy (item 10).

The policy comes from the code (the app module), merged with the app's defaults: queue,
retries and their delays, timeout, lease, limits, retention.
"""

from __future__ import annotations

from pathlib import Path

from .helpers import LimitsCluster


def test_jobs_policy_prints_the_effective_policy_as_text_and_json(tmp_path: Path) -> None:
    cluster = LimitsCluster(tmp_path, f"sqlite:///{tmp_path}/errands.db")
    try:
        cluster.app("limits_app").backend.schema_check()  # admin commands need a store
        text = cluster.cli("jobs", "policy", "billing.charge", "-A", "limits_app:app")
        as_json = cluster.cli("jobs", "policy", "billing.charge", "-A", "limits_app:app", "--json")
        unknown = cluster.cli("jobs", "policy", "billing.refund", "-A", "limits_app:app")
    finally:
        cluster.stop_all()

    assert text.code == 0, text
    shown = dict(line.split(None, 1) for line in text.stdout.splitlines())
    assert shown == {
        "name": "billing.charge",
        "queue": "billing",
        "priority": "3",
        "attempts": "3",
        "retry_delays": "2s ±25%, 4s ±25%",
        "permanent": "CardDeclined",
        "timeout": "30.0",
        "lease": "10.0",
        "sensitive": "card",
        "concurrency_key": "account:{account_id}",
        "concurrency_limit": "1",
        "rate": "20/s",
        "queue_limit": "5",
        "queue_rate": "100/m",
        "unique_for": "-",
        "retention": "604800.0",
        "poison_after": "3",
    }

    assert as_json.code == 0, as_json
    policy = as_json.json()
    assert policy["retry_delays"] == ["2s ±25%", "4s ±25%"]
    assert (policy["timeout"], policy["lease"], policy["unique_for"]) == (30.0, 10.0, None)
    assert (policy["queue_limit"], policy["queue_rate"], policy["rate"]) == (5, "100/m", "20/s")
    assert policy["permanent"] == ["CardDeclined"]

    assert unknown.code == 2
    assert "no job named 'billing.refund'; known: billing.charge, capped.work" in unknown.stderr


def test_jobs_policy_json_gives_null_for_a_rate_that_is_not_set(tmp_path: Path) -> None:
    cluster = LimitsCluster(tmp_path, f"sqlite:///{tmp_path}/errands.db")
    try:
        cluster.app("limits_app").backend.schema_check()
        as_json = cluster.cli("jobs", "policy", "capped.work", "-A", "limits_app:app", "--json")
        text = cluster.cli("jobs", "policy", "capped.work", "-A", "limits_app:app")
    finally:
        cluster.stop_all()
    assert as_json.code == 0, as_json
    policy = as_json.json()
    assert (policy["rate"], policy["queue_rate"]) == (None, None)
    assert "rate               -" in text.stdout.splitlines()
