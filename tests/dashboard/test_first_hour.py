"""What a new user meets in the dashboard: one word for a queue's state, running and
finished jobs' times, workers presumed dead, clear pages for a database that cannot be
read and for a page that does not exist."""

from __future__ import annotations

import json
import re
import socket
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from starlette.testclient import TestClient

import errands
from errands.backends.base import ClaimParams, QueueClaim, WorkerInfo
from errands.cli.main import cli
from errands.dashboard import create_app

from .helpers import BASE_URL, EMAIL, PASSWORD, finish_due, login


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


def claim(app: errands.App, queue: str, worker: str = "w-runner") -> list[int]:
    """Claim every due job of ``queue`` for ``worker``, leaving them running."""
    rows = app.backend.job_claim(
        ClaimParams(
            queues=[QueueClaim(queue, 10)], limit=10, worker_id=worker, lease_seconds_default=30
        )
    )
    return [row.id for row in rows]


def register(
    app: errands.App,
    worker_id: str,
    queues: str,
    seconds_ago: float = 0.0,
    beat_seconds: float | None = None,
) -> None:
    app.backend.worker_register(
        WorkerInfo(
            id=worker_id, host="h1", pid=42, queues=queues, concurrency=4, version="x",
            beat_seconds=beat_seconds,
        )
    )  # fmt: skip
    if seconds_ago:
        with closing(sqlite3.connect(app.url.removeprefix("sqlite:///"))) as conn, conn:
            conn.execute(
                "UPDATE errands_workers SET heartbeat_at = heartbeat_at - ? WHERE id = ?",
                (seconds_ago, worker_id),
            )


def test_a_running_job_shows_its_start_time_runtime_and_worker(
    app: errands.App, jobs: dict[str, Any], client: TestClient
) -> None:
    handle = jobs["charge"].enqueue(order_id=1)
    assert claim(app, "payments") == [handle.id]
    listing = client.get("/jobs").text
    cell = re.search(r'<td class="when run">(.*?)</td>', listing, re.S)
    assert cell is not None
    assert "started just now" in cell.group(1) or "started 1" in cell.group(1)
    assert "running " in cell.group(1)
    assert re.search(r"on <code[^>]*>w-runner</code>", cell.group(1))
    detail = client.get(f"/jobs/{handle.id}").text
    assert "<dt>started</dt>" in detail and "<dt>running for</dt>" in detail
    assert "<code>w-runner</code>" in detail


def test_a_finished_job_shows_how_long_it_took(
    app: errands.App, jobs: dict[str, Any], client: TestClient
) -> None:
    handle = jobs["charge"].enqueue(order_id=2)
    finish_due(app, "payments", "completed")
    listing = client.get("/jobs").text
    assert re.search(r'<td class="when run">.*? · took \d+ ms</td>', listing, re.S), listing
    assert "<dt>took</dt>" in client.get(f"/jobs/{handle.id}").text


def test_a_worker_that_missed_its_heartbeats_is_shown_last_seen_and_presumed_dead(
    app: errands.App, jobs: dict[str, Any], client: TestClient
) -> None:
    register(app, "w-alive", "emails")
    register(app, "w-gone", "payments", seconds_ago=3 * app.lease / 3 + 60)
    html = client.get("/workers").text
    assert "1 live" in html
    gone = html[html.index("w-gone") :].split("</tr>", 1)[0]
    assert re.search(r"last seen 1 min( \d+ s)? ago, presumed dead", gone), gone
    alive = html[html.index("w-alive") :].split("</tr>", 1)[0]
    assert "presumed dead" not in alive and ">live<" in alive
    overview = client.get("/").text
    assert re.search(r'<span class="n">1</span><span class="label">workers</span>', overview)


def test_a_worker_with_a_longer_lease_than_the_dashboards_is_live_between_its_beats(
    app: errands.App, jobs: dict[str, Any], client: TestClient
) -> None:
    """Its app's lease is 300 s (a beat every 100 s); the dashboard's is the default: by
    its own lease it called the worker dead 32 s after a beat, and its queue unserved."""
    jobs["charge"].enqueue(order_id=4)
    register(app, "w-long", "payments", seconds_ago=60, beat_seconds=100.0)
    html = client.get("/workers").text
    row = html[html.index("w-long") :].split("</tr>", 1)[0]
    assert "presumed dead" not in row and ">live<" in row and "every 1 min 40 s" in row
    queues = client.get("/queues").text
    assert "no live worker" not in queues[queues.index(">payments</a>") :].split("</tr>", 1)[0]


def test_the_queues_page_marks_a_queue_no_live_worker_serves(
    app: errands.App, jobs: dict[str, Any], client: TestClient
) -> None:
    jobs["charge"].enqueue(order_id=3)
    jobs["send_welcome"].enqueue(user_id=1, email=EMAIL)
    register(app, "w-mail", "emails=2")
    register(app, "w-gone", "payments", seconds_ago=600)
    html = client.get("/queues").text
    payments = html[html.index(">payments</a>") :].split("</tr>", 1)[0]
    emails = html[html.index(">emails</a>") :].split("</tr>", 1)[0]
    assert "no live worker" in payments
    assert "1 live" in emails and "no live worker" not in emails


@pytest.mark.parametrize(
    ("url", "heading", "fix"),
    [
        (
            "{pg}",  # a fresh PostgreSQL schema: not migrated (auto_migrate is off there)
            "The database has no errands schema, or an outdated one",
            "Run `errands migrate --url postgresql://",
        ),
        (
            "sqlite:///{tmp}/no-such-folder/shop.db",
            "The database cannot be reached",
            "Check that the database server is running",
        ),
        (
            "postgresql://bob:s3cret@127.0.0.1:{port}/shop?connect_timeout=2",
            "The database cannot be reached",
            "the URL is right: postgresql://bob:***@127.0.0.1",
        ),
    ],
    ids=["no-schema", "missing-folder", "postgres-unreachable"],
)
def test_a_database_that_cannot_be_read_shows_what_is_wrong_and_how_to_fix_it(
    tmp_path: Path, url: str, heading: str, fix: str, request: pytest.FixtureRequest
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed once the block ends: nothing listens there
    pg = ""
    if "{pg}" in url:  # the fresh schema, without the tests' own auto_migrate=true
        pg = str(request.getfixturevalue("new_pg_url")).replace(
            "auto_migrate=true", "auto_migrate=false"
        )
    store = errands.App(url.format(tmp=tmp_path, port=port, pg=pg))
    with TestClient(
        create_app(store, password=PASSWORD), base_url=BASE_URL, client=("127.0.0.1", 1)
    ) as test_client:
        login(test_client)
        for path in ("/", "/jobs", "/queues", "/workers"):
            response = test_client.get(path)
            assert response.status_code == 503, (path, response.text)
            html = response.text
            assert f"<h1>{heading}</h1>" in html
            assert fix in html.replace("&#39;", "'")
            assert 'href="/jobs"' in html  # the navigation is there
            assert "s3cret" not in html
    store.close()


def test_an_unknown_path_shows_a_404_page_with_the_navigation(client: TestClient) -> None:
    response = client.get("/no-such-page")
    assert response.status_code == 404
    assert "<h1>Page not found</h1>" in response.text
    for path in ("/jobs", "/dlq", "/queues", "/workers", "/cron", "/audit"):
        assert f'href="{path}"' in response.text
    missing_job = client.get("/jobs/999999")
    assert missing_job.status_code == 404
    assert 'href="/queues"' in missing_job.text


def test_a_404_asks_for_a_login_first(make_client: Any) -> None:
    response = make_client(signed_in=False).get("/no-such-page", follow_redirects=False)
    assert response.status_code == 303
    assert response.headers["location"].startswith("/login")


def test_a_database_migrated_by_a_newer_errands_is_shown_as_it_is(tmp_path: Path) -> None:
    """A dashboard of the previous release during a rolling deploy: the schema is newer
    than it knows, and it serves its pages (as a worker of that release runs, warning)
    rather than an error page telling the operator to run a migrate it would refuse."""
    url = f"sqlite:///{tmp_path}/newer.db"
    errands.App(url).migrate()
    with closing(sqlite3.connect(tmp_path / "newer.db")) as newer:
        newer.execute("INSERT INTO errands_migrations VALUES (999, 'from_a_newer_errands', 0)")
        newer.commit()
    store = errands.App(url)
    with TestClient(
        create_app(store, password=PASSWORD), base_url=BASE_URL, client=("127.0.0.1", 1)
    ) as test_client:
        login(test_client)
        for path in ("/", "/jobs", "/queues", "/workers"):
            assert test_client.get(path).status_code == 200, path
    store.close()
