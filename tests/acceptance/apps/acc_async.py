"""An app whose every job is ``async def``: its workers prefetch, the jobs beyond -c
waiting on the event loop for a slot (tests/acceptance/test_suspects.py)."""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path

import errands

app = errands.App()


@app.job(name="async_quick")
async def async_quick(n: int) -> int:
    return n


@app.job(name="async_hold", lease=30)
async def async_hold(folder: str) -> int:
    """Marks itself running in ``folder`` until ``folder/release`` exists."""
    here = Path(folder)
    marker = here / f"running-{os.getpid()}-{secrets.token_hex(4)}"
    marker.touch()
    try:
        while not (here / "release").exists():
            await asyncio.sleep(0.01)
    finally:
        marker.unlink()
    return os.getpid()
