"""procrastinate's side of the benchmark: one async no-op task with one int argument."""

import os

import _probe
import procrastinate

app = procrastinate.App(
    connector=procrastinate.PsycopgConnector(conninfo=os.environ.get("BENCH_PG_URL", ""))
)


@app.task(name="noop", queue="bench")
async def noop(n: int) -> None:
    _probe.hit(n)
    await _probe.awork()
