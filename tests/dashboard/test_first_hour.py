"""What a new user meets in the dashboard: one word for a queue's state, running and
finished jobs' times, workers presumed dead, clear pages for a database that cannot be
read and for a page that does not exist."""

from __future__ import annotations

import json
from typing import Any

from click.testing import CliRunner
from starlette.testclient import TestClient

import errands
from errands.cli.main import cli


def test_a_queue_that_is_not_paused_is_called_active_in_the_cli_and_the_dashboard(
    app: errands.App, jobs: dict[str, Any], client: TestClient
) -> None:
    jobs["charge"].enqueue(order_id=1)
    app.pause("emails")
    listing = CliRunner().invoke(cli, ["queues", "--url", app.url, "--json"])
    states = {row["queue"]: row["state"] for row in json.loads(listing.output)}
    assert states["payments"] == "active" and states["emails"] == "paused"
    html = client.get("/queues").text
    assert '<span class="badge active">active</span>' in html
    assert '<span class="badge paused">paused</span>' in html
    assert "badge running" not in html
