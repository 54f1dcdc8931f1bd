"""``errands status --max-dead N --max-age S``: a probe for cron and Kubernetes that exits 3
with a one-line reason past a threshold and 0 otherwise (issue 6)."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner

import errands
from errands.cli.main import cli
from tests.integration.helpers import execute_sql, wait_until


def status(url: str, *args: str) -> Any:
    return CliRunner().invoke(cli, ["status", "--url", url, *args])


@pytest.fixture
def url(app: errands.App, db_url: str) -> str:
    app.migrate()
    return db_url


def test_max_dead_exits_3_with_a_clear_message_when_one_job_is_dead_and_0_when_none(
    app: errands.App, url: str, worker_factory: Any
) -> None:
    @app.job(name="st.broken", retries=0)
    def broken() -> None:
        raise errands.Permanent("bad input")

    @app.job(name="st.fine")
    def fine() -> None:
        pass

    fine.enqueue()
    with worker_factory():
        wait_until(lambda: app.queue_stats() and app.queue_stats()[0].counts.get("completed"))
    healthy = status(url, "--max-dead", "0")
    assert healthy.exit_code == 0, healthy.output
    assert "ALERT" not in healthy.output

    handle = broken.enqueue()
    with worker_factory():
        wait_until(lambda: handle.job().state.value == "dead", what="the job to die")
    alert = status(url, "--max-dead", "0")
    assert alert.exit_code == 3
    assert alert.stderr.strip().splitlines() == ["ALERT: 1 dead job(s) > --max-dead 0"]
    assert status(url, "--max-dead", "1").exit_code == 0  # at the threshold is fine

    app.discard([handle.id], reason="handled")
    assert status(url, "--max-dead", "0").exit_code == 0


def test_max_age_exits_3_when_the_oldest_available_job_waited_too_long(
    app: errands.App, url: str
) -> None:
    @app.job(name="st.waiting")
    def waiting() -> None:
        pass

    handle = waiting.enqueue()  # no worker runs: it waits
    assert status(url, "--max-age", "60").exit_code == 0
    execute_sql(app, "UPDATE errands_jobs SET run_at = run_at - 120 WHERE id = ?", (handle.id,))
    alert = status(url, "--max-age", "60", "--max-dead", "0")
    assert alert.exit_code == 3
    [line] = alert.stderr.strip().splitlines()
    assert line.startswith("ALERT: oldest available job waited 12")
    assert line.endswith("s > --max-age 60")
    assert status(url, "--json", "--max-age", "600").exit_code == 0
