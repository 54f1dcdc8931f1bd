"""Fixtures for the bad-input tests: one store per backend for a whole module.

``store_url`` is parametrised over SQLite and PostgreSQL (PostgreSQL skips with a reason
when no server is reachable, and fails under ``CI=true``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .support import module_pg_url


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def store_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('store')}/errands.db"
    else:
        yield from module_pg_url()
