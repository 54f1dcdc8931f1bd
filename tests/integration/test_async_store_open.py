"""The first async calls open the store once, on a thread of their own (App.abackend):
the event loop never waits for it, and neither does the loop's default executor."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import errands
import errands.app as app_module

CALLS: dict[str, Callable[[errands.App, Any, int], Awaitable[Any]]] = {
    "aenqueue": lambda app, job, n: job.aenqueue(n=n),
    "aget_job": lambda app, job, n: app.aget_job(n + 1),
    "asignal": lambda app, job, n: app.asignal(n + 1, "go"),
    "acancel": lambda app, job, n: app.acancel(n + 1),
    "aresult": lambda app, job, n: errands.JobHandle(app, n + 1, "open.first").aresult(timeout=0.1),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_many_first_async_calls_leave_the_loops_executor_free_while_the_store_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    """Given a store slow to open and 40 first async calls at once, the loop's default
    executor still runs other work: each call took an executor thread that then waited
    behind the first one's opening, and with min(32, cores + 4) threads none was left
    (for the loop's getaddrinfo, aget_job, asyncio.to_thread). The store opens once."""
    gate = threading.Event()
    opens: list[str] = []
    real_open = app_module.open_backend

    def slow_open(url: str, **options: Any) -> Any:
        opens.append(url)
        gate.wait(30)  # a database that accepts connections and answers late
        return real_open(url, **options)

    monkeypatch.setattr(app_module, "open_backend", slow_open)
    app = errands.App(f"sqlite:///{tmp_path / 'slow.db'}")

    @app.job(name="open.first")
    def first(n: int) -> None: ...

    async def main() -> list[Any]:
        loop = asyncio.get_running_loop()
        tasks = [asyncio.create_task(CALLS[call](app, first, n)) for n in range(40)]
        await asyncio.sleep(0.2)  # every call has started and waits for the store
        try:
            free = await asyncio.wait_for(loop.run_in_executor(None, lambda: "free"), 10)
        finally:
            gate.set()
        assert free == "free"
        return await asyncio.gather(*tasks, return_exceptions=True)

    try:
        answers = asyncio.run(main())
        assert len(opens) == 1  # opened once for all of them
        if call == "aenqueue":
            assert sorted(h.job().args["n"] for h in answers) == list(range(40))
        else:  # no such jobs: each call answered, none stuck
            assert len(answers) == 40
            assert not [
                a
                for a in answers
                if isinstance(a, BaseException) and not isinstance(a, errands.ErrandsError)
            ]
    finally:
        gate.set()
        app.close()
