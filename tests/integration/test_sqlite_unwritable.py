"""An SQLite file this process may not write: a clear ConfigurationError naming the file,
its folder and their permissions, wherever the write is made.

A write on a read-only file let sqlite3's raw "attempt to write a readonly database"
through (an enqueue's caller, a worker's thread, which died with its traceback); a
migration reported it as SchemaOutdated, "restore the file from a backup"; a folder in
which the ``-wal`` and ``-shm`` files cannot be created gave "check that the URL names an
errands SQLite file". The tests run as root in CI, for whom permissions are no obstacle:
most make errands' own connections read-only (``PRAGMA query_only``: SQLite refuses every
write with SQLITE_READONLY, as it does on a file opened read-only); the last takes the
permissions away for real, as a user who is not the file's owner.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

import errands
from errands.backends.sqlite.backend import SQLiteBackend
from errands.worker import completer
from tests.conftest import running_worker

from .helpers import wait_until


class ReadOnly:
    """Every connection ``backend`` has (this thread's) or opens from now on, made to
    refuse writes with SQLITE_READONLY (``on``), and to take them again (``off``)."""

    def __init__(self, backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.refusing = False
        self.opened: list[sqlite3.Connection] = []
        self.lock = threading.Lock()
        connect = backend._connect

        def connect_and_note(**options: Any) -> sqlite3.Connection:
            conn = connect(**options)
            with self.lock:
                self.opened.append(conn)
                conn.execute(f"PRAGMA query_only = {int(self.refusing)}")
            return conn

        monkeypatch.setattr(backend, "_connect", connect_and_note)
        own = getattr(backend._local, "conn", None)
        if own is not None:
            self.opened.append(own)

    def _set(self, refusing: bool) -> None:
        with self.lock:
            self.refusing = refusing
            for conn in self.opened:  # (another thread's: sqlite3 serialises the calls)
                conn.execute(f"PRAGMA query_only = {int(refusing)}")

    def on(self) -> None:
        self._set(True)

    def off(self) -> None:
        self._set(False)


def _at_version_14(path: Path) -> None:
    """A store as errands left it at schema version 14 (before 0015_worker_beat)."""
    SQLiteBackend(f"sqlite:///{path}").close()
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("ALTER TABLE errands_workers DROP COLUMN beat_seconds")
        conn.execute("DROP INDEX errands_workflow_edges_workflow")  # (0016)
        conn.execute("DROP INDEX errands_rate_log_token")  # (0017)
        conn.execute("ALTER TABLE errands_rate_log DROP COLUMN token")
        conn.execute("DELETE FROM errands_migrations WHERE version >= 15")


def _says_permissions(exc: BaseException, path: Path) -> None:
    message = str(exc)
    assert isinstance(exc, errands.ConfigurationError), repr(exc)
    assert not isinstance(exc, errands.SchemaOutdated), message
    assert "cannot be written" in message and str(path) in message, message
    assert str(path.parent) in message and "folder" in message, message
    assert "backup" not in message and "names an errands SQLite file" not in message, message


def test_a_migration_on_a_file_it_may_not_write_names_the_permissions_not_a_backup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "v14.db"
    _at_version_14(path)
    backend = SQLiteBackend(f"sqlite:///{path}", auto_migrate=False)
    try:
        ReadOnly(backend, monkeypatch).on()
        with pytest.raises(errands.ConfigurationError) as caught:
            backend.migrate()
    finally:
        backend.close()
    _says_permissions(caught.value, path)


def test_a_migration_on_tables_that_do_not_match_their_recorded_version_is_schema_outdated(
    tmp_path: Path,
) -> None:
    """What SchemaOutdated is for: the log says 14, the table has 0015's column already."""
    path = tmp_path / "edited.db"
    SQLiteBackend(f"sqlite:///{path}").close()
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("DELETE FROM errands_migrations WHERE version >= 15")
    with pytest.raises(errands.SchemaOutdated, match=r"duplicate column.*restore the file"):
        SQLiteBackend(f"sqlite:///{path}")


def test_an_enqueue_on_a_file_it_may_not_write_raises_a_configuration_error_naming_the_permissions(
    app: errands.App, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    @app.job(name="ro.note")
    def note() -> None:
        pass

    note.enqueue()  # (the schema exists)
    ReadOnly(app.backend, monkeypatch).on()
    with pytest.raises(errands.ConfigurationError) as caught:
        note.enqueue()
    _says_permissions(caught.value, tmp_path / "errands.db")
    assert len(app.jobs()) == 1  # still readable


def test_a_worker_on_a_file_it_may_not_write_stops_at_its_start_with_that_error(
    app: errands.App, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It retried its registration for as long as it ran (a raw OperationalError counted
    as a lost connection), then its thread died with sqlite3's traceback."""

    @app.job(name="ro.work")
    def work() -> None:
        pass

    work.enqueue()
    ReadOnly(app.backend, monkeypatch).on()
    worker = app.worker(concurrency=1, poll_interval=0.05)
    raised: list[BaseException] = []

    def run() -> None:
        try:
            worker.run(install_signals=False)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=60)
    if thread.is_alive():
        worker.stop()
        thread.join(timeout=30)
        pytest.fail("the worker went on retrying on a file it may not write")
    assert len(raised) == 1
    _says_permissions(raised[0], tmp_path / "errands.db")


def test_an_outcome_met_by_a_file_gone_read_only_is_written_once_it_is_writable_again(
    app: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file goes read-only while a job runs (a permission taken away, a file system
    remounted read-only): its outcome waits, as on a full store, and is never recorded
    dead for it (the completer would have split it off as content the store refuses)."""
    started, finish = threading.Event(), threading.Event()

    @app.job(name="ro.slow", retries=0)
    def slow() -> int:
        started.set()
        finish.wait(30)
        return 5

    handle = slow.enqueue()
    tries: list[float] = []
    monkeypatch.setattr(completer, "_pause", lambda s: (tries.append(s), time.sleep(0.01)))
    read_only = ReadOnly(app.backend, monkeypatch)
    with running_worker(app, concurrency=1):
        assert started.wait(30)
        read_only.on()
        finish.set()
        wait_until(
            lambda: len(tries) >= 4 * completer.REFUSALS_BEFORE_SPLIT,
            timeout=30,
            what="the completer to retry its write",
        )
        assert handle.status() is errands.JobState.RUNNING, handle.job().errors
        read_only.off()
        wait_until(lambda: handle.status().is_terminal, timeout=30, what="the outcome")
    job = handle.job()
    assert (job.state, job.attempt, job.result) == (errands.JobState.COMPLETED, 1, 5), job.errors


# -- for real: a user who may not write the file, nor create files in its folder ---------------

# Run as root (as in CI), it does what it tests on a writable store first (every module it
# needs imported: nobody may not read the interpreter's folder), then becomes nobody.
SCRIPT = """
import os, sys, errands

def enqueue(path):
    app = errands.App(f"sqlite:///{path}")

    @app.job(name="t")
    def t() -> None:
        pass

    t.enqueue()

enqueue(sys.argv[2])
if os.geteuid() == 0:
    os.setgid(65534)
    os.setuid(65534)
try:
    enqueue(sys.argv[1])
except errands.ConfigurationError as exc:
    print(type(exc).__name__, exc)
"""


@pytest.fixture
def unwritable_folder() -> Iterator[Path]:
    """A store in a folder, neither of which the script's user may write: root's, for
    nobody, when the tests run as root; else this user's, made read-only."""
    folder = Path(tempfile.mkdtemp(prefix="errands-ro-"))  # (tmp_path: no way in for nobody)
    path = folder / "jobs.db"
    SQLiteBackend(f"sqlite:///{path}").close()
    for leftover in folder.glob("jobs.db-*"):
        leftover.unlink()
    if os.geteuid() == 0:
        folder.chmod(0o755)
        path.chmod(0o644)
    else:
        path.chmod(0o444)
        folder.chmod(0o555)
    try:
        yield path
    finally:
        folder.chmod(0o755)
        shutil.rmtree(folder)


def test_a_folder_where_the_wal_cannot_be_created_is_named_with_its_permissions(
    unwritable_folder: Path, tmp_path: Path
) -> None:
    path = unwritable_folder
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), str(path), str(tmp_path / "warm.db")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(errands.__file__).resolve().parents[1])},
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0 and out.startswith("ConfigurationError"), out
    assert "cannot be written" in out and str(path.parent) in out and "folder" in out, out
    assert "names an errands SQLite file" not in out and "Traceback" not in out, out
