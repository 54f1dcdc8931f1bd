"""The backend Django's own tests/tasks run against (upstream.py): ``ErrandsBackend``
itself, plus the two helpers of Django's ``DummyBackend`` those tests call to look at
what was enqueued, read from errands' table through Django's connection."""

from __future__ import annotations

from typing import Any

from django.db import connections

from errands.contrib.django import ErrandsBackend
from errands.contrib.django.test import clear_jobs


class ErrandsBackendForDjangoTests(ErrandsBackend):
    @property
    def results(self) -> list[Any]:
        """Every task result stored by this backend, oldest first (as DummyBackend's)."""
        with connections[self.database].cursor() as cursor:
            cursor.execute("SELECT id FROM errands_jobs ORDER BY id")
            ids = [row[0] for row in cursor.fetchall()]
        return [self.get_result(str(job_id)) for job_id in ids]

    def clear(self) -> None:
        clear_jobs()
