"""Take the dashboard screenshots in docs/images/ (overview, a job's detail, the DLQ).

    .venv/bin/python scripts/dashboard_screenshots.py [--out docs/images]

Runs the demo shop (``errands.demo``) on a fresh SQLite file with a real worker, then,
so the last-hour charts have an hour to show, spreads the finished jobs' times over the
past 60 minutes (only in this throwaway database). Serves the dashboard with uvicorn on a
free loopback port and photographs it with Debian's headless Chromium via Playwright.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import socket
import sqlite3
import sys
import tempfile
import threading
import time
from contextlib import closing
from pathlib import Path

import uvicorn

from errands.backends.base import WorkerInfo
from errands.dashboard import create_app
from errands.demo import build_app, enqueue_jobs

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]
PASSWORD = "screenshots"


def backdate(db: str, now: float) -> None:
    """Spread finished jobs (and their failed attempts) over the last hour, busier lately."""
    rng = random.Random(7)
    with closing(sqlite3.connect(db)) as conn, conn:
        rows = conn.execute(
            "SELECT id, errors FROM errands_jobs WHERE finished_at IS NOT NULL"
        ).fetchall()
        for job_id, errors in rows:
            minutes_ago = 59.5 * (1 - math.sqrt(rng.random()))
            finished = now - minutes_ago * 60 - rng.random() * 30
            spread = json.loads(errors)
            for i, error in enumerate(spread):  # the last failure ends the last attempt
                error["at"] = finished - 8 * (len(spread) - 1 - i)
            conn.execute(
                "UPDATE errands_jobs SET finished_at = ?, attempted_at = ?, errors = ?,"
                " inserted_at = ?, run_at = ? WHERE id = ?",
                (finished, finished - 0.5, json.dumps(spread), finished - 30, finished - 9, job_id),
            )


def serve(dashboard: object, port: int) -> uvicorn.Server:
    config = uvicorn.Config(
        dashboard,  # type: ignore[arg-type]
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="off",
        ws="none",
    )
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/images")
    args = parser.parse_args()
    chromium = shutil.which("chromium")
    if chromium is None:
        print("Debian's chromium is needed: apt-get install -y chromium", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="errands-shots-"))
    db = str(workdir / "shop.db")
    app = build_app(f"sqlite:///{db}", work_seconds=0.002)
    app.migrate()
    enqueue_jobs(app, 600)
    worker = app.worker(concurrency=16, poll_interval=0.05, maintenance_tick=0.1)
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        counts = {s: sum(q.counts.get(s, 0) for q in app.queue_stats()) for s in ("dead",)}
        pending = sum(
            n
            for q in app.queue_stats()
            for s, n in q.counts.items()
            if s in ("available", "running", "retryable")
        )
        if pending == 0 and counts["dead"] >= 3:
            break
        time.sleep(0.2)
    worker.stop()
    thread.join(timeout=30)
    backdate(db, app.backend.db_now())
    # what a live system has beside the history: a backlog, a delayed job, two workers
    backlog = enqueue_jobs(app, 60)
    for i, queues in enumerate(("emails,webhooks", "payments,imports")):
        worker_id = f"w-{'3fa9c1d2' if i == 0 else '81be07aa'}"
        app.backend.worker_register(
            WorkerInfo(id=worker_id, host=f"app-{i + 1}.internal", pid=4100 + i * 37,
                       queues=queues, concurrency=16, version="0.1.0")
        )  # fmt: skip
        app.backend.worker_heartbeat(worker_id, in_flight=3 + i * 4, processed=612 + i * 180)
    dead = app.jobs(state="dead")
    detail = next(j for j in dead if j.name == "deliver_webhook")
    app.cancel(backlog.delayed.id, actor="cli:ops@app-1")

    port = _free_port()
    server = serve(create_app(app, password=PASSWORD, refresh_seconds=0), port)
    base = f"http://127.0.0.1:{port}"
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1360, "height": 900}, device_scale_factor=1)
        page.goto(base + "/login")
        page.fill("input[name=user]", "ana")
        page.fill("input[name=secret]", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_selector("svg.chart")
        page.screenshot(path=str(out / "dashboard-overview.png"), full_page=True)
        page.goto(f"{base}/jobs/{detail.id}")
        page.screenshot(path=str(out / "dashboard-job.png"), full_page=True)
        page.goto(base + "/dlq")
        page.locator("input[name=ids]").first.check()
        page.screenshot(path=str(out / "dashboard-dlq.png"), full_page=True)
        browser.close()
    server.should_exit = True
    app.close()
    for name in ("dashboard-overview.png", "dashboard-job.png", "dashboard-dlq.png"):
        print(f"wrote {out / name} ({(out / name).stat().st_size // 1024} KiB)")
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


if __name__ == "__main__":
    sys.exit(main())
