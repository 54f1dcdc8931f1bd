"""Fixtures for the dashboard: an App with a few job types, dead jobs made without a worker,
and TestClients signed in (or not) through the real login form."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the dashboard extra is not installed")

from starlette.testclient import TestClient

import errands
from errands.dashboard import create_app

from .helpers import BASE_URL, PASSWORD, TOKEN, define_jobs, login


@pytest.fixture(autouse=True)
def _no_dashboard_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "ERRANDS_DASHBOARD_PASSWORD",
        "ERRANDS_DASHBOARD_TOKEN",
        "ERRANDS_DASHBOARD_SECRET",
    ):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def jobs(app: errands.App) -> dict[str, Any]:
    return define_jobs(app)


@pytest.fixture
def make_client(app: errands.App, jobs: dict[str, Any]) -> Iterator[Callable[..., TestClient]]:
    """``make_client(signed_in=True, **create_app_options)``: a client for a new dashboard."""
    clients: list[TestClient] = []

    def make(signed_in: bool = True, user: str = "alice", **options: Any) -> TestClient:
        options.setdefault("password", PASSWORD)
        options.setdefault("token", TOKEN)
        client = TestClient(
            create_app(app, **options), base_url=BASE_URL, client=("127.0.0.1", 50000)
        )
        client.__enter__()
        clients.append(client)
        if signed_in:
            login(client, user=user)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def client(make_client: Callable[..., TestClient]) -> TestClient:
    return make_client()
