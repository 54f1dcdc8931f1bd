"""A cache backend that counts how many of its instances were closed: a job runs in a
context of its own, where the caches it opens are its own, closed at its end as at a
request's (Django's close_caches)."""

from __future__ import annotations

import threading
from typing import Any

from django.core.cache.backends.locmem import LocMemCache

lock = threading.Lock()
closed: list[int] = []  # id() of each instance closed


class CountingCache(LocMemCache):
    def close(self, **kwargs: Any) -> None:
        with lock:
            closed.append(id(self))
        super().close(**kwargs)
