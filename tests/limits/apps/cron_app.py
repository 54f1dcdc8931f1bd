"""Periodic jobs for ``errands cron list`` in tests/limits (the store from ERRANDS_URL)."""

from __future__ import annotations

import errands

app = errands.App()


@app.periodic("*/5 * * * *", tz="Europe/Paris", args={"region": "eu"}, name="reconcile")
def reconcile(region: str) -> str:
    return region


@app.periodic("0 3 * * *", catch_up=True, name="nightly")
def nightly() -> None:
    return None
