"""The errands side of the benchmark: one no-op job with one int argument."""

import os

import _probe

import errands

app = errands.App(os.environ.get("ERRANDS_URL", "sqlite:///bench-errands.db"))


@app.job(name="bench.noop", queue="bench")
def noop(n: int) -> None:
    _probe.hit(n)
    _probe.work()
