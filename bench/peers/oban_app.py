"""oban's side of the benchmark: one async no-op worker with one int argument."""

import _probe
from oban import worker


@worker(queue="bench")
class Noop:
    async def process(self, job):  # type: ignore[no-untyped-def]
        _probe.hit(job.args["n"])
        await _probe.awork()
