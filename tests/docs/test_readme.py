"""The README's Usage code runs as pasted: its ``shop.py`` and ``enqueue.py`` blocks are
written to files as they are, and its commands run in that folder (``errands migrate``,
``errands worker`` until stopped, ``python enqueue.py``), on SQLite and, with the
commented PostgreSQL URL swapped in, on PostgreSQL (required under CI=true)."""

from __future__ import annotations

import os
import re
import secrets
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

import errands
from tests.pg import pg_base_url, require_pg

pytestmark = pytest.mark.acceptance

ROOT = Path(__file__).resolve().parents[2]
SQLITE_URL = "sqlite:///shop.db"


def usage() -> tuple[dict[str, str], list[str]]:
    """The Usage section's files (python blocks opening with ``# name.py``) and the
    commands of its first shell block (comments dropped)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Usage\n", 1)[1].split("\n## ", 1)[0]
    files: dict[str, str] = {}
    commands: list[str] = []
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", section, re.S):
        first = body.splitlines()[0]
        if lang == "python" and (named := re.fullmatch(r"# (\w+\.py)", first)):
            files[named.group(1)] = body
        elif lang == "sh" and not commands:
            commands = [ln.split("#", 1)[0].strip() for ln in body.splitlines() if ln.strip()]
    return files, commands


def test_the_usage_section_has_the_files_and_commands_this_test_runs() -> None:
    files, commands = usage()
    assert set(files) == {"shop.py", "enqueue.py"}
    assert files["shop.py"].count(f'"{SQLITE_URL}"') == 1
    assert '"postgresql://user@host/dbname"' in files["shop.py"]  # the URL to swap in
    assert commands == ["errands migrate shop:app", "errands worker shop:app", "python enqueue.py"]


def run_readme(folder: Path, url: str) -> tuple[str, str]:
    """Write the README's files into ``folder`` (``url`` swapped in), run its commands
    there as a shell would; returns (enqueue.py's output, the worker's log)."""
    files, commands = usage()
    for name, source in files.items():
        (folder / name).write_text(source.replace(f'"{SQLITE_URL}"', f'"{url}"'))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ERRANDS_", "PYTHON"))}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    worker: subprocess.Popen[bytes] | None = None
    log = folder / "worker.log"
    output = ""
    try:
        for command in commands:
            if " worker " in command:  # runs until stopped: in the background, like a terminal
                with log.open("wb") as sink:
                    worker = subprocess.Popen(
                        ["bash", "-c", f"exec {command}"], cwd=folder, env=env, stderr=sink,
                        stdout=subprocess.DEVNULL,
                    )  # fmt: skip
                deadline = time.monotonic() + 30
                while not re.search(r"worker w-\w+ started", log.read_text()):
                    assert worker.poll() is None, log.read_text()
                    assert time.monotonic() < deadline, log.read_text()
                    time.sleep(0.05)
                continue
            done = subprocess.run(
                ["bash", "-c", command], cwd=folder, env=env, capture_output=True, text=True,
                timeout=120,
            )  # fmt: skip
            assert done.returncode == 0, (command, done.stdout, done.stderr, log.read_text())
            output = done.stdout
        store = errands.App(f"sqlite:///{folder}/shop.db" if url == SQLITE_URL else url)
        try:
            deadline = time.monotonic() + 30
            while {j.state.value for j in store.jobs(name="shop.charge_order")} != {"completed"}:
                assert time.monotonic() < deadline, store.jobs(name="shop.charge_order")
                time.sleep(0.05)
            jobs = store.jobs(limit=100)
        finally:
            store.close()
    finally:
        if worker is not None:
            worker.send_signal(signal.SIGTERM)
            assert worker.wait(timeout=30) == 0, log.read_text()
    names = sorted(j.name for j in jobs)
    assert names.count("shop.charge_order") == 2 and names.count("shop.send_receipt") == 2
    assert names.count("shop.send_welcome_email") == 3
    assert not [j for j in jobs if j.state.value == "dead"], jobs
    return output, log.read_text()


def check(output: str, log: str) -> None:
    assert output.strip() == "ch_7"
    assert "Traceback" not in log and "dead after" not in log, log
    assert "periodic job" not in log  # the worker serves the periodic job's queue too


def test_the_readme_usage_runs_as_pasted_on_sqlite(tmp_path: Path) -> None:
    output, log = run_readme(tmp_path, SQLITE_URL)
    check(output, log)
    with closing(sqlite3.connect(tmp_path / "shop.db")) as conn:
        orders = conn.execute("SELECT id, total, charge_id FROM orders ORDER BY id").fetchall()
    assert orders == [(7, 1999, "ch_7"), (8, 4999, "ch_8")]


@pytest.fixture
def pg_database() -> Iterator[str]:
    """A fresh PostgreSQL database (the README's URL names a database, not a schema)."""
    require_pg()
    import psycopg

    parts = urlsplit(pg_base_url())
    name = f"readme_{secrets.token_hex(4)}"
    admin = urlunsplit(parts._replace(path="/postgres", query=""))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield urlunsplit(parts._replace(path=f"/{name}", query=""))
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_the_readme_usage_runs_as_pasted_on_postgres_with_its_url_swapped_in(
    tmp_path: Path, pg_database: str
) -> None:
    import psycopg

    output, log = run_readme(tmp_path, pg_database)
    check(output, log)
    with psycopg.connect(pg_database) as conn:
        orders = conn.execute("SELECT id, total, charge_id FROM orders ORDER BY id").fetchall()
    assert orders == [(7, 1999, "ch_7"), (8, 4999, "ch_8")]
