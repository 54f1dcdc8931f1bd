"""The public API type-checks in a user's project: errands ships ``py.typed``, and a small
typed user module (sync and async calls, a Context, handles) passes mypy — and pyright,
when it is installed — with the errands package as installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import errands
from tests.pg import unavailable

USER_MODULE = """
from __future__ import annotations

import asyncio
from datetime import timedelta

import errands

app = errands.App("sqlite:///typed.db")


@app.job(queue="mail", retries=2)
def send(ctx: errands.Context, user_id: int, email: str) -> str:
    ctx.progress(0.5, "half way")
    sent: str = ctx.step("send", lambda: f"{user_id}:{email}")
    approval = ctx.wait_for_signal("approved", timeout=timedelta(days=2))
    return f"{sent}:{approval}"


def sync_side() -> int:
    handle: errands.JobHandle = send.enqueue(user_id=1, email="a@b.c", key="k")
    state: errands.JobState = handle.status()
    job: errands.Job = app.get_job(handle.id)
    handles: list[errands.JobHandle] = app.enqueue_many([send.bind(user_id=2, email="x")])
    errands.wait_all(handles, timeout=1.0)
    for done in errands.as_completed(handles, timeout=1.0):
        print(done.id)
    progress: errands.Progress | None = handle.progress()
    print(state, job.attempt, progress)
    return handle.id


async def async_side() -> int:
    handle = await send.aenqueue(user_id=1, email="a@b.c", delay=timedelta(seconds=1))
    state: errands.JobState = await handle.astatus()
    job: errands.Job = await app.aget_job(handle.id)
    many: list[errands.JobHandle] = await app.aenqueue_many([send.bind(user_id=3, email="y")])
    ended: list[errands.JobHandle] = await errands.await_all(many, timeout=1.0)
    async for done in errands.as_completed(ended, timeout=1.0):
        print(done.id)
    flow = await app.aenqueue_workflow(errands.chain(send.bind(user_id=4, email="z")))
    settled: errands.WorkflowStatus = await flow.await_(timeout=1.0)
    outputs: dict[str, object] = await flow.aresult(timeout=1.0)
    print(settled.state, outputs, (await flow.astatus()).pending, await flow.acancel())
    try:
        result = await handle.aresult(timeout=30)
    except (errands.JobFailed, errands.JobCancelled, errands.ResultTimeout):
        result = None
    signalled: errands.SignalResult = app.signal(handle.id, "approved", {"by": "ops"})
    await handle.acancel()
    print(state, job.state, many, result, signalled.resumed)
    return handle.id


if __name__ == "__main__":
    asyncio.run(async_side())
"""


def _package_root() -> Path:
    return Path(errands.__file__).resolve().parent


def test_errands_ships_py_typed() -> None:
    """The marker that tells type checkers to read errands' own annotations is shipped."""
    assert (_package_root() / "py.typed").is_file()


@pytest.fixture
def user_project(tmp_path: Path) -> Path:
    (tmp_path / "user_app.py").write_text(USER_MODULE, encoding="utf-8")
    return tmp_path


def test_a_typed_user_module_passes_mypy_and_pyright(user_project: Path) -> None:
    """mypy --strict and pyright (the dev extra installs it) report no error on a user
    module using the sync and async API; both run at once to keep the suite quick."""
    checks = {
        "mypy": [sys.executable, "-m", "mypy", "--strict", "--no-incremental",
                 "--cache-dir", os.devnull, "user_app.py"],
    }  # fmt: skip
    pyright = shutil.which("pyright", path=str(Path(sys.executable).parent))
    if pyright is not None:
        (user_project / "pyrightconfig.json").write_text(
            '{"pythonVersion": "3.11", "typeCheckingMode": "standard"}', encoding="utf-8"
        )
        checks["pyright"] = [pyright, "--pythonpath", sys.executable, "user_app.py"]
    running = {
        name: subprocess.Popen(
            argv, cwd=user_project, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for name, argv in checks.items()
    }
    for name, process in running.items():
        output, _ = process.communicate(timeout=240)
        assert process.returncode == 0, f"{name}:\n{output}"
    if pyright is None:
        unavailable("mypy passed; pyright is not installed (pip install pyright; make test does)")
