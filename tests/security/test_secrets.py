"""Secrets never leave the places they must be (DESIGN §4, §9; issue 10 item 4): a job
whose handler fails quoting its ``sensitive=`` arguments (a password, and a token nested
in a dict) never shows them in log lines (text or JSON, in process and from the real
``errands worker --log-format json``), in the stored error and traceback, in the CLI
(``jobs show``, ``--json``) or on the dashboard; and a database password in the URL is
never printed, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

import errands
from errands.dashboard import create_app
from errands.observability.logcontext import JsonFormatter, TextFormatter, install_record_factory
from tests.conftest import running_worker
from tests.dashboard.helpers import BASE_URL, login
from tests.fuzz.support import cli_env, run_cli_many, wait_until

PASSWORD = "pw-Correct-Horse-7731"
TOKEN = "tok-live-9f8e7d6c5b4a"
DB_PASSWORD = "db-Secret-4412"  # PostgreSQL here trusts every login: any password connects
SECRETS = (PASSWORD, TOKEN, DB_PASSWORD)


def _leaks(text: str) -> list[str]:
    return [s for s in SECRETS if s in text]


class Collect(logging.Handler):
    """Every record errands logs, formatted as JSON and as text."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.json, self.text = JsonFormatter(), TextFormatter()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines += [self.json.format(record), self.text.format(record)]


@pytest.fixture(scope="module")
def failed(store_url: str) -> Iterator[tuple[errands.App, int, list[str]]]:
    """A login job that died quoting its secrets, run by an in-process worker whose every
    log record was captured; on PostgreSQL the URL carries a password too."""
    url = store_url.replace("postgres@", f"postgres:{DB_PASSWORD}@", 1)
    assert url.startswith("sqlite") or DB_PASSWORD in url
    import fuzz_app

    app = fuzz_app.app
    app.close()
    app.url = url
    install_record_factory()
    collect = Collect()
    root = logging.getLogger()
    saved_level = root.level
    root.addHandler(collect)
    root.setLevel(logging.DEBUG)
    try:
        handle = fuzz_app.login.enqueue(
            user="alice", password=PASSWORD, credentials={"token": TOKEN, "scopes": ["read"]}
        )
        with running_worker(app):
            wait_until(lambda: app.get_job(handle.id).state.value == "dead", 20, "the job to die")
    finally:
        root.removeHandler(collect)
        root.setLevel(saved_level)
    yield app, handle.id, collect.lines
    app.close()


def test_log_lines_never_carry_sensitive_arguments_or_the_database_password(
    failed: tuple[errands.App, int, list[str]],
) -> None:
    _, _, lines = failed
    assert any("dead after 1 attempt" in line for line in lines), "the death was not logged"
    assert any("started fuzz.login(" in line and "password='***'" in line for line in lines)
    assert [line for line in lines if _leaks(line)] == []


def test_the_stored_error_and_traceback_have_every_secret_scrubbed(
    failed: tuple[errands.App, int, list[str]],
) -> None:
    app, job_id, _ = failed
    job = app.get_job(job_id)
    error = job.errors[-1]
    assert error.type == "ConnectionError"
    assert error.message == "login refused for alice with password *** and token ***"
    assert not _leaks(error.traceback or "")
    assert job.masked_args == {"user": "alice", "password": "***", "credentials": "***"}


def test_the_cli_shows_the_job_without_its_secrets(
    failed: tuple[errands.App, int, list[str]], tmp_path: Path
) -> None:
    app, job_id, _ = failed
    _cli_shows_without_secrets(app, job_id, "dlq", "login refused for alice", tmp_path)


def _cli_shows_without_secrets(
    app: errands.App, job_id: int, group: str, expected: str, tmp_path: Path
) -> dict[str, Any]:
    """``show``, ``show --json`` and ``jobs list --json`` all exit 0, show ``expected``
    and none of the secrets."""
    commands = {
        "show": ["jobs", "show", str(job_id)],
        "show-json": [group, "show", str(job_id), "--json"],
        "list-json": ["jobs", "list", "--json"],
    }
    results = run_cli_many(commands, cli_env(app.url), tmp_path)
    for result in results.values():
        assert result.code == 0, result
        assert expected in result.stdout, result
        assert _leaks(result.output) == [], result
    return results


@pytest.fixture(scope="module")
def succeeded(
    failed: tuple[errands.App, int, list[str]],
) -> tuple[errands.App, int]:
    """A sign-in job that completed, returning and checkpointing its secrets."""
    import fuzz_app

    app = failed[0]
    handle = fuzz_app.sign_in.enqueue(user="bob", password=PASSWORD, credentials={"token": TOKEN})
    with running_worker(app):
        wait_until(lambda: app.get_job(handle.id).state.value == "completed", 20, "completion")
    return app, handle.id


def test_the_cli_shows_results_and_steps_without_the_secrets_they_quote(
    succeeded: tuple[errands.App, int], tmp_path: Path
) -> None:
    app, job_id = succeeded
    assert PASSWORD in str(app.get_job(job_id).result)  # stored as the handler returned it
    results = _cli_shows_without_secrets(app, job_id, "jobs", "signed in with ***", tmp_path)
    assert "session" in results["show"].stdout and "bob" in results["show"].stdout


def test_the_dashboard_shows_results_and_steps_without_the_secrets_they_quote(
    succeeded: tuple[errands.App, int],
) -> None:
    app, job_id = succeeded
    with TestClient(create_app(app, password="letmein"), base_url=BASE_URL) as client:
        login(client, secret="letmein")
        page = client.get(f"/jobs/{job_id}")
        assert page.status_code == 200 and "signed in with ***" in page.text
        assert _leaks(page.text) == []


def test_the_dashboard_shows_the_job_without_its_secrets(
    failed: tuple[errands.App, int, list[str]],
) -> None:
    app, job_id, _ = failed
    with TestClient(create_app(app, password="letmein"), base_url=BASE_URL) as client:
        login(client, secret="letmein")
        for path in (f"/jobs/{job_id}", "/jobs", "/dlq", "/jobs?state=dead", "/", "/workers"):
            page = client.get(path)
            assert page.status_code == 200, path
            assert _leaks(page.text) == [], path
        assert "login refused for alice" in client.get(f"/jobs/{job_id}").text


def test_repr_and_messages_of_an_app_never_show_the_database_password(
    failed: tuple[errands.App, int, list[str]],
) -> None:
    app, _, _ = failed
    assert not _leaks(repr(app))
    if app.url.startswith("postgres"):
        assert ":***@" in repr(app)
        config = app.backend.config  # type: ignore[attr-defined]
        assert not _leaks(config.display) and ":***@" in config.display


def test_a_real_worker_logging_json_never_writes_the_secrets(tmp_path: Path) -> None:
    """``errands worker --log-format json --log-level debug``, the real process."""
    url = f"sqlite:///{tmp_path}/errands.db"
    app = errands.App(url)

    @app.job(name="fuzz.login", retries=0, sensitive={"password", "credentials"})
    def login_(user: str, password: str, credentials: dict[str, Any] | None = None) -> None:
        pass

    handle = login_.enqueue(user="bob", password=PASSWORD, credentials={"token": TOKEN})
    worker = subprocess.Popen(
        [sys.executable, "-m", "errands", "worker", "fuzz_app:app", "--log-format", "json",
         "--log-level", "debug", "--poll-interval", "0.05", "--grace", "5"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=cli_env(url), cwd=tmp_path,
    )  # fmt: skip
    try:
        wait_until(lambda: app.get_job(handle.id).state.value == "dead", 30, "the job to die")
    finally:
        worker.send_signal(signal.SIGTERM)
        out, err = worker.communicate(timeout=30)
        app.close()
    logs = (out + err).decode()
    assert worker.returncode == 0, logs
    assert '"event": "errands.job.dead"' in logs, logs
    # Every line is one JSON object (nothing crashed onto stderr); the only traceback is
    # the failed attempt's own, on its dead line, scrubbed like the stored one (issue 17).
    records = [json.loads(line) for line in logs.splitlines() if line.strip()]
    assert [r.get("event") for r in records if "Traceback" in json.dumps(r)] == ["errands.job.dead"]
    assert _leaks(logs) == [], logs
