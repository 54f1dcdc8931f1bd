"""The SQLite store's connections: closed while in use, interrupted, forked, per thread.

``App.close()`` can run while a worker's handler thread still completes a job in its
``ctx.transaction()`` (an embedded worker not yet stopped, a test's fixture tearing the
App down), or while a thread is in a call on the in-memory store's one connection.
Closing a connection under a running call freed what the call was using: the process
crashed with SIGSEGV. Those cases run in a child process, so that a crash is a failed
test, not a lost test process.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
from contextlib import closing
from pathlib import Path

import pytest

from tests.conformance.support import request

LONG_QUERY = (
    "WITH RECURSIVE c(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM c WHERE n < 2000000) "
    "SELECT count(*) FROM c"
)


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],  # the repository (tests.* importable)
    )


def test_closing_the_store_leaves_a_transaction_connection_in_use_to_its_thread_which_commits(
    tmp_path: Path,
) -> None:
    path = tmp_path / "store.db"
    done = _run(
        f"""
        import sys, threading, time
        from errands.backends.sqlite.backend import SQLiteBackend

        backend = SQLiteBackend("sqlite:///" + sys.argv[1])
        conn = backend.tx_begin()  # as ctx.transaction() opens it
        conn.execute("CREATE TABLE effects (n INTEGER)")
        busy, outcome = threading.Event(), []

        def handler_thread():
            busy.set()
            try:
                conn.execute({LONG_QUERY!r}).fetchone()  # closed under it before the fix
                conn.execute("INSERT INTO effects VALUES (1)")
                conn.execute("COMMIT")
                outcome.append("committed")
            except Exception as exc:
                outcome.append(type(exc).__name__ + ": " + str(exc))

        thread = threading.Thread(target=handler_thread)
        thread.start()
        busy.wait(10)
        time.sleep(0.05)
        backend.close()
        thread.join(60)
        print(outcome)
        """,
        str(path),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "['committed']"
    with closing(sqlite3.connect(path)) as check:
        assert check.execute("SELECT n FROM effects").fetchall() == [(1,)]


def test_an_app_closed_while_its_worker_completes_transactions_never_crashes(
    tmp_path: Path,
) -> None:
    """The crash as CI met it: App.close() beside an embedded worker whose handlers
    commit their ctx.transaction() (the worker stopped with no grace, not joined)."""
    done = _run(
        """
        import sqlite3, sys, threading, time
        from contextlib import closing
        import errands

        url = "sqlite:///" + sys.argv[1]
        for round_ in range(20):
            app = errands.App(url)

            @app.job(name="write")
            def write(ctx: errands.Context, n: int) -> int:
                conn = ctx.transaction()
                for _ in range(1 + n % 20):
                    conn.execute("INSERT INTO effects VALUES (?)", (n,))
                return n

            with closing(sqlite3.connect(sys.argv[1])) as setup:
                setup.execute("CREATE TABLE IF NOT EXISTS effects (n INTEGER)")
            app.enqueue_many(write.bind(n=n) for n in range(60))
            worker = app.worker(concurrency=8, grace=0.0)
            thread = threading.Thread(target=worker.run, daemon=True)
            thread.start()
            time.sleep(0.05 + (round_ % 5) * 0.1)
            worker.stop()
            app.close()  # the worker may still be completing jobs
            thread.join(30)
        print("ok")
        """,
        str(tmp_path / "store.db"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


def test_closing_an_in_memory_store_under_a_running_worker_never_crashes() -> None:
    done = _run(
        """
        import logging, threading, time
        import errands

        logging.basicConfig(level=logging.CRITICAL)
        for round_ in range(6):
            app = errands.App("sqlite:///:memory:")

            @app.job(name="noop")
            def noop(n: int) -> int:
                return n

            app.enqueue_many(noop.bind(n=n) for n in range(3000))
            worker = app.worker(concurrency=8, grace=0.0)
            thread = threading.Thread(
                target=worker.run, kwargs={"install_signals": False}, daemon=True
            )
            thread.start()
            time.sleep(0.1 + (round_ % 5) * 0.05)
            app.close()  # the worker is in calls on the store's one connection
            time.sleep(0.05)
            worker.stop()
            thread.join(30)
            app.close()
        print("ok")
        """
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


def test_an_interrupt_just_after_begin_leaves_no_write_transaction_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C landing once BEGIN IMMEDIATE took the file's write lock, before the
    block ran: the transaction is rolled back, and the file is free for every writer
    (it stayed locked: "database is locked" for other processes, "cannot start a
    transaction within a transaction" for this thread, for good)."""
    from errands.backends.sqlite.backend import SQLiteBackend

    path = tmp_path / "store.db"
    backend = SQLiteBackend(f"sqlite:///{path}?write_timeout=2")
    begin = backend._begin

    def begin_then_interrupt(conn: sqlite3.Connection, timeout: float | None = None) -> None:
        begin(conn, timeout)
        raise KeyboardInterrupt

    monkeypatch.setattr(backend, "_begin", begin_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        backend.job_insert_many([request()])
    monkeypatch.undo()
    backend.job_insert_many([request()])  # this thread can write again
    other = sqlite3.connect(path, isolation_level=None, timeout=1)
    other.execute("BEGIN IMMEDIATE")  # and so can another connection
    other.execute("ROLLBACK")
    other.close()
    backend.close()


def test_a_child_forked_while_a_thread_waits_for_the_write_lock_can_write(
    tmp_path: Path,
) -> None:
    """The store's locks are the child's own after a fork: one a parent's thread held at
    the fork stayed held in the child, whose every write then raised DatabaseBusy. (A
    fork in the middle of SQLite's own write transaction is SQLite's to refuse: fork
    before opening the store, or between its writes.)"""
    done = _run(
        """
        import os, sys, threading
        from errands.backends.sqlite.backend import SQLiteBackend
        from tests.conformance.support import request

        backend = SQLiteBackend("sqlite:///" + sys.argv[1] + "?write_timeout=3")
        backend.job_insert_many([request()])
        assert backend._writer.acquire()  # a thread of the parent's, between two writes
        pid = os.fork()
        if pid == 0:
            try:
                backend.job_insert_many([request()])
            except BaseException as exc:
                print("child:", type(exc).__name__, exc, flush=True)
                os._exit(1)
            os._exit(0)
        backend._writer.release()
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status))
        """,
        str(tmp_path / "store.db"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "child exit 0" in done.stdout, done.stdout


def test_a_finished_threads_connection_is_closed_with_the_thread(tmp_path: Path) -> None:
    """A thread per request (a web server's): each thread's connection closes when the
    thread ends (they stayed open, two file descriptors each, until a garbage collection
    that a busy server may not run before it runs out of descriptors)."""
    import gc

    from errands.backends.sqlite.backend import SQLiteBackend

    backend = SQLiteBackend(f"sqlite:///{tmp_path / 'store.db'}")
    gc.disable()  # the connections must close without a collection
    try:
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(50):
            thread = threading.Thread(target=lambda: backend.job_insert_many([request()]))
            thread.start()
            thread.join()
        after = len(os.listdir("/proc/self/fd"))
    finally:
        gc.enable()
        backend.close()
    assert after - before < 10, (before, after)


def test_opening_an_up_to_date_store_does_not_wait_for_the_write_lock(tmp_path: Path) -> None:
    """Another connection holds the file's write lock (a long transaction, a handler's
    ctx.transaction()): opening the store reads its schema version and is ready at once
    (it waited for the write lock, and raised DatabaseBusy after write_timeout)."""
    from errands.backends.sqlite.backend import SQLiteBackend

    path = tmp_path / "store.db"
    SQLiteBackend(f"sqlite:///{path}").close()  # migrated
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        backend = SQLiteBackend(f"sqlite:///{path}?write_timeout=2")
        backend.schema_check()
        backend.close()
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_a_threads_connection_outliving_its_store_is_closed_when_the_store_is_collected(
    tmp_path: Path,
) -> None:
    """A thread that lives on after the store is closed (a hook lane's, an executor's)
    keeps its connection: close() never closes another thread's, which may be in a call
    on it. Once the store is collected, that connection is closed (it was left to the
    garbage collector, which Python 3.13 warns of: sqlite3's 'unclosed database')."""
    import gc

    from errands.backends.sqlite.backend import SQLiteBackend

    stores = [SQLiteBackend(f"sqlite:///{tmp_path / 'store.db'}")]
    used, leave = threading.Event(), threading.Event()
    conns: list[sqlite3.Connection] = []

    def lane() -> None:
        stores[0].job_insert_many([request()])
        conns.append(stores[0]._conn())
        used.set()
        leave.wait(30)

    thread = threading.Thread(target=lane, daemon=True)
    thread.start()
    try:
        assert used.wait(10)
        stores.pop().close()
        gc.collect()
        [conn] = conns
        with pytest.raises(sqlite3.ProgrammingError, match="closed database"):
            conn.execute("SELECT 1")
    finally:
        leave.set()
        thread.join(10)


def test_an_abandoned_transactions_connection_is_closed_once_its_handler_lets_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An abandoned handler's ctx.transaction() connection is rolled back at once but
    closed only when nothing refers to it any more (the handler may be in a call on it
    until then); closed then, not left to sqlite3's collection, which Python 3.13 warns
    of ('unclosed database')."""
    import gc
    import time
    import warnings

    from errands.backends.sqlite.backend import SQLiteBackend

    backend = SQLiteBackend(f"sqlite:///{tmp_path / 'store.db'}")
    unraisable: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(repr(u.exc_value)))
    conn = backend.tx_begin()
    conn.execute("CREATE TABLE effects (n INTEGER)")
    backend.tx_abandon(conn)
    deadline = time.monotonic() + 10
    while conn.in_transaction or any(t.name == "errands-tx-abandon" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the abandoned transaction was never rolled back"
        time.sleep(0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)  # raised: an unraisable exception
        del conn  # the handler lets go
        gc.collect()
    backend.close()
    assert unraisable == []


def test_a_forked_child_never_closes_the_connections_it_inherited(tmp_path: Path) -> None:
    """A child forked from a process using the store opens its own connections, and the
    parent's (the forking thread's, another thread's, whose thread-locals the fork
    clears) are kept for the child's life, never closed: SQLite's docs forbid carrying a
    connection across fork(), and closing one in the child released the child's own
    POSIX locks on the file. They were closed in the child (or left to its garbage
    collector)."""
    done = _run(
        """
        import gc, os, sys, threading
        from errands.backends.sqlite import backend as module
        from tests.conformance.support import request

        store = module.SQLiteBackend("sqlite:///" + sys.argv[1])
        store.job_insert_many([request()])
        parents = {id(store._conn())}  # ids: a reference would keep them from the child
        ready, leave = threading.Event(), threading.Event()

        def other():
            store.job_insert_many([request()])
            parents.add(id(store._conn()))
            ready.set()
            leave.wait(30)

        threading.Thread(target=other, daemon=True).start()
        assert ready.wait(10)
        pid = os.fork()
        if pid == 0:
            store.job_insert_many([request()])  # on a connection of the child's own
            gc.collect()
            kept = parents <= {id(c) for c in module._INHERITED}
            own = id(store._conn()) not in parents
            print("child: inherited kept", len(parents) == 2 and kept, "own", own, flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        store.job_insert_many([request()])  # the parent's connections work on
        leave.set()
        print("child exit", os.waitstatus_to_exitcode(status), flush=True)
        """,
        str(tmp_path / "store.db"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "child: inherited kept True own True" in done.stdout, (done.stdout, done.stderr)
    assert "child exit 0" in done.stdout
    assert "Exception ignored" not in done.stderr, done.stderr[-3000:]


def test_an_in_memory_store_dropped_unclosed_closes_its_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An in-memory store collected without close() (or whose close() could not wait for
    a call on its connection to end) closes that connection once nothing refers to it,
    as a file store closes its threads' connections (it was left to sqlite3's collection,
    which Python 3.13 warns of: 'unclosed database')."""
    import gc
    import warnings

    from errands.backends.sqlite.backend import SQLiteBackend

    unraisable: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(repr(u.exc_value)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)  # raised: an unraisable exception
        SQLiteBackend("sqlite:///:memory:").job_insert_many([request()])
        gc.collect()
    assert unraisable == []
