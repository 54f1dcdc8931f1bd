"""The SQLite write-ahead log does not keep the size a long reader let it grow to.

SQLite checkpoints the log into the file every 1000 pages, but not past the snapshot of a
read transaction still open, and it never shrinks the ``-wal`` file on its own: one open
read transaction let it grow from 4.5 MB to 152 MB in 15 s under load, and it stayed 152
MB after the reader ended. Now SQLite truncates it when it starts the log over
(``journal_size_limit``), and the maintenance leader empties it (a checkpoint that waits
for no reader or writer) once the reader is gone. The sizes are scaled down here.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

import errands
from errands.backends.sqlite import backend as sqlite_backend
from tests.conftest import running_worker

from .helpers import wait_until

TRIM = 256 * 1024  # (WAL_TRIM_BYTES, 16 MiB in production)


def _wal(path: Path) -> int:
    try:
        return os.path.getsize(f"{path}-wal")
    except OSError:
        return 0


def test_the_wal_a_long_reader_let_grow_is_emptied_once_the_reader_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sqlite_backend, "WAL_TRIM_BYTES", TRIM, raising=False)
    monkeypatch.setattr(sqlite_backend, "WAL_LIMIT_BYTES", 4 * TRIM, raising=False)
    monkeypatch.setattr(sqlite_backend, "WAL_WARN_AFTER", 0.0, raising=False)
    path = tmp_path / "wal.db"
    app = errands.App(f"sqlite:///{path}", retention=None)

    @app.job(name="wal.pad", queue="nobody-serves-it")
    def pad(text: str) -> None:
        pass

    app.migrate()

    def grow_past(size: int) -> None:
        for _ in range(2000):
            if _wal(path) > size:
                return
            app.enqueue_many([pad.bind(text="p" * 1000) for _ in range(50)])
        pytest.fail(f"the WAL stayed at {_wal(path)} bytes")

    try:
        with closing(sqlite3.connect(path, isolation_level=None)) as reader:
            reader.execute("BEGIN")
            reader.execute("SELECT count(*) FROM errands_jobs").fetchone()  # its snapshot
            caplog.set_level(logging.WARNING, logger="errands.sqlite")
            with running_worker(app, queues=["default"], maintenance_tick=0.05) as worker:
                grow_past(12 * TRIM)  # three times what SQLite itself truncates it to
                wait_until(
                    lambda: any("read transaction" in r.getMessage() for r in caplog.records),
                    timeout=30,
                    what="a warning that a reader keeps the log from being emptied",
                )
                assert _wal(path) > 12 * TRIM  # (no checkpoint can get past the reader)
                pad.enqueue(text="writes go on meanwhile")
                reader.execute("COMMIT")
                wait_until(
                    lambda: _wal(path) <= TRIM,
                    timeout=30,
                    what="the maintenance leader to empty the log",
                )
                assert worker.maintenance is not None and worker.maintenance.is_leader
            warnings = [r for r in caplog.records if "read transaction" in r.getMessage()]
            assert len(warnings) == 1, [r.getMessage() for r in warnings]  # (WAL_WARN_EVERY)
            assert str(path) in warnings[0].getMessage()
        with closing(sqlite3.connect(path)) as side:
            assert side.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert app.jobs(limit=1)[0].args == {"text": "writes go on meanwhile"}
    finally:
        app.close()


def test_every_connection_caps_the_wal_sqlite_keeps_when_it_starts_the_log_over(
    app: errands.App,
) -> None:
    conn = app.backend._conn()  # type: ignore[attr-defined]  # errands' own, this thread
    limit = conn.execute("PRAGMA journal_size_limit").fetchone()[0]
    assert limit == sqlite_backend.WAL_LIMIT_BYTES == 64 * 1024 * 1024
