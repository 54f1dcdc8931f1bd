"""Workflow figures (issue 18): fan-in latency, a fan-out/fan-in's and a chain's throughput.

A separate ``errands worker`` process (``-c 8``) serves the jobs; this process enqueues.

- **fan-in latency**: a batch of ``--width`` no-op members with an ``on_success``
  callback, one batch at a time (the worker idle when the last member ends): from the
  last member's completion (its ``finished_at``, the database clock) to the callback's
  handler starting (``time.time()`` in the worker; one machine, so the clocks agree);
- **fan-out/fan-in**: one job, then ``--fan`` members after it, then one after them all:
  members per second from the workflow's enqueue to the last job's completion;
- **chain**: ``--chain`` jobs each after the one before: steps per second.

``--celery`` runs the same shapes in Celery beside it (bench/peers/celery_workflows.py: a
``chord`` with Redis as broker and result backend, a ``chain``; ``celery worker -P threads
-c 8``), in Celery's bench venv.

``--chancy`` runs them in Chancy's workflows too (bench/peers/chancy_workflows.py: a
``Workflow`` whose steps list their ``dependencies``; one Chancy worker, ``AsyncExecutor``,
concurrency 8, eager polling), in Chancy's bench venv and its own database
(``--chancy-url``, default ``bench_chancy``, made afresh), twice: with the worker's job
updates batched every second as shipped, then every 50 ms (``send_outgoing_interval``).

::

    python -m bench.workflows                                   # PostgreSQL on 127.0.0.1
    python -m bench.workflows --url sqlite:///tmp/wf.db
    python -m bench.workflows --quick                           # small, for a smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import errands

from .latency import PG_URL_DEFAULT, _wait_started, _with_params, percentile

ROOT = Path(__file__).resolve().parent.parent

app = errands.App()  # the worker gets its URL from --url; this process sets app.url


@app.job(name="bench.wf.member", retries=0)
def member() -> None:
    """A member that does nothing: what is measured is the store's work."""


@app.job(name="bench.wf.callback", retries=0)
def callback() -> float:
    """The fan-in's callback: when its handler started."""
    return time.time()


def _worker(url: str, folder: Path) -> subprocess.Popen[bytes]:
    stderr_path = folder / f"worker-{secrets.token_hex(3)}.stderr"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ERRANDS_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p)
    with stderr_path.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "errands", "worker", "bench.workflows:app", "--url", url,
             "--poll-interval", "0.5", "-c", "8"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT, env=env,
        )  # fmt: skip
    _wait_started(stderr_path, proc)
    return proc


def fan_in_latency(batches: int, width: int) -> list[float]:
    """Seconds from each batch's last member completing to its callback starting."""
    waits = []
    for n in range(batches):
        batch = errands.Batch(f"latency-{n}", on_success=callback.bind())
        for _ in range(width):
            batch.add(member.bind())
        handle = app.enqueue_workflow(batch)
        status = handle.wait(timeout=60)
        callback_id = status.callbacks["on_success"]
        assert callback_id is not None, status
        started = errands.JobHandle(app, callback_id, callback.name).result(timeout=60)
        last = max(
            app.get_job(m.job_id).finished_at.timestamp()  # type: ignore[union-attr]
            for m in handle.members()
        )
        waits.append(float(started) - last)
    return waits


def _until_last(start: float, handle: errands.WorkflowHandle) -> float:
    """Seconds from ``start`` (``time.time()``) to the completion of the workflow's last
    node (its ``finished_at``, the database clock; one machine): not to ``wait()``'s
    return, which polls the status up to 0.5 s apart."""
    handle.wait(timeout=600)
    last = list(handle.jobs.values())[-1]
    finished = app.get_job(last.id).finished_at
    assert finished is not None
    return finished.timestamp() - start


def fan_out_fan_in(width: int) -> float:
    """Members per second of a 1 -> ``width`` -> 1 workflow, enqueue to last completion."""
    wf = errands.Workflow("fan")
    root = wf.add(member.bind())
    middle = [wf.add(member.bind(), after=[root]) for _ in range(width)]
    wf.add(member.bind(), after=middle)
    start = time.time()
    handle = app.enqueue_workflow(wf)
    return (width + 2) / _until_last(start, handle)


def chain(length: int) -> float:
    """Steps per second of a ``length``-step chain, enqueue to last completion."""
    start = time.time()
    handle = app.enqueue_workflow(errands.chain(*(member.bind() for _ in range(length))))
    return length / _until_last(start, handle)


def run(url: str, batches: int, width: int, fan: int, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="errands-bench-wf-") as tmp:
        app.url = url
        app.migrate()
        worker = _worker(url, Path(tmp))
        try:
            fan_in_latency(2, width)  # warm up: connections open, the LISTEN session is up
            waits = fan_in_latency(batches, width)
            fan_rate = fan_out_fan_in(fan)
            chain_rate = chain(steps)
        finally:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
            app.close()
    return _figures(waits, width, fan, fan_rate, steps, chain_rate)


def _figures(
    waits: list[float], width: int, fan: int, fan_rate: float, steps: int, chain_rate: float
) -> dict[str, Any]:
    return {
        "fan_in_latency": {
            "batches": len(waits),
            "width": width,
            "p50_ms": percentile(waits, 50) * 1000,
            "p99_ms": percentile(waits, 99) * 1000,
            "max_ms": max(waits) * 1000,
        },
        "fan_out_fan_in": {"width": fan, "members_per_s": fan_rate},
        "chain": {"steps": steps, "steps_per_s": chain_rate},
    }


def celery(redis_url: str, *, batches: int, width: int, fan: int, steps: int) -> dict[str, Any]:
    """The same shapes in Celery (a chord on Redis, bench/peers/celery_workflows.py), in
    Celery's bench venv (made on first use, bench.systems)."""
    from .systems import PEERS, by_name, python_for

    python = python_for(by_name("celery"))
    argv = [python, str(PEERS / "celery_workflows.py"), "--batches", str(batches),
            "--width", str(width), "--fan", str(fan), "--chain", str(steps)]  # fmt: skip
    env = {**os.environ, "BENCH_REDIS_URL": redis_url}
    done = subprocess.run(
        argv, cwd=PEERS, env=env, capture_output=True, text=True, timeout=3600, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"the Celery run failed: {done.stderr[-2000:]}")
    raw = json.loads(done.stdout.strip().splitlines()[-1])
    return _figures(raw["waits"], width, fan, raw["fan_rate"], steps, raw["chain_rate"])


CHANCY_URL = "postgresql://postgres@127.0.0.1:5432/bench_chancy"


def chancy(
    url: str,
    *,
    batches: int,
    width: int,
    fan: int,
    steps: int,
    send_outgoing_interval: float | None = None,
) -> dict[str, Any]:
    """The same shapes as Chancy workflows (bench/peers/chancy_workflows.py), in Chancy's
    bench venv (made on first use, bench.systems), against the database at ``url``, which
    is dropped and made afresh (named ``bench_...``: ``$BENCH_DB_PREFIX`` applies)."""
    from .run import Postgres
    from .systems import PEERS, by_name, python_for

    parts = urlsplit(url)
    server = Postgres(urlunsplit(parts._replace(path="/postgres", query="")))
    db = server.name(parts.path.lstrip("/"))
    server.recreate(db)
    python = python_for(by_name("chancy"))
    argv = [python, str(PEERS / "chancy_workflows.py"), "--batches", str(batches),
            "--width", str(width), "--fan", str(fan), "--chain", str(steps)]  # fmt: skip
    if send_outgoing_interval is not None:
        argv += ["--send-outgoing-interval", str(send_outgoing_interval)]
    env = {**os.environ, "BENCH_CHANCY_URL": server.url(db)}
    try:
        done = subprocess.run(
            argv, cwd=PEERS, env=env, capture_output=True, text=True, timeout=7200, check=False
        )
    finally:
        server.drop(db)
    if done.returncode != 0:
        raise RuntimeError(f"the Chancy run failed: {done.stderr[-3000:]}")
    raw = json.loads(done.stdout.strip().splitlines()[-1])
    return _figures(raw["waits"], width, fan, raw["fan_rate"], steps, raw["chain_rate"])


def _print(title: str, figures: dict[str, Any]) -> None:
    latency = figures["fan_in_latency"]
    print(title)
    print(
        f"fan-in latency (last member done -> callback started), {latency['batches']} "
        f"batches of {latency['width']}: p50 {latency['p50_ms']:.1f} ms, p99 "
        f"{latency['p99_ms']:.1f} ms, max {latency['max_ms']:.1f} ms"
    )
    fan = figures["fan_out_fan_in"]
    print(f"1 -> {fan['width']} -> 1 fan-out/fan-in: {fan['members_per_s']:.1f} members/s")
    print(f"{figures['chain']['steps']}-step chain: {figures['chain']['steps_per_s']:.1f} steps/s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=os.environ.get("ERRANDS_BENCH_URL", PG_URL_DEFAULT))
    parser.add_argument("--batches", type=int, default=200, help="batches timed (default 200)")
    parser.add_argument("--width", type=int, default=10, help="members per batch (default 10)")
    parser.add_argument("--fan", type=int, default=10_000, help="fan-out width (default 10000)")
    parser.add_argument("--chain", type=int, default=1_000, help="chain length (default 1000)")
    parser.add_argument("--quick", action="store_true", help="20 batches, 200 wide, 50 steps")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument(
        "--celery", action="store_true", help="also run the same shapes in Celery (chords)"
    )
    parser.add_argument(
        "--chancy",
        action="store_true",
        help="also run the same shapes in Chancy's workflows (PostgreSQL), at its "
        "documented settings and with job updates every 50 ms",
    )
    parser.add_argument(
        "--chancy-url",
        default=os.environ.get("BENCH_CHANCY_URL", CHANCY_URL),
        help="Chancy's own database (dropped and made afresh)",
    )
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/3"),
        help="Celery's broker and result backend (its database is emptied)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.fan, args.chain = 20, 200, 50

    url, own_schema = args.url, None
    if urlsplit(url).scheme.startswith("postgres"):
        options = dict(parse_qsl(urlsplit(url).query))
        if "schema" not in options:
            own_schema = f"bench_{secrets.token_hex(4)}"
            url = _with_params(url, schema=own_schema)
        if "auto_migrate" not in options:
            url = _with_params(url, auto_migrate="true")
    elif urlsplit(url).scheme != "sqlite":
        parser.error(f"unsupported URL {args.url!r}: postgresql://... or sqlite:///...")
    load_before = os.getloadavg()[0]
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    try:
        figures = run(url, args.batches, args.width, args.fan, args.chain)
    finally:
        if own_schema is not None:
            import psycopg

            from errands.backends.postgres.config import parse_postgres_url

            with (
                contextlib.suppress(Exception),
                psycopg.connect(parse_postgres_url(url).conninfo, autocommit=True) as conn,
            ):
                conn.execute(f'DROP SCHEMA IF EXISTS "{own_schema}" CASCADE')
    _print(f"errands workflows on {urlsplit(url).scheme} (worker -c 8, this machine)", figures)
    if args.celery:
        peer = celery(
            args.redis_url, batches=args.batches, width=args.width, fan=args.fan, steps=args.chain
        )
        _print("Celery canvas, Redis broker and result backend (worker -P threads -c 8)", peer)
        figures = {**figures, "celery": peer}
    if args.chancy:
        sizes = {"batches": args.batches, "width": args.width, "fan": args.fan,
                 "steps": args.chain}  # fmt: skip
        peer = chancy(args.chancy_url, **sizes)
        _print("Chancy workflows, PostgreSQL (AsyncExecutor, concurrency 8, eager polling; "
               "job updates every 1 s, as shipped)", peer)  # fmt: skip
        fast = chancy(args.chancy_url, **sizes, send_outgoing_interval=0.05)
        _print("Chancy workflows, the same with job updates every 50 ms", fast)
        figures = {**figures, "chancy": peer, "chancy_fast_updates": fast}
    if args.json is not None:
        figures["run"] = {
            "at": started,
            "store": urlsplit(url).scheme.split("+")[0],
            "load_before": round(load_before, 2),
            "load_after": round(os.getloadavg()[0], 2),
            "quick": args.quick,
        }
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
