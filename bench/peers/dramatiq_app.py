"""Dramatiq's side of the benchmark (Redis broker)."""

import os

import _probe
import dramatiq
from dramatiq.brokers.redis import RedisBroker

broker = RedisBroker(url=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/2"))
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name="bench", max_retries=0)
def noop(n: int) -> None:
    _probe.hit(n)
    _probe.work()
