"""A real ``errands worker`` process as a new user starts it: from a folder with no
database yet, serving some of the app's queues."""

from __future__ import annotations

import signal
import textwrap

from .harness import WORKER_FLAGS, Cluster

SHOP = """
import errands

app = errands.App("sqlite:///shop.db")


@app.job(queue="emails")
def send_receipt(order_id: int) -> None: ...


@app.periodic("*/5 * * * *", name="reconcile")
def reconcile() -> None: ...
"""


def test_a_worker_shows_the_absolute_sqlite_path_warns_of_a_new_file_and_unserved_cron(
    cluster: Cluster,
) -> None:
    (cluster.folder / "fh_startup.py").write_text(textwrap.dedent(SHOP))
    worker = cluster.spawn(["worker", "fh_startup:app", "-q", "emails", *WORKER_FLAGS])
    text = worker.wait_log(r"worker w-[0-9a-f]+ started", timeout=20)
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit(15) == 0

    database = cluster.folder / "shop.db"
    assert f"warning: there is no database at {database} yet" in text
    assert f"store sqlite:///{database}" in text  # the start-up line: absolute, not shop.db
    assert (
        "periodic job(s) reconcile run in queue default, which this worker (-q emails) and "
        "no other live worker serves"
    ) in text


def test_a_second_worker_on_the_same_file_does_not_warn_of_a_new_file(cluster: Cluster) -> None:
    (cluster.folder / "fh_startup2.py").write_text(textwrap.dedent(SHOP))
    first = cluster.spawn(["worker", "fh_startup2:app", *WORKER_FLAGS], "first")
    first.wait_log(r"worker w-[0-9a-f]+ started", timeout=20)
    second = cluster.spawn(["worker", "fh_startup2:app", *WORKER_FLAGS], "second")
    text = second.wait_log(r"worker w-[0-9a-f]+ started", timeout=20)
    for proc in (first, second):
        proc.signal(signal.SIGTERM)
        assert proc.wait_exit(15) == 0
    assert "no database at" not in text
    assert "periodic job" not in text  # it serves every queue of the app, default included
