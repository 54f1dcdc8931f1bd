"""A process that opened the store and then forks (gunicorn --preload; a web server's
master that enqueued, migrated or started an embedded worker at import; multiprocessing's
fork): each child opens connections of its own, and the parent's go on serving it.

The children shared the parent's pool sockets: their messages interleaved on the wire,
enqueues failed with protocol errors ("server sent data without prior row description",
DuplicatePreparedStatement) or hung 30 s waiting for a pool connection that no thread of
the child would open, and jobs were lost (150 of 901 enqueues stored). Each script runs in
a process of its own (real os.fork, real connections), so the test process forks nothing.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="no os.fork on Windows")


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],  # the repository (tests.* importable)
    )


def test_children_forked_after_the_store_was_used_store_every_job_and_leave_the_parents_connections_alone(  # noqa: E501
    pg_url: str,
) -> None:
    """The parent enqueues (its statements prepared by psycopg on its connections) and
    opens its handler pool, then forks three children; each enqueues 60 jobs one by one
    and a batch of 20, opens a ctx.transaction() connection, and closes its App (which
    must close nothing of the parent's). One child first forks a grandchild that
    enqueues before the child has used the store. Every job is stored, under the id its enqueue
    returned; no child fails; the parent's server sessions are the same ones afterwards
    (no Terminate was sent on them) and the parent goes on enqueuing."""
    done = _run(
        """
        import os, signal, sys
        import psycopg
        import errands
        from errands.backends.postgres import backend as module

        app = errands.App(sys.argv[1])

        @app.job(name="j", queue="q")
        def j(n: int) -> None: ...

        backend = app.backend
        for n in range(10):  # past psycopg's prepare threshold on the parent's connections
            j.enqueue(n=-1 - n)
        tx = backend.tx_begin()  # the handler pool, open in the parent too
        backend.tx_rollback(tx)
        sessions = set()  # the parent's server sessions, held at once
        with backend._conn() as a, backend._conn() as b:
            sessions = {a.info.backend_pid, b.info.backend_pid}
        parent_pools = {id(backend.pool), id(backend._handler_pool)}
        kids = []
        for k in range(3):
            pid = os.fork()
            if pid == 0:
                signal.alarm(120)  # a hung child fails the test instead of hanging it
                if k == 0:  # forks again before its first use of the store
                    grandchild = os.fork()
                    if grandchild == 0:
                        try:
                            j.enqueue(n=50_000)
                        except BaseException as exc:
                            print(f"grandchild: {type(exc).__name__}: {exc}", flush=True)
                            os._exit(1)
                        os._exit(0)
                    code = os.waitstatus_to_exitcode(os.waitpid(grandchild, 0)[1])
                    print("grandchild exit", code, flush=True)
                try:
                    ids = [(k * 1000 + i, j.enqueue(n=k * 1000 + i).id) for i in range(60)]
                    batch = [j.bind(n=k * 1000 + 100 + i) for i in range(20)]
                    handles = app.enqueue_many(batch)
                    ids += [(k * 1000 + 100 + i, h.id) for i, h in enumerate(handles)]
                    tx = backend.tx_begin()
                    backend.tx_rollback(tx)
                    own = {id(backend.pool), id(backend._handler_pool)}
                    kept = parent_pools <= {id(p) for p in module._INHERITED}
                    app.close()
                    with psycopg.connect(backend.config.conninfo) as c:
                        rows = dict(c.execute(
                            f'SELECT id, (args->>%s)::int FROM "{backend.schema}".errands_jobs '
                            "WHERE id = ANY(%s)", ("n", [i for _, i in ids])).fetchall())
                    right = all(rows.get(i) == n for n, i in ids)
                    print(f"child {k}: {len(ids)} ids, stored right {right}, own pools "
                          f"{not own & parent_pools}, parent's kept {kept}", flush=True)
                except BaseException as exc:
                    print(f"child {k}: {type(exc).__name__}: {exc}", flush=True)
                    os._exit(1)
                os._exit(0)
            kids.append(pid)
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in kids]
        print("children exit", codes, flush=True)
        with psycopg.connect(backend.config.conninfo) as c:
            alive = {r[0] for r in c.execute(
                "SELECT pid FROM pg_stat_activity WHERE pid = ANY(%s)", (list(sessions),))}
            total = c.execute(f'SELECT count(*) FROM "{backend.schema}".errands_jobs').fetchone()[0]
        print("parent sessions alive", alive == sessions, flush=True)
        after = j.enqueue(n=99_999)
        with backend._conn() as a, backend._conn() as b:
            same = {a.info.backend_pid, b.info.backend_pid} == sessions
        print("parent enqueues after", app.get_job(after.id).args == {"n": 99_999}, "same", same)
        print("jobs stored", total)
        app.close()
        """,
        pg_url,
    )
    out = done.stdout
    assert done.returncode == 0, (out, done.stderr[-3000:])
    for k in range(3):
        assert f"child {k}: 80 ids, stored right True, own pools True, parent's kept True" in out, (
            out,
            done.stderr[-3000:],
        )
    assert "children exit [0, 0, 0]" in out, out
    assert "parent sessions alive True" in out, out
    assert "parent enqueues after True same True" in out, out
    assert "grandchild exit 0" in out, out
    assert "jobs stored 251" in out, out  # 10 of the parent's, 80 of each child's, 1


def test_a_child_forked_after_a_result_wait_is_woken_by_a_watcher_of_its_own(
    pg_url: str,
) -> None:
    """The parent waited for a result (its LISTEN watcher started), then forked. The
    watcher's thread is not the child's, yet its "listening" flag was copied set: the
    child's waits took the store for pushing and slept until their recheck (30 s) or
    their timeout. The child starts its own watcher and is woken by the job's end; the
    parent's watcher goes on waking the parent's waits."""
    done = _run(
        """
        import os, signal, sys, threading, time
        import psycopg
        import errands

        app = errands.App(sys.argv[1])

        @app.job(name="j", queue="q")
        def j(n: int) -> None: ...

        backend = app.backend
        table = f'"{backend.schema}".errands_jobs'

        def end_it(job_id):  # as an operator's cancel from another process: the trigger NOTIFYs
            # once the wait is registered: a cancel committed before the wait's first read
            # ended it with no wake-up (the wait read the job ended), and "woken" was False
            deadline = time.monotonic() + 30
            while not app.results._by_job.get(job_id) and time.monotonic() < deadline:
                time.sleep(0.005)
            with psycopg.connect(backend.config.conninfo, autocommit=True) as c:
                c.execute(f"UPDATE {table} SET state = 'cancelled', finished_at = now() "
                          "WHERE id = %s", (job_id,))

        def wait_woken(who):
            hub = app.results
            print(who, "listening", hub.ready(wait=60), flush=True)
            before = hub.wakeups
            handle = j.enqueue(n=1)
            threading.Thread(target=end_it, args=(handle.id,)).start()
            try:
                handle.result(timeout=60)
            except errands.JobCancelled:
                pass
            print(who, "woken", hub.wakeups > before, flush=True)
            return hub

        parent_watcher = id(wait_woken("parent")._watcher)
        pid = os.fork()
        if pid == 0:
            signal.alarm(120)
            hub = wait_woken("child")
            print("child own watcher", id(hub._watcher) != parent_watcher, flush=True)
            os._exit(0)
        print("child exit", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
        wait_woken("parent after")
        app.close()
        """,
        pg_url,
    )
    out = done.stdout
    assert done.returncode == 0, (out, done.stderr[-3000:])
    for who in ("parent", "child", "parent after"):
        assert f"{who} listening True" in out, (out, done.stderr[-3000:])
        assert f"{who} woken True" in out, (out, done.stderr[-3000:])
    assert "child own watcher True" in out, out
    assert "child exit 0" in out, out
