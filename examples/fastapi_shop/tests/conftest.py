"""The shop's tests run on a fresh SQLite file (SHOP_DATABASE_URL, set before the shop's
modules are imported), or on PostgreSQL when SHOP_TEST_DATABASE_URL names one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

_folder = tempfile.mkdtemp(prefix="fastapi-shop-")
os.environ["SHOP_DATABASE_URL"] = os.environ.get(
    "SHOP_TEST_DATABASE_URL", f"sqlite:///{Path(_folder) / 'shop.db'}"
)
os.environ["SHOP_ADMIN_TOKEN"] = "test-admin-token"

from fastapi.testclient import TestClient  # noqa: E402
from shop.main import api  # noqa: E402


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    """The app with no worker: jobs wait in the queue."""
    monkeypatch.setenv("ERRANDS_EMBEDDED_WORKER", "0")
    with TestClient(api) as test_client:
        yield test_client


@pytest.fixture
def client_with_worker(monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    """The app with an embedded worker, as in development (ERRANDS_EMBEDDED_WORKER=1)."""
    monkeypatch.setenv("ERRANDS_EMBEDDED_WORKER", "1")
    with TestClient(api) as test_client:
        yield test_client
