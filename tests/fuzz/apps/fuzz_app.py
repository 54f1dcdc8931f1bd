"""A small app for the bad-input and secrets tests; the store comes from ``ERRANDS_URL``."""

from __future__ import annotations

from typing import Any

import errands
from errands import Context

app = errands.App()


@app.job(name="fuzz.echo", retries=0)
def echo(text: str, n: int = 0) -> str:
    return f"{text}:{n}"


@app.job(name="fuzz.sign_in", sensitive={"password", "credentials"})
def sign_in(user: str, password: str, credentials: dict[str, Any], ctx: Context) -> dict[str, Any]:
    """Succeeds, and carelessly returns (and checkpoints) the secrets it was given."""
    session = ctx.step("session", lambda: {"user": user, "token": credentials["token"]})
    return {"user": user, "echo": f"signed in with {password}", "session": session}


@app.job(name="fuzz.login", retries=0, sensitive={"password", "credentials"})
def login(user: str, password: str, credentials: dict[str, Any] | None = None) -> None:
    """Fails quoting every secret it was given, as careless code does."""
    token = (credentials or {}).get("token", "")
    raise ConnectionError(f"login refused for {user} with password {password} and token {token}")
