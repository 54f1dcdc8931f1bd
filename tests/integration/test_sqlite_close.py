"""Closing a SQLite store while another thread still uses a connection of it.

``App.close()`` can run while a worker's handler thread still completes a job in its
``ctx.transaction()`` (an embedded worker not yet stopped, a test's fixture tearing the
App down). Closing that connection under the thread's running COMMIT freed what the
call was using: the process crashed with SIGSEGV. Each case runs in a child process, so
that a crash is a failed test, not a lost test process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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
    import sqlite3

    with sqlite3.connect(path) as check:
        assert check.execute("SELECT n FROM effects").fetchall() == [(1,)]


@pytest.mark.parametrize("round_", range(3))
def test_an_app_closed_while_its_worker_completes_transactions_never_crashes(
    tmp_path: Path, round_: int
) -> None:
    """The crash as CI met it: App.close() beside an embedded worker whose handlers
    commit their ctx.transaction() (the worker stopped with no grace, not joined)."""
    done = _run(
        """
        import sqlite3, sys, threading, time
        import errands

        url = "sqlite:///" + sys.argv[1]
        for round_ in range(15):
            app = errands.App(url)

            @app.job(name="write")
            def write(ctx: errands.Context, n: int) -> int:
                conn = ctx.transaction()
                for _ in range(1 + n % 20):
                    conn.execute("INSERT INTO effects VALUES (?)", (n,))
                return n

            with sqlite3.connect(sys.argv[1]) as setup:
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
        str(tmp_path / f"store{round_}.db"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
