"""End to end in a real headless Chromium: sign in, find a dead job, replay it from the
dead-letter queue, let a worker run it, and see it completed.

The dashboard runs as the real ``errands dashboard`` command (uvicorn) in a subprocess on
a free loopback port; the worker runs in this process on the same SQLite file. Chromium
is Debian's package (``apt-get install chromium``; .ci/run installs it when missing),
driven by Playwright through ``executable_path``: no browser download.
"""

from __future__ import annotations

import importlib
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import running_worker

CHROMIUM = shutil.which("chromium")
# .ci/run installs Debian's chromium beside the suite's start: the file it names is
# written once that is over (installed or not).
INSTALLING = os.environ.get("ERRANDS_CHROMIUM_INSTALL")


def chromium() -> str | None:
    """Debian's chromium, waited for while .ci/run still installs it (90 s at most: the
    suite's first minutes are past when these tests run, and the test's own timeout is
    120 s)."""
    if CHROMIUM is not None or not INSTALLING:
        return CHROMIUM
    deadline = time.monotonic() + 90
    while not os.path.exists(INSTALLING) and time.monotonic() < deadline:
        time.sleep(1)
    return shutil.which("chromium")


CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PASSWORD = "e2e-password-1234"

pytestmark = [
    pytest.mark.skipif(
        CHROMIUM is None
        and not INSTALLING
        and os.environ.get("CI", "").lower() not in ("1", "true", "yes"),
        reason="Debian's chromium is not installed (apt-get install -y chromium)",
    ),
    pytest.mark.timeout(120),
]

APP_MODULE = '''
"""The app the browser test serves: an invoice sync that fails while a flag file exists."""
import os
from pathlib import Path

import errands

app = errands.App(os.environ["ERRANDS_URL"])
DOWN = Path(os.environ["E2E_DOWN_FLAG"])


@app.job(name="billing.sync_invoice", queue="billing", retries=0, sensitive={"api_key"})
def sync_invoice(invoice_id: int, api_key: str) -> str:
    if DOWN.exists():
        raise ConnectionError("accounting system is down")
    return f"invoice {invoice_id} synced"
'''


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def e2e(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    module_name = f"e2e_app_{os.getpid()}_{time.monotonic_ns()}"
    (tmp_path / f"{module_name}.py").write_text(textwrap.dedent(APP_MODULE))
    url = f"sqlite:///{tmp_path}/e2e.db"
    flag = tmp_path / "accounting-down"
    flag.touch()
    monkeypatch.setenv("ERRANDS_URL", url)
    monkeypatch.setenv("E2E_DOWN_FLAG", str(flag))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(module_name)
    module.app.migrate()
    port = free_port()
    env = {
        **os.environ,
        "ERRANDS_DASHBOARD_PASSWORD": PASSWORD,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }
    log = (tmp_path / "dashboard.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "errands", "dashboard", f"{module_name}:app", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: port_open(port) or server.poll() is not None, 30, "the dashboard")
        assert server.poll() is None, (tmp_path / "dashboard.log").read_text()
        yield {"app": module.app, "job": module.sync_invoice, "flag": flag, "port": port}
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
        module.app.close()
        sys.modules.pop(module_name, None)


def test_sign_in_find_a_dead_job_replay_it_and_see_it_completed(e2e: dict[str, Any]) -> None:
    browser_path = chromium()
    if browser_path is None:
        pytest.fail("CI=true but Debian's chromium is missing: apt-get install -y chromium")
    from playwright.sync_api import expect, sync_playwright

    app, flag = e2e["app"], e2e["flag"]
    handle = e2e["job"].enqueue(invoice_id=42, api_key="sk_live_secret_value")
    with running_worker(app):
        wait_until(lambda: app.get_job(handle.id).state.value == "dead", 20, "the job to die")

    base = f"http://127.0.0.1:{e2e['port']}"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=browser_path, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on(
                "console",
                lambda msg: errors.append(msg.text) if msg.type == "error" else None,
            )
            page.goto(base + "/")
            expect(page).to_have_url(f"{base}/login?next=%2F")
            page.fill("input[name=user]", "e2e-operator")
            page.fill("input[name=secret]", PASSWORD)
            page.click("button[type=submit]")
            expect(page.locator(".top .user")).to_have_text("e2e-operator")

            page.click("nav >> text=Dead letters")
            row = page.locator("table.jobs tbody tr", has_text="billing.sync_invoice")
            expect(row).to_have_count(1)
            expect(row).to_contain_text("accounting system is down")
            expect(row).not_to_contain_text("sk_live_secret_value")
            row.locator("input[name=ids]").check()
            page.click("button[value=replay]")
            expect(page.locator(".count-preview")).to_have_text("1")  # the dry run's count
            assert app.get_job(handle.id).state.value == "dead"
            page.click("form.confirm button[type=submit]")
            expect(page.locator(".flash")).to_contain_text("1 job(s) replayed")

            flag.unlink()  # the accounting system is back
            with running_worker(app):
                assert handle.result(timeout=20) == "invoice 42 synced"

            page.click("nav >> text=Jobs")
            page.click(f"table.jobs a[href='/jobs/{handle.id}'] >> nth=0")
            expect(page.locator("h1 .state")).to_have_text("completed")
            expect(page.locator("ol.timeline")).to_contain_text("replay by dashboard:e2e-operator")
            page.click("nav >> text=Audit log")
            expect(page.locator("table tbody tr").first).to_contain_text("dashboard:e2e-operator")
            assert errors == [], errors  # no script errors, no CSP violations
        finally:
            browser.close()


PHONE = {"width": 390, "height": 844}


def test_on_a_390_px_phone_no_page_overflows_and_every_page_has_the_navigation(
    e2e: dict[str, Any],
) -> None:
    """Every page at 390 px: nothing wider than the screen (tables scroll inside their
    card), the navigation on each, a 404 page with it too; a running job's start, runtime
    and worker, and a worker that stopped beating presumed dead."""
    browser_path = chromium()
    if browser_path is None:
        pytest.fail("CI=true but Debian's chromium is missing: apt-get install -y chromium")
    from playwright.sync_api import expect, sync_playwright

    from errands.backends.base import ClaimParams, QueueClaim, WorkerInfo

    app = e2e["app"]
    dead = e2e["job"].enqueue(invoice_id=7, api_key="sk_live_secret_value")
    with running_worker(app):
        wait_until(lambda: app.get_job(dead.id).state.value == "dead", 20, "the job to die")
    running = e2e["job"].enqueue(invoice_id=8, api_key="sk_live_other_secret")
    claim = ClaimParams(
        queues=[QueueClaim("billing", 1)], limit=1, worker_id="w-phone", lease_seconds_default=60
    )
    assert [row.id for row in app.backend.job_claim(claim)] == [running.id]
    app.backend.worker_register(
        WorkerInfo(id="w-vanished", host="h", pid=1, queues="billing", concurrency=1, version="x")
    )
    with closing(sqlite3.connect(app.url.removeprefix("sqlite:///"))) as conn, conn:
        conn.execute("UPDATE errands_workers SET heartbeat_at = heartbeat_at - 600")

    base = f"http://127.0.0.1:{e2e['port']}"
    pages = ["/", "/jobs", f"/jobs/{dead.id}", f"/jobs/{running.id}", "/dlq", "/queues",
             "/workflows", "/workers", "/cron", "/audit", "/no-such-page"]  # fmt: skip
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=browser_path, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=PHONE)
            page.goto(base + "/login")
            assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
            page.fill("input[name=user]", "phone-operator")
            page.fill("input[name=secret]", PASSWORD)
            page.click("button[type=submit]")
            expect(page.locator(".top .user")).to_have_text("phone-operator")
            for path in pages:
                page.goto(base + path)
                width = page.evaluate("document.documentElement.scrollWidth")
                assert width <= PHONE["width"], f"{path} is {width} px wide at 390 px"
                expect(page.locator(".top nav a")).to_have_count(8)
            expect(page.locator("h1")).to_have_text("Page not found")  # the last one

            page.goto(base + "/jobs?state=running")
            expect(page.locator("td.run").first).to_contain_text("running")
            expect(page.locator("td.run").first).to_contain_text("w-phone")
            page.goto(base + "/workers")
            expect(page.locator("tr", has_text="w-vanished")).to_contain_text("presumed dead")
            page.goto(base + "/queues")
            expect(page.locator("tr", has_text="billing")).to_contain_text("no live worker")
        finally:
            browser.close()
