"""huey's side of the SQLite comparison (SqliteHuey storage)."""

import os

import _probe
from huey import SqliteHuey

huey = SqliteHuey("bench", filename=os.environ.get("BENCH_SQLITE_PATH", "bench-huey.db"))


@huey.task()
def noop(n: int) -> None:
    _probe.hit(n)
    _probe.work()
