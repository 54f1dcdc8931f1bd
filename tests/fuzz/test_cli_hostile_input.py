"""Hostile text and values through the command line: job text (error messages, actors)
that looks like rich markup or holds control characters, and option values that parse but
mean nothing (NaN, an empty queue name, JSON nested past Python's stack).

Job text is printed as it was written, one table row per job, on a terminal and piped
alike; a bad value is one clear error, never a traceback nor a silently wrong answer.
Most commands run in-process (click's CliRunner, stdout piped); the terminal cases run
``python -m errands`` on a pseudo-terminal, as an operator at a shell would.
"""

from __future__ import annotations

import contextlib
import sqlite3
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import errands
from errands.cli.main import cli
from errands.testing import Tester

from .support import cli_env, run_cli, run_cli_on_terminal


def _dead_job(app: errands.App, message: str) -> int:
    """One dead job whose only error is ``RuntimeError(message)``."""

    @app.job(name="hostile.fail", retries=0)
    def fail(text: str) -> None:
        raise RuntimeError(text)

    handle = fail.enqueue(text=message)
    with Tester(app) as tester:
        tester.drain(with_retries=False)
    assert app.get_job(handle.id).state.value == "dead"
    return handle.id


def _cli(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def _cli_result(*args: str) -> Result:
    """:func:`_cli` for a command expected to fail: its exit code, not its exception."""
    return CliRunner().invoke(cli, list(args))


def _on_terminal(args: Sequence[str], url: str, folder: Path) -> tuple[int, str]:
    """The exit code and what the terminal showed (one stream: stdout and stderr)."""
    result = run_cli_on_terminal(args, cli_env(url, COLUMNS="250"), folder)
    return result.code, result.stdout


MARKUP = "a [/] [red]b[/red] :fire: c"  # short: the listing cuts a last error at 50


@pytest.mark.parametrize("command", [["dlq", "list"], ["jobs", "list"]])
def test_an_error_message_that_looks_like_markup_is_printed_as_written_on_a_terminal(
    app: errands.App, db_url: str, tmp_path: Path, command: list[str]
) -> None:
    _dead_job(app, MARKUP)
    code, shown = _on_terminal(command, db_url, tmp_path)
    assert code == 0, shown
    assert "Traceback" not in shown and "MarkupError" not in shown, shown
    assert f"RuntimeError: {MARKUP}" in shown, shown


def test_a_jobs_show_on_a_terminal_leaves_emoji_codes_in_job_text_alone(
    app: errands.App, db_url: str, tmp_path: Path
) -> None:
    job_id = _dead_job(app, MARKUP)
    code, shown = _on_terminal(["jobs", "show", str(job_id)], db_url, tmp_path)
    assert code == 0, shown
    assert f"RuntimeError: {MARKUP}" in shown, shown
    assert "\N{FIRE}" not in shown, shown


FORGED = "x\n999  forged.job  default  dead\tfine\x1b[2J\r"


def test_a_newline_in_an_error_message_cannot_forge_a_row_of_a_piped_listing(
    app: errands.App, db_url: str
) -> None:
    job_id = _dead_job(app, FORGED)
    result = _cli("dlq", "list", "--url", db_url)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) == 2, result.output  # the header and the one dead job
    assert lines[1].startswith(f"{job_id} "), result.output
    assert "RuntimeError: x\\n999  forged.job  default  dead" in lines[1], result.output
    assert "\x1b" not in result.output and "\r" not in result.output


def test_a_newline_in_an_error_message_stays_in_its_row_on_a_terminal(
    app: errands.App, db_url: str, tmp_path: Path
) -> None:
    _dead_job(app, FORGED)
    code, shown = _on_terminal(["dlq", "list"], db_url, tmp_path)
    assert code == 0, shown
    assert "RuntimeError: x\\n999  forged.job  default  dead" in shown, shown
    assert not any(line.lstrip("│ ").startswith("999") for line in shown.splitlines()), shown


def test_a_jobs_show_prints_each_error_on_one_line(app: errands.App, db_url: str) -> None:
    job_id = _dead_job(app, FORGED)
    result = _cli("jobs", "show", str(job_id), "--url", db_url)
    assert result.exit_code == 0, result.output
    [line] = [x for x in result.output.splitlines() if x.lstrip().startswith("#1 at")]
    assert "RuntimeError: x\\n999  forged.job  default  dead\\tfine\\x1b[2J\\r" in line, line
    assert not any(x.startswith("999") for x in result.output.splitlines()), result.output


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    ("option", "args"),
    [
        ("--payload", ["jobs", "signal", "1", "go", "--payload", DEEP]),
        ("--args", ["jobs", "edit", "1", "-A", "shop:app", "--args", '{"a": ' + DEEP + "}"]),
    ],
    ids=["signal-payload", "edit-args"],
)
def test_json_nested_too_deep_to_read_is_a_usage_error_naming_the_option(
    db_url: str, option: str, args: list[str]
) -> None:
    result = _cli(*args, "--url", db_url)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for {option}: the JSON is nested too deep" in result.output


@pytest.mark.parametrize(
    "payload", ['{"total": NaN}', '{"total": 1e999}', "-Infinity", '{"note": "a\\u0000b"}']
)
def test_a_signal_payload_json_cannot_hold_is_one_error_line_not_a_traceback(
    app: errands.App, db_url: str, payload: str
) -> None:
    @app.job(name="hostile.wait")
    def wait(ctx: errands.Context) -> object:
        return ctx.wait_for_signal("go")

    handle = wait.enqueue(delay=3600)
    result = _cli_result(
        "jobs", "signal", str(handle.id), "go", "--payload", payload, "--url", db_url
    )
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "error: signal 'go': the payload: " in result.output, result.output
    assert app.audit(job_id=handle.id) == []


@pytest.mark.parametrize("spec", ["", ",", "=5"])
def test_a_worker_given_an_empty_queue_list_stops_saying_so_instead_of_serving_every_queue(
    db_url: str, tmp_path: Path, spec: str
) -> None:
    """``errands worker -q "$QUEUE"`` with QUEUE unset served every queue of the app."""
    try:
        result = run_cli(["worker", "fuzz_app:app", "-q", spec], cli_env(db_url), tmp_path, 30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"-q {spec!r}: the worker started (serving every queue) instead of stopping")
    assert result.code == 1, result
    assert "Traceback" not in result.output, result
    [line] = result.error_lines
    assert "no queue" in line, result


@pytest.mark.parametrize("actor", ["", " "])
def test_a_blank_actor_on_the_command_line_is_refused_and_not_audited(
    app: errands.App, db_url: str, actor: str
) -> None:
    job_id = _dead_job(app, "boom")
    result = _cli_result("dlq", "replay", str(job_id), "--actor", actor, "--url", db_url)
    assert result.exit_code == 1, result.output
    assert "is blank: name who acts" in result.output, result.output
    assert app.get_job(job_id).state.value == "dead"
    assert app.audit(job_id=job_id) == []


@pytest.mark.parametrize(
    "args",
    [
        ["status", "--max-age", "nan"],
        ["status", "--max-age", "inf"],
        ["jobs", "edit", "1", "--delay", "nan"],
        ["worker", "fuzz_app:app", "--grace", "nan"],
        ["worker", "fuzz_app:app", "--poll-interval", "nan"],
        ["worker", "fuzz_app:app", "--maintenance-tick", "inf"],
    ],
    ids=lambda args: "-".join(args[-2:]),
)
def test_a_number_of_seconds_that_is_not_finite_is_a_usage_error(
    db_url: str, args: list[str]
) -> None:
    """click's FloatRange lets NaN through (it compares false with either bound): a
    ``status --max-age nan`` alert could never fire."""
    result = _cli_result(*args, "--url", db_url)
    assert result.exit_code == 2, result.output
    assert "is not a finite number" in result.output, result.output


@pytest.mark.parametrize(
    ("args", "done"),
    [
        (["dlq", "replay"], "replayed 1 job(s)"),
        (["dlq", "discard", "--reason", "duplicate"], "discarded 1 job(s)"),
        (["jobs", "edit", "--priority", "5"], "edited 1 job(s)"),
        (["dlq", "replay", "--dry-run"], "would replay 1 job(s)"),
    ],
    ids=["replay", "discard", "edit", "dry-run"],
)
def test_an_action_that_skipped_some_ids_exits_1_saying_how_many(
    app: errands.App, db_url: str, args: list[str], done: str
) -> None:
    """`jobs cancel 5 999` exits 1; `dlq replay`, `dlq discard` and `jobs edit` exited 0
    when some of the ids were skipped (1 only when all were): a script took it as done."""
    dead = _dead_job(app, "boom")
    pending = app.registry["hostile.fail"].enqueue(text="later", delay=3600).id
    target = dead if args[0] == "dlq" else pending
    result = _cli_result(*args, str(target), "999", "--url", db_url)
    assert result.exit_code == 1, result.output
    assert f"{done}: {target}" in result.output, result.output
    assert "skipped job 999" in result.output, result.output
    skipped = "would be skipped" if "--dry-run" in args else "skipped"
    assert f"error: 1 of 2 job(s) {skipped}" in result.output, result.output
    as_json = _cli_result(*args, str(target), "999", "--url", db_url, "--json")
    assert as_json.exit_code == 1, as_json.output


def _tables(path: Path) -> set[str]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}


@pytest.mark.parametrize("command", [["status"], ["jobs", "list"], ["dlq", "list"]])
def test_a_reading_command_leaves_another_applications_sqlite_file_alone(
    tmp_path: Path, command: list[str]
) -> None:
    """`errands status --url sqlite:///other.db` created the errands tables inside another
    application's database. Refused, naming `errands migrate`, which still creates them."""
    other = tmp_path / "other.db"
    with contextlib.closing(sqlite3.connect(other)) as conn:
        conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, email TEXT)")
        conn.commit()
    url = f"sqlite:///{other}"
    refused = _cli_result(*command, "--url", url)
    assert refused.exit_code == 2, refused.output
    assert "is a SQLite database with tables of its own and no errands store" in refused.output
    assert f"errands migrate --url {url}" in refused.output, refused.output
    assert _tables(other) == {"users"}

    assert _cli_result("migrate", "--url", url).exit_code == 0  # wanted there: migrate first
    assert "errands_migrations" in _tables(other) and "users" in _tables(other)
    assert _cli_result(*command, "--url", url).exit_code == 0


def test_a_reading_command_still_opens_a_new_store_and_an_empty_file(tmp_path: Path) -> None:
    store = errands.App(f"sqlite:///{tmp_path}/new.db")
    store.migrate()
    store.close()
    (tmp_path / "empty.db").touch()
    for name in ("new.db", "empty.db"):
        result = _cli_result("status", "--url", f"sqlite:///{tmp_path}/{name}")
        assert result.exit_code == 0, result.output
        assert "no jobs yet" in result.output
