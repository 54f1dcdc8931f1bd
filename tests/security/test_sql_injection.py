"""SQL only with bound parameters, proven from the outside (issue 10 item 4): strings that
break SQL built by formatting travel as queue and job names, idempotency keys, filters,
discard reasons and actors, through the API, the dashboard and the command line, on
SQLite and PostgreSQL. Each is either refused with a clear validation error or stored and
matched verbatim; nothing else matches, no table is touched, nothing fails with a
database error.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest
from starlette.testclient import TestClient

import errands
from errands.backends.base import ClaimParams, FinishParams, QueueClaim
from errands.dashboard import create_app
from tests.dashboard.helpers import BASE_URL, csrf_of, login
from tests.fuzz.support import INJECTIONS, cli_env, job_count, run_cli_many

KEYABLE = [s for s in INJECTIONS if len(s.encode()) <= 1000]  # keys are capped at 1,000 bytes
UNSTORABLE = ["\x00", "a\x00'; DROP TABLE errands_jobs; --", "\ud800", "caf\udce9"]


@pytest.fixture(scope="module")
def app(store_url: str) -> Iterator[errands.App]:
    application = errands.App(store_url)

    @application.job(name="safe.echo", queue="safe", retries=0)
    def echo(text: str) -> str:
        return text

    application.migrate()
    yield application
    application.close()


ERROR = {"attempt": 1, "type": "Boom", "message": "boom", "traceback": None, "kind": "permanent"}


def _kill(app: errands.App, queue: str) -> None:
    """Claim every due job of ``queue`` and record it dead (no worker needed)."""
    claim = ClaimParams([QueueClaim(queue, 10)], limit=10, worker_id="t", lease_seconds_default=30)
    rows = app.backend.job_claim(claim)
    outcomes = [FinishParams(r.id, r.lease_token or "", "dead", error=ERROR) for r in rows]
    assert rows and all(app.backend.job_finish_many(outcomes))


@pytest.fixture(scope="module")
def planted(app: errands.App) -> dict[str, Any]:
    """Jobs keyed by every injection string, canaries that must never match, dead jobs."""
    echo = app.registry["safe.echo"]
    keyed = {s: echo.enqueue(text=s, key=s).id for s in KEYABLE}
    canaries = [echo.enqueue(text=f"canary {i}", queue=f"canary{i}").id for i in range(3)]
    dead = [echo.enqueue(text=f"dead {i}", queue="graveyard").id for i in range(2)]
    _kill(app, "graveyard")
    return {"keyed": keyed, "canaries": canaries, "dead": dead, "count": job_count(app)}


def _intact(app: errands.App, planted: dict[str, Any]) -> None:
    """Every table still there, every planted row unchanged, nothing added or removed."""
    assert job_count(app) == planted["count"]
    for text, job_id in planted["keyed"].items():
        job = app.get_job(job_id)
        assert job.idempotency_key == text and job.args == {"text": text}
    assert {app.get_job(i).state.value for i in planted["dead"]} == {"dead"}
    assert app.audit(limit=5) is not None and app.queue_settings() is not None
    assert app.backend.step_list(planted["canaries"][0]) == []


@pytest.mark.parametrize("text", KEYABLE, ids=range(len(KEYABLE)))
def test_an_injection_string_as_a_key_is_stored_verbatim_and_deduplicates_only_itself(
    app: errands.App, planted: dict[str, Any], text: str
) -> None:
    echo = app.registry["safe.echo"]
    again = echo.enqueue(text=text, key=text)
    assert again.deduplicated and again.id == planted["keyed"][text]
    found = app.backend.job_find_by_key(text)
    assert [row.id for row in found] == [planted["keyed"][text]]
    assert app.backend.job_find_by_key(text + "x") == []
    _intact(app, planted)


@pytest.mark.parametrize("text", INJECTIONS, ids=range(len(INJECTIONS)))
def test_an_injection_string_as_a_filter_matches_nothing_and_changes_nothing(
    app: errands.App, planted: dict[str, Any], text: str
) -> None:
    assert app.jobs(queue=text) == []
    assert app.jobs(name=text) == []
    assert app.jobs(state="dead", queue=text, name=text) == []
    assert app.replay(all=True, queue=text, dry_run=True).matched == []
    assert app.replay(all=True, name=text, actor=text).matched == []
    assert app.discard(all=True, queue=text, reason=text, actor=text).matched == []
    _intact(app, planted)


@pytest.mark.parametrize("text", INJECTIONS, ids=range(len(INJECTIONS)))
def test_an_injection_string_as_a_queue_or_job_name_is_refused_with_a_clear_error(
    app: errands.App, planted: dict[str, Any], text: str
) -> None:
    echo = app.registry["safe.echo"]
    with pytest.raises(errands.ConfigurationError, match="queue name"):
        echo.enqueue(text="x", queue=text)
    with pytest.raises(errands.ConfigurationError, match="job name"):
        app.job(name=text)(lambda: None)
    with pytest.raises(errands.ConfigurationError, match="queue name"):
        app.pause(text)
    with pytest.raises(errands.ConfigurationError, match="queue name"):
        errands.App(app.url, default_queue=text)
    _intact(app, planted)


def test_reasons_and_actors_holding_sql_are_stored_as_plain_text(
    app: errands.App, planted: dict[str, Any]
) -> None:
    reason, actor = INJECTIONS[0], INJECTIONS[1]
    echo = app.registry["safe.echo"]
    job_id = echo.enqueue(text="to discard", queue="discards").id
    planted["count"] += 1
    _kill(app, "discards")

    assert app.discard([job_id], reason=reason, actor=actor).matched == [job_id]

    job = app.get_job(job_id)
    assert (job.state.value, job.discard_reason, job.discarded_by) == ("discarded", reason, actor)
    (event,) = app.audit(job_id=job_id)
    assert (event.actor, event.action, event.detail) == (actor, "discard", {"reason": reason})
    _intact(app, planted)


@pytest.mark.parametrize("text", UNSTORABLE, ids=["nul", "nul-and-sql", "surrogate", "undecodable"])
def test_nul_or_invalid_unicode_anywhere_is_a_clear_error_on_every_backend(
    app: errands.App, planted: dict[str, Any], text: str
) -> None:
    """PostgreSQL text cannot hold NUL; no database stores a lone surrogate. Both are
    refused before SQL, the same way on every backend."""
    echo = app.registry["safe.echo"]
    with pytest.raises(errands.ConfigurationError, match="key="):
        echo.enqueue(text="x", key=text)
    with pytest.raises(errands.InvalidPayload, match="text"):
        echo.enqueue(text=text)
    for call in (
        lambda: app.jobs(queue=text),
        lambda: app.jobs(name=text),
        lambda: app.replay(all=True, queue=text, dry_run=True),
        lambda: app.discard([planted["dead"][0]], reason=text, dry_run=True),
        lambda: app.cancel(planted["canaries"][0], actor=text),
    ):
        with pytest.raises(errands.ConfigurationError):
            call()
    _intact(app, planted)


def test_a_key_longer_than_an_index_entry_is_refused_before_the_database(
    app: errands.App, planted: dict[str, Any]
) -> None:
    """PostgreSQL cannot index (name, key) past ~2,700 bytes; the limit is the same on SQLite."""
    echo = app.registry["safe.echo"]
    with pytest.raises(errands.ConfigurationError, match="over the limit of 1,000"):
        echo.enqueue(text="x", key="k" * 1001)
    with pytest.raises(errands.ConfigurationError, match="over the limit of 1,000"):
        echo.enqueue(text="x", key="é" * 501)  # 1,002 bytes of UTF-8
    _intact(app, planted)


# -- the dashboard ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(app: errands.App, planted: dict[str, Any]) -> Iterator[TestClient]:
    with TestClient(
        create_app(app, password="correct horse battery staple"),
        base_url=BASE_URL,
        client=("127.0.0.1", 50000),
    ) as signed_in:
        login(signed_in)
        yield signed_in


@pytest.mark.parametrize(
    "text", [*INJECTIONS, "<script>alert(1)</script>"], ids=range(len(INJECTIONS) + 1)
)
def test_dashboard_filters_and_search_with_injection_strings_are_escaped_and_match_nothing_else(
    app: errands.App, planted: dict[str, Any], client: TestClient, text: str
) -> None:
    value = quote(text, safe="")
    for path in (
        f"/jobs?queue={value}",
        f"/jobs?name={value}&state=dead",
        f"/dlq?queue={value}&name={value}",
        f"/audit?job_id={value}",
        f"/jobs?state={value}",
    ):
        page = client.get(path)
        assert page.status_code in (200, 400), (path, page.status_code)
        assert "<script>alert(1)" not in page.text
        for canary in planted["canaries"]:
            assert f'/jobs/{canary}"' not in page.text, f"{path} listed a canary job"
    search = client.get(f"/jobs?q={value}")
    assert search.status_code == 200
    expected = planted["keyed"].get(text[:200])  # the page reads 200 characters of a filter
    shown = {
        i
        for i in (*planted["canaries"], *planted["dead"], *planted["keyed"].values())
        if f'/jobs/{i}"' in search.text
    }
    assert shown == ({expected} if expected else set()), text
    _intact(app, planted)


def test_dashboard_actions_with_injection_strings_change_nothing_they_should_not(
    app: errands.App, planted: dict[str, Any], client: TestClient
) -> None:
    token = csrf_of(client.get("/dlq").text)
    for text in INJECTIONS[:4]:
        preview = client.post(
            "/dlq/preview",
            data={
                "csrf_token": token,
                "op": "discard",
                "scope": "all",
                "queue": text,
                "name": text,
                "reason": text,
            },
            follow_redirects=False,
        )
        assert preview.status_code in (200, 303), preview.status_code
        paused = client.post(
            f"/queues/{quote(text, safe='')}/pause",
            data={"csrf_token": token},
            follow_redirects=True,
        )
        assert paused.status_code == 200 and "queue name" in paused.text
    assert [q.name for q in app.queue_settings() if q.paused] == []
    _intact(app, planted)


@pytest.mark.parametrize("path", ["/jobs?q=%00", "/jobs?queue=a%00b", "/dlq?name=%00"])
def test_a_nul_character_in_a_dashboard_filter_is_a_400_not_a_server_error(
    app: errands.App, planted: dict[str, Any], client: TestClient, path: str
) -> None:
    page = client.get(path)
    assert page.status_code == 400
    assert "NUL character" in page.text
    _intact(app, planted)


# -- the command line -------------------------------------------------------------------------
def test_cli_filters_with_injection_strings_match_nothing_and_exit_cleanly(
    app: errands.App, planted: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = tmp_path_factory.mktemp("cli")
    a, b, c, d, e, f, g = INJECTIONS[:7]
    commands = {
        "jobs": ["jobs", "list", "--queue", a, "--name", b, "--json"],
        "dlq": ["dlq", "list", "--queue", c, "--name", e, "--json"],
        "replay": ["dlq", "replay", "--all", "--queue", d, "--name", f, "--dry-run", "--json"],
        "discard": ["dlq", "discard", "--all", "--name", g, "--reason", a, "--actor", b, "--json"],
    }
    results = run_cli_many(commands, cli_env(app.url), folder)
    for key in ("jobs", "dlq"):
        assert results[key].code == 0 and json.loads(results[key].stdout) == [], results[key]
    for key in ("replay", "discard"):
        assert results[key].code == 0, results[key]
        assert json.loads(results[key].stdout)["matched"] == [], results[key]
    assert all("Traceback" not in r.output for r in results.values())
    _intact(app, planted)
