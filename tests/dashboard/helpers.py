"""Helpers for the dashboard tests: job types, dead jobs without a worker, signing in."""

from __future__ import annotations

import re
from typing import Any

from starlette.testclient import TestClient

import errands
from errands.backends.base import ClaimParams, FinishParams, QueueClaim

PASSWORD = "correct horse battery staple"
TOKEN = "tok-" + "x" * 28
BASE_URL = "http://127.0.0.1:8080"
XSS = "<script>alert('xss')</script>"
EMAIL = "alice.secret@example.com"


def define_jobs(app: errands.App) -> dict[str, Any]:
    """The job types the dashboard tests enqueue."""

    @app.job(name="emails.send_welcome", queue="emails", sensitive={"email"}, retries=0)
    def send_welcome(user_id: int, email: str) -> None:
        raise ConnectionError(f"mail server refused {email}")

    @app.job(name="billing.charge", queue="payments", retries=0)
    def charge(order_id: int, note: str = "") -> str:
        return f"charged {order_id}"

    return {"send_welcome": send_welcome, "charge": charge}


def finish_due(
    app: errands.App, queue: str, state: str, *, message: str = "boom", limit: int = 100
) -> list[int]:
    """Claim every due job of ``queue`` and record ``state`` for it (no worker needed),
    as a worker claims it: a queue with limits or fairness through the limited claim (the
    plain one never takes such a queue)."""
    if app.backend.queues_with_limits([queue]):
        rows = list(app.backend.job_claim_limited(QueueClaim(queue, limit), "test-worker", 30))
    else:
        rows = app.backend.job_claim(
            ClaimParams(
                queues=[QueueClaim(queue, limit)],
                limit=limit,
                worker_id="test-worker",
                lease_seconds_default=30,
            )
        )
    outcomes = []
    for row in rows:
        error = None
        result = None
        if state != "completed":
            error = {
                "attempt": row.attempt,
                "type": "ConnectionError",
                "message": message,
                "traceback": f"Traceback (most recent call last):\nConnectionError: {message}",
                "worker": "test-worker",
                "kind": "transient",
            }
        else:
            result = '"ok"'
        outcomes.append(
            FinishParams(row.id, row.lease_token or "", state, result_json=result, error=error)  # type: ignore[arg-type]
        )
    assert all(app.backend.job_finish_many(outcomes))
    return [row.id for row in rows]


def dead_job(app: errands.App, jobs: dict[str, Any], **args: Any) -> int:
    """One dead ``emails.send_welcome`` job whose error quotes its (sensitive) email."""
    handle = jobs["send_welcome"].enqueue(**{"user_id": 1, "email": EMAIL, **args})
    assert finish_due(app, "emails", "dead", message=f"mail server refused {EMAIL}") == [handle.id]
    return handle.id


def csrf_of(html: str) -> str:
    match = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert match, "no CSRF token in the page"
    return match.group(1)


def login(client: TestClient, secret: str = PASSWORD, user: str = "alice") -> TestClient:
    page = client.get("/login")
    assert page.status_code == 200
    response = client.post(
        "/login",
        data={"csrf_token": csrf_of(page.text), "secret": secret, "user": user, "next": "/"},
        follow_redirects=False,
    )
    assert response.status_code == 303, response.text
    return client


def post(client: TestClient, path: str, data: dict[str, Any] | None = None, page: str = "/") -> Any:
    """POST like the browser: with the CSRF token of a page just loaded."""
    token = csrf_of(client.get(page).text)
    return client.post(path, data={"csrf_token": token, **(data or {})}, follow_redirects=False)
