"""The errands side of the benchmark: one no-op job with one int argument; an ``async
def`` one when BENCH_ASYNC is set (the "async" configuration, as the async peers' are)."""

import os

import _probe

import errands

app = errands.App(os.environ.get("ERRANDS_URL", "sqlite:///bench-errands.db"))


if os.environ.get("BENCH_ASYNC"):

    @app.job(name="bench.noop", queue="bench")
    async def noop(n: int) -> None:
        _probe.hit(n)
        await _probe.awork()

else:

    @app.job(name="bench.noop", queue="bench")
    def noop(n: int) -> None:
        _probe.hit(n)
        _probe.work()
