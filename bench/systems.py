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

BENCH = Path(__file__).resolve().parent
PEERS = BENCH / "peers"
VENVS = BENCH / ".venvs"


@dataclass(frozen=True)
class System:
    name: str
    store: str  # "postgres" | "sqlite" | "redis"
    adapter: str  # file under bench/peers/
    requirements: tuple[str, ...] = ()  # empty: the project's venv (errands itself)
    python: tuple[int, int] = (3, 11)  # the lowest Python the peer supports
    packages: tuple[str, ...] = ()  # distributions whose versions the report lists
    settings: str = ""  # how its workers run, for the docs
    compare_to: str = ""  # the errands system this one is set against
    options: dict[str, object] = field(default_factory=dict)

    @property
    def is_errands(self) -> bool:
        return not self.requirements


SYSTEMS: tuple[System, ...] = (
    System(
        "errands-sqlite",
        "sqlite",
        "errands_peer.py",
        packages=("errands",),
        settings="`errands worker -c 32 [--processes 2]`, SQLite WAL file",
    ),
    System(
        "errands-pg",
        "postgres",
        "errands_peer.py",
        packages=("errands", "psycopg", "psycopg-pool"),
        settings="`errands worker -c 32 [--processes 2]`",
    ),
    System(
        "procrastinate",
        "postgres",
        "procrastinate_peer.py",
        ("procrastinate==3.10.0", "psycopg[binary]"),
        packages=("procrastinate", "psycopg"),
        settings="`procrastinate worker -c 32`, async task; one process per worker",
        compare_to="errands-pg",
    ),
    System(
        "pgqueuer",
        "postgres",
        "pgqueuer_peer.py",
        ("pgqueuer==1.6.0", "asyncpg"),
        packages=("pgqueuer", "asyncpg"),
        settings="`PgQueuer.run(batch_size=10)` (asyncpg; `pgq run` 1.6.0 crashes on start)",
        compare_to="errands-pg",
    ),
    System(
        "oban",
        "postgres",
        "oban_peer.py",
        ("oban==0.7.0",),
        python=(3, 12),
        packages=("oban", "psycopg"),
        settings="`oban start --queues bench:32`; one process per worker",
        compare_to="errands-pg",
    ),
    System(
        "awa-pg",
        "postgres",
        "awa_peer.py",
        ("awa-pg==0.6.9",),
        packages=("awa-pg",),
        settings="`AsyncClient.start([('bench', 32)])`, queue-storage engine, COPY bulk",
        compare_to="errands-pg",
    ),
    System(
        "celery",
        "redis",
        "celery_peer.py",
        ("celery[redis]==5.7.0",),
        packages=("celery", "kombu", "redis"),
        settings="`celery worker -P prefork -c 1|2`, Redis broker, no result backend",
        compare_to="errands-pg",
    ),
    System(
        "dramatiq",
        "redis",
        "dramatiq_peer.py",
        ("dramatiq[redis]==2.2.1",),
        packages=("dramatiq", "redis"),
        settings="`dramatiq --processes 1|2 --threads 8`, Redis broker",
        compare_to="errands-pg",
    ),
    System(
        "huey",
        "sqlite",
        "huey_peer.py",
        ("huey==3.5.4",),
        packages=("huey",),
        settings="`huey_consumer -k process -w 1|2`, SqliteHuey",
        compare_to="errands-sqlite",
    ),
)


def by_name(name: str) -> System:
    for system in SYSTEMS:
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
