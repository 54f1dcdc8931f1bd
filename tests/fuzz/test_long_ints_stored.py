"""Rows stored before long ints were refused (2026-12-06): a job's arguments, result or
step result holding an int of more than 4,300 digits, which Python's JSON reader refuses
(sys.int_max_str_digits) whatever the digits. Every read of such a job raised on
PostgreSQL (its steps: ``errands jobs show``, the dashboard's job page, a replay's run),
and SQLite gave the JSON text back as a str (``result()`` returned a string, a step a
string to the handler). They read back whole now, the digit limit lifted for that decode
only (a parse_int hook: the process's own limit stays as it is), and the CLI and the
dashboard write them out whole. On SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from collections.abc import Iterator
from contextlib import closing
from typing import Any

import pytest
from click.testing import CliRunner

import errands
from errands.cli.main import cli
from errands.jsontext import int_text, json_text, loads_stored
from errands.payload import INT_MAX_DIGITS
from tests.conftest import running_worker

from .support import wait_until

HUGE = 10**4400
DIGITS = str(HUGE) if sys.get_int_max_str_digits() == 0 else "1" + "0" * 4400


@pytest.fixture
def app(store_url: str) -> Iterator[errands.App]:
    application = errands.App(store_url)

    @application.job(name="long.result", sensitive={"token"})
    def result(token: str = "") -> Any:
        return None

    @application.job(name="long.secret", retries=0, sensitive={"code"})
    def secret(code: int) -> None: ...

    @application.job(name="long.args", retries=0)
    def args(n: int) -> int:
        return 0

    @application.job(name="long.step", retries=0)
    def step(ctx: errands.Context) -> bool:
        value = ctx.step("count", lambda: 0)
        return bool(value == [HUGE])

    application.migrate()
    yield application
    application.close()


def _plant(app: errands.App, sql: str, *params: Any) -> None:
    """``sql`` (PostgreSQL placeholders; SQLite's are swapped in) on the store's tables."""
    if app.url.startswith("sqlite"):
        with closing(sqlite3.connect(app.url.removeprefix("sqlite:///"))) as side:
            side.execute(sql.replace("%s", "?").replace("now()", "0"), params)
            side.commit()
    else:
        import psycopg

        from tests.pg import pg_base_url

        with psycopg.connect(pg_base_url(), autocommit=True) as side:
            side.execute(f'SET search_path TO "{app.backend.schema}"')  # type: ignore[attr-defined]
            side.execute(sql, params)


def _cli(app: errands.App, *args: str) -> str:
    result = CliRunner().invoke(cli, [*args, "--url", app.url], terminal_width=200)
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


def test_a_stored_long_int_reads_back_whole_and_shows_in_the_cli_and_the_dashboard(
    app: errands.App,
) -> None:
    registry = app.registry
    done = registry["long.result"].enqueue(token="s3cret-token", delay=3600)  # masked in it
    dead = registry["long.args"].enqueue(n=1, delay=3600)
    hidden = registry["long.secret"].enqueue(code=1, delay=3600)
    _plant(app, "UPDATE errands_jobs SET args = %s WHERE id = %s", f'{{"code": {DIGITS}}}',
           hidden.id)  # fmt: skip
    _plant(
        app,
        "UPDATE errands_jobs SET state = 'completed', result = %s, finished_at = now() "
        "WHERE id = %s",
        f'{{"total": {DIGITS}, "negative": -{DIGITS}}}',
        done.id,
    )
    _plant(app, "UPDATE errands_jobs SET state = 'dead', args = %s WHERE id = %s",
           f'{{"n": {DIGITS}}}', dead.id)  # fmt: skip
    app.backend.step_store(done.id, "count", "[1]", 1)
    _plant(app, "UPDATE errands_steps SET result = %s WHERE job_id = %s", f"[{DIGITS}]", done.id)

    assert app.get_job(done.id).result == {"total": HUGE, "negative": -HUGE}
    assert done.result(timeout=5) == {"total": HUGE, "negative": -HUGE}
    assert app.get_job(dead.id).args == {"n": HUGE}
    [step] = app.job_steps(done.id)
    assert step.result == [HUGE]
    assert sys.get_int_max_str_digits() in (0, INT_MAX_DIGITS)  # the limit left as it was

    shown = _cli(app, "jobs", "show", str(done.id))
    assert f'"total": {DIGITS}' in shown and f'"negative": -{DIGITS}' in shown
    assert "count: [1000" in shown  # the step, cut to its line
    as_json = loads_stored(_cli(app, "jobs", "show", str(done.id), "--json"))
    assert as_json["result"] == {"total": HUGE, "negative": -HUGE}
    assert f'{{"n": {DIGITS}}}' in _cli(app, "dlq", "show", str(dead.id))
    listed = loads_stored(_cli(app, "dlq", "list", "--json"))
    assert [j["args"] for j in listed] == [{"n": HUGE}]
    masked = _cli(app, "jobs", "show", str(hidden.id))  # a sensitive long int: masked
    assert '"code": "***"' in masked and DIGITS[:100] not in masked

    pytest.importorskip("starlette", reason="the dashboard extra is not installed")
    from starlette.testclient import TestClient

    from errands.dashboard import create_app
    from tests.dashboard.helpers import BASE_URL, PASSWORD, TOKEN, login

    with TestClient(
        create_app(app, password=PASSWORD, token=TOKEN), base_url=BASE_URL,
        client=("127.0.0.1", 50000),
    ) as client:  # fmt: skip
        login(client)
        for job_id in (done.id, dead.id):
            page = client.get(f"/jobs/{job_id}")
            assert page.status_code == 200, page.text[-500:]
            assert DIGITS[:200] in page.text
        page = client.get(f"/jobs/{hidden.id}")
        assert page.status_code == 200 and DIGITS[:100] not in page.text


def test_a_stored_step_holding_a_long_int_is_given_back_to_the_handler_whole(
    app: errands.App,
) -> None:
    """A retry (or replay) of a job whose step was stored with such an int: on PostgreSQL
    the run failed reading its steps, on SQLite the step read back as a str."""
    handle = app.registry["long.step"].enqueue(delay=3600)
    app.backend.step_store(handle.id, "count", "[1]", 1)
    _plant(app, "UPDATE errands_steps SET result = %s WHERE job_id = %s", f"[{DIGITS}]", handle.id)
    _plant(app, "UPDATE errands_jobs SET run_at = now() WHERE id = %s", handle.id)
    with running_worker(app, poll_interval=0.02):
        wait_until(lambda: handle.status().is_terminal, 30, "the job to end")
    job = handle.job()
    assert (job.state.value, job.result) == ("completed", True), job.errors


def test_long_ints_read_and_write_whole_and_other_errors_stay_as_json_says_them() -> None:
    with pytest.raises(json.JSONDecodeError):
        loads_stored('{"n": 1')
    assert loads_stored(f"[-{DIGITS}, 1, 2.5]") == [-HUGE, 1, 2.5]
    assert int_text(-(HUGE + 7)) == f"-{DIGITS[:-1]}7"
    value = {"a": [HUGE, {"b": -HUGE}], "c": "é", "d": 1}
    text = json_text(value, ensure_ascii=False, sort_keys=True)
    assert text == f'{{"a": [{DIGITS}, {{"b": -{DIGITS}}}], "c": "é", "d": 1}}'
    assert loads_stored(text) == value
    cycle: list[Any] = [HUGE]
    cycle.append(cycle)
    with pytest.raises(ValueError):  # json.dumps's own error, not a RecursionError
        json_text(cycle)
    with pytest.raises(ValueError, match="Circular reference"):
        json_text(_plain_cycle())


def _plain_cycle() -> list[Any]:
    cycle: list[Any] = [1]
    cycle.append(cycle)
    return cycle


def test_a_job_whose_stored_args_hold_a_long_int_moves_with_the_others_of_its_edit(
    app: errands.App,
) -> None:
    """Moving jobs to another queue derives their keys again from their stored arguments:
    a row holding a long int raised a raw ValueError out of the edit, and no job it named
    moved."""

    @app.job(name="long.keyed", concurrency_key="acct:{acct}", concurrency_limit=2)
    def keyed(acct: str, n: int = 0) -> None: ...

    long = keyed.enqueue(acct="a", n=1, delay=3600)
    plain = keyed.enqueue(acct="b", n=2, delay=3600)
    _plant(app, "UPDATE errands_jobs SET args = %s WHERE id = %s",
           f'{{"acct": "a", "n": {DIGITS}}}', long.id)  # fmt: skip
    app.edit([plain.id, long.id], queue="other", actor="ops")
    assert [app.get_job(job.id).queue for job in (long, plain)] == ["other", "other"]
