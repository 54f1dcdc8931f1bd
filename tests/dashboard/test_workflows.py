"""The dashboard's workflow pages: the list with counts, and a workflow drawn as a graph
of its members with their states, linked to their jobs and callbacks."""

from __future__ import annotations

import re
from typing import Any

from starlette.testclient import TestClient

import errands

from .helpers import finish_due


def test_the_workflow_pages_list_workflows_and_draw_one_with_its_members_states(
    app: errands.App, jobs: dict[str, Any], client: TestClient
) -> None:
    charge = jobs["charge"]
    wf = errands.Workflow("checkout-7", on_settled=charge.bind(order_id=99))
    first = wf.add(charge.bind(order_id=1), name="charge")
    wf.add(charge.bind(order_id=2), after=[first], name="ship")
    handle = app.enqueue_workflow(wf)
    batch = errands.Batch("album")
    batch.add(charge.bind(order_id=3))
    app.enqueue_workflow(batch)
    finish_due(app, "payments", "dead", limit=1)  # the first member: its dependent is cancelled

    listing = client.get("/workflows").text
    assert "checkout-7" in listing and "album" in listing
    assert f'href="/workflows/{handle.id}"' in listing
    assert "checkout-7" in client.get("/workflows?state=failed").text
    assert "album" not in client.get("/workflows?state=failed").text

    page = client.get(f"/workflows/{handle.id}").text
    assert re.search(r'<rect class="node s-dead"', page)
    assert re.search(r'<rect class="node s-cancelled"', page)
    assert '<line class="edge failed"' in page
    callback = handle.status().callbacks["on_settled"]
    assert callback is not None and f'href="/jobs/{callback}">job {callback}</a>' in page
    assert client.get("/workflows/999").status_code == 404
