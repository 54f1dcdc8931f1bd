"""Waiting for SQLite's write lock (RELIABILITY F18): writers queue, never fail early.

The SQLite backend waits for the file's write lock itself (short tries instead of
SQLite's sleeping busy handler) and lets the threads of one process take turns on a lock
of their own. These tests hold the lock from a real second connection and real threads.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from contextlib import closing
from pathlib import Path

import pytest

from errands.backends.base import LeaseRef
from errands.backends.sqlite.backend import SQLiteBackend
from errands.errors import DatabaseBusy
from tests.conformance.support import request


def _held_elsewhere(
    path: Path, seconds: float, options: str = ""
) -> tuple[SQLiteBackend, threading.Thread]:
    """A backend on ``path``, and another connection (as a sqlite3 shell would) holding
    the file's write lock for ``seconds`` from now (join the thread when done)."""
    backend = SQLiteBackend(f"sqlite:///{path}{options}")
    held = threading.Event()

    def hold() -> None:
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        held.set()
        time.sleep(seconds)
        conn.execute("COMMIT")
        conn.close()

    thread = threading.Thread(target=hold)
    thread.start()
    assert held.wait(5)
    return backend, thread


def test_a_write_waits_for_the_lock_another_connection_holds_and_then_succeeds(
    tmp_path: Path,
) -> None:
    backend, holder = _held_elsewhere(tmp_path / "jobs.db", 0.4)
    started = time.monotonic()
    [result] = backend.job_insert_many([request()])
    waited = time.monotonic() - started
    holder.join()
    assert waited >= 0.3  # it queued behind the holder instead of failing
    assert backend.job_get(result.id) is not None
    backend.close()


def test_a_write_locked_out_past_write_timeout_raises_database_busy_and_writes_nothing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "jobs.db"
    backend, holder = _held_elsewhere(path, 3.0, "?write_timeout=0.3")
    with pytest.raises(DatabaseBusy, match=r"stayed locked for 0\.3 s.*long transaction"):
        backend.job_insert_many([request()])
    assert holder.is_alive()  # it gave up at its timeout, not when the holder let go
    holder.join()
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("SELECT count(*) FROM errands_jobs").fetchone() == (0,)
    backend.close()


def test_many_threads_of_one_process_write_at_once_and_every_write_lands(tmp_path: Path) -> None:
    backend = SQLiteBackend(f"sqlite:///{tmp_path / 'jobs.db'}")
    errors: list[BaseException] = []

    def insert(n: int) -> None:
        try:
            for _ in range(n):
                backend.job_insert_many([request()])
        except BaseException as exc:  # pragma: no cover - the assertion reports it
            errors.append(exc)

    threads = [threading.Thread(target=insert, args=(50,)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    with closing(sqlite3.connect(tmp_path / "jobs.db")) as conn:
        assert conn.execute("SELECT count(*) FROM errands_jobs").fetchone() == (400,)
    backend.close()


def test_a_write_behind_a_thread_holding_the_process_lock_past_its_timeout_raises_database_busy(
    tmp_path: Path,
) -> None:
    backend = SQLiteBackend(f"sqlite:///{tmp_path / 'jobs.db'}?write_timeout=0.2")
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with backend._write():  # a write transaction of this process that does not end
            inside.set()
            leave.wait(5)

    holder = threading.Thread(target=hold)
    holder.start()
    assert inside.wait(5)
    try:
        with pytest.raises(DatabaseBusy, match="another thread of this process"):
            backend.job_insert_many([request()])
    finally:
        leave.set()
        holder.join()
    backend.job_insert_many([request()])  # the lock is free again
    backend.close()


def test_a_heartbeat_gets_through_while_other_threads_of_its_process_write_back_to_back(
    tmp_path: Path,
) -> None:
    """A heartbeat must renew within a third of the lease; threads that claim and complete
    in a loop, retaking the write lock at once, must not keep it out that long. (Without a
    fair hand-over they keep it out for good; the 1 s wait only absorbs a loaded machine's
    scheduling, which once held a 0.1 s wait past its end.)"""
    backend = SQLiteBackend(f"sqlite:///{tmp_path / 'jobs.db'}")
    stop = threading.Event()

    def write_in_a_loop() -> None:
        while not stop.is_set():
            backend.job_insert_many([request()])

    writers = [threading.Thread(target=write_in_a_loop) for _ in range(3)]
    for thread in writers:
        thread.start()
    failures: list[BaseException] = []
    try:
        for _ in range(20):  # each waits at most 1 s (a third of a 3 s lease)
            try:
                backend.job_heartbeat_many([LeaseRef(1, "token", 3.0)])
            except DatabaseBusy as exc:
                failures.append(exc)
    finally:
        stop.set()
        for thread in writers:
            thread.join()
    assert failures == []
    backend.close()
