"""errands.contrib.fastapi: the lifespan (App on app.state, embedded worker, migrations,
an inner lifespan), the ErrandsApp dependency and the dashboard mount."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

pytest.importorskip("fastapi")

from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

import errands
from errands.contrib.fastapi import ErrandsApp, lifespan, mount_dashboard


def make_api(app: errands.App, **options: Any) -> FastAPI:
    api = FastAPI(lifespan=lifespan(app, **options))

    @api.post("/add")
    def add(a: int, b: int, jobs: ErrandsApp) -> dict[str, Any]:
        handle = jobs.registry["add"].enqueue(a=a, b=b)
        return {"id": handle.id}

    @api.get("/jobs/{job_id}")
    def job(job_id: int, jobs: ErrandsApp) -> dict[str, Any]:
        found = jobs.get_job(job_id)
        return {"state": str(found.state), "result": found.result}

    return api


def register_add(app: errands.App) -> None:
    @app.job(name="add")
    def add(a: int, b: int) -> int:
        return a + b


def wait_state(client: TestClient, job_id: int, state: str) -> dict[str, Any]:
    deadline = time.monotonic() + 20
    while (body := client.get(f"/jobs/{job_id}").json())["state"] != state:
        assert time.monotonic() < deadline, body
        time.sleep(0.02)
    return body


def test_the_embedded_worker_runs_jobs_and_stops_with_the_app(db_url: str) -> None:
    app = errands.App(db_url)
    register_add(app)
    api = make_api(app, worker=True, migrate=True, poll_interval=0.05, grace=2)
    with TestClient(api) as client:
        assert api.state.errands is app
        worker = api.state.errands_worker
        assert worker.running
        job_id = client.post("/add", params={"a": 2, "b": 3}).json()["id"]
        assert wait_state(client, job_id, "completed")["result"] == 5
    assert not worker.running


def test_no_worker_by_default(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ERRANDS_EMBEDDED_WORKER", raising=False)
    app = errands.App(db_url)
    register_add(app)
    with TestClient(make_api(app)) as client:
        job_id = client.post("/add", params={"a": 1, "b": 1}).json()["id"]
        time.sleep(0.2)
        assert client.get(f"/jobs/{job_id}").json()["state"] == "available"


def test_the_environment_turns_the_worker_on(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ERRANDS_EMBEDDED_WORKER", "1")
    app = errands.App(db_url)
    register_add(app)
    api = make_api(app, poll_interval=0.05, grace=2)
    with TestClient(api) as client:
        job_id = client.post("/add", params={"a": 4, "b": 4}).json()["id"]
        assert wait_state(client, job_id, "completed")["result"] == 8


def test_an_inner_lifespan_runs_inside_and_keeps_its_state(db_url: str) -> None:
    events: list[str] = []

    @asynccontextmanager
    async def inner(api: FastAPI) -> AsyncIterator[dict[str, Any]]:
        events.append("start")
        yield {"greeting": "hello"}
        events.append("stop")

    api = FastAPI(lifespan=lifespan(errands.App(db_url), worker=False, inner=inner))

    @api.get("/")
    def index(request: Request) -> dict[str, str]:
        return {"greeting": request.state.greeting}

    with TestClient(api) as client:
        assert client.get("/").json() == {"greeting": "hello"}
    assert events == ["start", "stop"]


def test_the_dependency_explains_a_missing_lifespan() -> None:
    api = FastAPI()

    @api.get("/")
    def index(jobs: ErrandsApp) -> str:
        return repr(jobs)

    with (
        TestClient(api, raise_server_exceptions=True) as client,
        pytest.raises(errands.ConfigurationError, match="lifespan"),
    ):
        client.get("/")


def test_a_bad_worker_option_fails_startup(db_url: str) -> None:
    api = FastAPI(lifespan=lifespan(errands.App(db_url), worker=True, concurrency=0))
    with pytest.raises(errands.ConfigurationError), TestClient(api):
        pass


def test_the_dashboard_mounts_under_a_path(db_url: str) -> None:
    pytest.importorskip("errands.dashboard", exc_type=ImportError)
    app = errands.App(db_url)
    app.migrate()
    api = FastAPI(lifespan=lifespan(app, worker=False))
    mount_dashboard(api, app, path="/admin/jobs/", user=lambda request: "tester")
    with TestClient(api) as client:
        page = client.get("/admin/jobs/")
        assert page.status_code == 200
        assert "/admin/jobs/static/" in page.text  # its own URLs carry the mount path
        assert client.get("/admin/jobs/static/dashboard.css").status_code == 200
