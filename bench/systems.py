"""The systems under test, and the venv each peer is installed into from PyPI.

errands runs from the project's own venv (the code in this tree). Every peer gets its own
venv under ``bench/.venvs/NAME`` (gitignored), made once and reused while its pinned
requirements stay the same; a peer that cannot be installed or run here is recorded with
the reason, and the run goes on without it.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
PEERS = BENCH / "peers"
VENVS = BENCH / ".venvs"


@dataclass(frozen=True)
class Config:
    """One way of running a system's workers: its defaults, or a tuned configuration.

    ``options`` reach the adapter as ``spec["config"]``; ``source`` says where each
    setting comes from (a documentation page, or the peer's own source for a default),
    so a reader can check that "best" is what the peer itself documents.
    """

    label: str  # "default", "tuned", "threads", ...
    kind: str  # "default" | "best"
    settings: str  # how the workers run, for the docs
    source: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class System:
    name: str
    store: str  # "postgres" | "sqlite" | "redis"
    adapter: str  # file under bench/peers/
    requirements: tuple[str, ...] = ()  # empty: the project's venv (errands itself)
    python: tuple[int, int] = (3, 11)  # the lowest Python the peer supports
    packages: tuple[str, ...] = ()  # distributions whose versions the report lists
    compare_to: str = ""  # the errands system this one is set against
    configs: tuple[Config, ...] = ()
    # Tables holding the rows a finished job leaves behind (bench.storage replicates them
    # to measure claims against many finished rows); empty: none are kept.
    finished_tables: tuple[str, ...] = ()
    finished_note: str = ""  # why there are none, for the report

    @property
    def is_errands(self) -> bool:
        return not self.requirements

    @property
    def settings(self) -> str:
        return "; ".join(f"{c.label}: {c.settings}" for c in self.configs)

    def config(self, label: str) -> Config:
        for c in self.configs:
            if c.label == label:
                return c
        raise KeyError(f"{self.name} has no configuration {label!r}")

    @property
    def default(self) -> Config:
        return next(c for c in self.configs if c.kind == "default")

    @property
    def best(self) -> tuple[Config, ...]:
        return tuple(c for c in self.configs if c.kind == "best")


ERRANDS_DOCS = "docs/concurrency.md (-c, --prefetch) and docs/observability.md (log level)"
ERRANDS_CONFIGS = (
    Config(
        "default",
        "default",
        "`errands worker errands_app:app [--processes 2]` (-c 10, prefetch 4 x -c, "
        "INFO log line per finished job)",
        "`errands worker --help` (src/errands/cli): defaults -c 10, --log-level info",
        {},
    ),
    Config(
        "tuned",
        "best",
        "`errands worker -c 32 --prefetch 1024 --log-level warning [--processes 2]`",
        ERRANDS_DOCS + ": a larger prefetch for many quick jobs (1024: the best of 128, 512 "
        "and 1024 in a sweep on this machine, 2026-12-05)",
        {"concurrency": 32, "prefetch": 1024, "log_level": "warning"},
    ),
    Config(
        "async",
        "best",
        "the tuned worker with an `async def` handler (as pgqueuer's and procrastinate's "
        "are): `errands worker -c 32 --prefetch 1024 --log-level warning [--processes 2]`",
        ERRANDS_DOCS + " and docs/async.md (async handlers run on the worker's event loop, "
        "-c of them at once, prefetched jobs waiting for a slot)",
        {"concurrency": 32, "prefetch": 1024, "log_level": "warning", "handler": "async"},
    ),
)

SYSTEMS: tuple[System, ...] = (
    System(
        "errands-sqlite",
        "sqlite",
        "errands_peer.py",
        packages=("errands",),
        configs=ERRANDS_CONFIGS,
    ),
    System(
        "errands-pg",
        "postgres",
        "errands_peer.py",
        packages=("errands", "psycopg", "psycopg-pool"),
        configs=ERRANDS_CONFIGS,
        finished_tables=("errands_jobs",),
    ),
    System(
        "procrastinate",
        "postgres",
        "procrastinate_peer.py",
        ("procrastinate==3.10.0", "psycopg[binary]"),
        packages=("procrastinate", "psycopg"),
        compare_to="errands-pg",
        configs=(
            Config(
                "default",
                "default",
                "`procrastinate worker -q bench` (concurrency 1), one process per worker",
                "procrastinate 3.10.0 source, procrastinate/worker.py: WORKER_CONCURRENCY = 1",
            ),
            Config(
                "tuned",
                "best",
                "`procrastinate worker -q bench -c 32`, async task",
                "procrastinate docs, howto/production/concurrency "
                "(https://procrastinate.readthedocs.io/en/stable/howto/production/"
                "concurrency.html) and `procrastinate worker --help` (-c: parallel "
                "asynchronous jobs); no figure is documented, 32 is errands' tuned -c",
                {"concurrency": 32},
            ),
        ),
        finished_tables=("procrastinate_jobs", "procrastinate_events"),
    ),
    System(
        "pgqueuer",
        "postgres",
        "pgqueuer_peer.py",
        ("pgqueuer==1.6.0", "asyncpg"),
        packages=("pgqueuer", "asyncpg"),
        compare_to="errands-pg",
        configs=(
            Config(
                "default",
                "default",
                "`PgQueuer.run()` (batch_size 10), asyncpg; `pgq run` 1.6.0 crashes on start",
                "pgqueuer 1.6.0 source, pgqueuer/core/qm.py QueueManager.run(batch_size=10)",
                {"batch_size": 10},
            ),
            Config(
                "tuned",
                "best",
                "`PgQueuer.run(batch_size=1000)` after `pgq autovac`, asyncpg",
                "pgqueuer docs, guides/performance-tuning.md (https://pgqueuer.readthedocs.io"
                "/en/latest/guides/performance-tuning.html): raise batch_size for jobs "
                "under 1 s (no upper figure given; 1000: the best of 100, 250, 500, 1000 "
                "and 2000 in a sweep on this machine, 2026-12-05); checklist: run "
                "`pgq autovac` after installation",
                {"batch_size": 1000, "autovac": True},
            ),
        ),
        finished_tables=("pgqueuer_log",),
    ),
    System(
        "oban",
        "postgres",
        "oban_peer.py",
        ("oban==0.7.0",),
        python=(3, 12),
        packages=("oban", "psycopg"),
        compare_to="errands-pg",
        configs=(
            Config(
                "default",
                "default",
                "`oban start --queues bench:10`; one process per worker",
                "`oban start --help` (oban 0.7.0): a queue needs a limit, the documented "
                "example is `default:10`; pool 1-10 connections, log level INFO",
                {"limit": 10},
            ),
            Config(
                "tuned",
                "best",
                "`oban start --queues bench:32 --log-level warning`; one process per worker",
                "oban-py docs, queue limits (`--queues name:limit`, "
                "https://oban.pro/docs/py/); no figure is documented, 32 is errands' "
                "tuned -c",
                {"limit": 32, "log_level": "warning"},
            ),
        ),
        finished_tables=("oban_jobs",),
    ),
    System(
        "awa-pg",
        "postgres",
        "awa_peer.py",
        ("awa-pg==0.6.9",),
        packages=("awa-pg",),
        compare_to="errands-pg",
        configs=(
            Config(
                "default",
                "default",
                "`AsyncClient.start([('bench', 50)])` (max_workers 50, 10 connections), "
                "queue-storage engine",
                "awa docs/configuration.md (https://github.com/hardbyte/awa/blob/main/docs/"
                "configuration.md): QueueConfig max_workers 50, AsyncClient "
                "max_connections=10",
                {"workers": 50, "max_connections": 10},
            ),
            Config(
                "tuned",
                "best",
                "`AsyncClient.start([('bench', 256)])`, queue-storage engine",
                "the third-party sweep of 2026-05-09 (https://github.com/hardbyte/"
                "postgresql-job-queue-benchmarking/blob/main/results/2026-05-09-full-sweep/"
                "SUMMARY.md): awa peaks at 1 x 256 workers; awa documents no figure",
                {"workers": 256, "max_connections": 10},
            ),
        ),
        finished_note="awa's queue-storage engine keeps finished jobs in ring partitions "
        "(ready_entries_N, lease_claims_N) that it rotates and truncates: copying rows into "
        "them would not be what awa leaves behind",
    ),
    System(
        "celery",
        "redis",
        "celery_peer.py",
        ("celery[redis]==5.7.0",),
        packages=("celery", "kombu", "redis"),
        compare_to="errands-pg",
        configs=(
            Config(
                "default",
                "default",
                "`celery worker -c 1|2` (prefork, prefetch multiplier 4), Redis, no results",
                "Celery docs, workers guide (https://docs.celeryq.dev/en/stable/userguide/"
                "workers.html#concurrency): prefork, -c defaults to the CPU count; "
                "worker_prefetch_multiplier defaults to 4",
                {"pool": "prefork"},
            ),
            Config(
                "prefork",
                "best",
                "`celery worker -P prefork -c 1|2 --prefetch-multiplier 128`, Redis, no results",
                "Celery docs, optimizing guide (https://docs.celeryq.dev/en/stable/"
                "userguide/optimizing.html#prefetch-limits): many short tasks: a large "
                "prefetch multiplier, 'say 64, or 128'",
                {"pool": "prefork", "prefetch": 128},
            ),
            Config(
                "threads",
                "best",
                "`celery worker -P threads -c 32` per worker node, Redis, no results",
                "Celery docs, concurrency guide (https://docs.celeryq.dev/en/stable/"
                "userguide/concurrency/index.html): the threads pool; -c 32 = errands' "
                "tuned -c",
                {"pool": "threads", "threads": 32},
            ),
        ),
    ),
    System(
        "dramatiq",
        "redis",
        "dramatiq_peer.py",
        ("dramatiq[redis]==2.2.1",),
        packages=("dramatiq", "redis"),
        compare_to="errands-pg",
        configs=(
            Config(
                "default",
                "default",
                "`dramatiq dramatiq_app --processes 1|2` (8 threads each), Redis",
                "`dramatiq --help` (dramatiq 2.2.1): --threads defaults to 8",
                {"threads": 8},
            ),
            Config(
                "tuned",
                "best",
                "`dramatiq dramatiq_app --processes 1|2 --threads 32`, Redis",
                "Dramatiq docs, cookbook/guide (https://dramatiq.io/guide.html, "
                "`--processes`/`--threads`): more threads for short I/O-light tasks; 32 "
                "= errands' tuned -c",
                {"threads": 32},
            ),
        ),
    ),
    System(
        "huey",
        "sqlite",
        "huey_peer.py",
        ("huey==3.5.4",),
        packages=("huey",),
        compare_to="errands-sqlite",
        configs=(
            Config(
                "default",
                "default",
                "`huey_consumer huey_app.huey -w 1|2` (thread workers), SqliteHuey",
                "huey docs, consumer options (https://huey.readthedocs.io/en/latest/"
                "consumer.html): -w 1, -k thread by default",
                {"kind": "thread"},
            ),
            Config(
                "tuned",
                "best",
                "`huey_consumer huey_app.huey -k process -w 1|2`, SqliteHuey",
                "huey docs, consumer options (https://huey.readthedocs.io/en/latest/"
                "consumer.html): -k process for CPU-bound work (a no-op job is all Python "
                "overhead)",
                {"kind": "process"},
            ),
        ),
    ),
)


# Peers of one benchmark only, not of `make bench`'s throughput runs (no adapter there).
WORKFLOW_PEERS: tuple[System, ...] = (
    System(
        "chancy",
        "postgres",
        "chancy_workflows.py",  # bench.workflows --chancy
        ("chancy==0.26.0", "psycopg[binary,pool]"),
        packages=("chancy", "psycopg", "psycopg-pool"),
        compare_to="errands-pg",
        configs=(
            Config(
                "documented",
                "best",
                "one `Worker`, queue `Queue('bench_wf', concurrency=8, "
                "executor=Chancy.Executor.Async, eager_polling=True)`, log level WARNING; "
                "job updates written in batches every 1 s (`send_outgoing_interval`, "
                "as shipped)",
                "Chancy docs: executors (https://tkte.ch/chancy/chancy.executors.html): "
                "AsyncExecutor for I/O-bound jobs, no process overhead; Queue.eager_polling "
                "(https://tkte.ch/chancy/chancy.queue.html): poll again as soon as a slot "
                "frees, for continuously available jobs; concurrency 8 = the errands and "
                "Celery workers of bench.workflows",
                {"send_outgoing_interval": None},
            ),
            Config(
                "fast-updates",
                "best",
                "the same with `worker.send_outgoing_interval = 0.05` (job updates, and "
                "so workflow progress, written every 50 ms instead of every second)",
                "Chancy docs, Worker.send_outgoing_interval (https://tkte.ch/chancy/"
                "chancy.worker.html): 'the number of seconds between sending outgoing "
                "updates to the database'; chancy/worker.py _maintain_updates: updates "
                "are batched to save transactions and 'the frequency of these updates "
                "can be controlled by setting the send_outgoing_interval attribute'; no "
                "figure is documented, 50 ms is ours",
                {"send_outgoing_interval": 0.05},
            ),
        ),
    ),
)


def by_name(name: str) -> System:
    for system in SYSTEMS + WORKFLOW_PEERS:
        if system.name == name:
            return system
    raise KeyError(name)


def find_python(minimum: tuple[int, int]) -> str | None:
    """An interpreter of at least ``minimum``: this one, else a pythonX.Y on the machine."""
    if sys.version_info[:2] >= minimum:
        return sys.executable
    candidates: list[str] = []
    for minor in range(minimum[1], 15):
        found = shutil.which(f"python{minimum[0]}.{minor}")
        if found:
            candidates.append(found)
        candidates += sorted(
            glob.glob(os.path.expanduser(f"~/.pyenv/versions/{minimum[0]}.{minor}.*/bin/python"))
        )
        candidates += sorted(glob.glob(f"/usr/bin/python{minimum[0]}.{minor}"))
    for exe in candidates:
        try:
            out = subprocess.run(
                [exe, "-c", "import sys, venv; print(sys.version_info[:2])"],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0:
            return exe
    return None


def python_for(system: System) -> str:
    """The python that runs this system's adapter, installing its venv when needed."""
    if system.is_errands:
        return sys.executable
    venv = VENVS / system.name
    exe = venv / "bin" / "python"
    stamp = venv / ".bench-requirements"
    wanted = json.dumps(sorted(system.requirements))
    if exe.exists() and stamp.exists() and stamp.read_text() == wanted:
        return str(exe)
    base = find_python(system.python)
    if base is None:
        raise RuntimeError(
            f"{system.name} needs Python >= {system.python[0]}.{system.python[1]} and none "
            "was found on this machine"
        )
    if venv.exists():
        shutil.rmtree(venv)
    VENVS.mkdir(parents=True, exist_ok=True)
    subprocess.run([base, "-m", "venv", str(venv)], check=True, capture_output=True)
    result = subprocess.run(
        [str(exe), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         *system.requirements],
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    if result.returncode != 0:
        lines = [ln for ln in result.stderr.splitlines() if "WARNING: Location" not in ln]
        raise RuntimeError(
            f"pip install {' '.join(system.requirements)} failed: " + " | ".join(lines[-6:])
        )
    stamp.write_text(wanted)
    return str(exe)


def versions(python: str, packages: tuple[str, ...]) -> dict[str, str]:
    code = (
        "import importlib.metadata as m, json, sys\n"
        "out = {}\n"
        "for n in sys.argv[1:]:\n"
        "    try: out[n] = m.version(n)\n"
        "    except m.PackageNotFoundError: out[n] = '?'\n"
        "out['python'] = sys.version.split()[0]\n"
        "print(json.dumps(out))\n"
    )
    result = subprocess.run(
        [python, "-c", code, *packages], capture_output=True, text=True, timeout=60
    )
    return json.loads(result.stdout) if result.returncode == 0 else {}
