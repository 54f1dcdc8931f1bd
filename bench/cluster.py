"""A throw-away PostgreSQL cluster the harness owns: initdb in a temporary folder, its own
port, stopped and deleted at the end.

The chaos scenarios restart PostgreSQL and hold hundreds of connections, and WAL per job
needs a cluster nothing else writes to; neither may touch a server other people use.
``--scratch-pg`` runs them here. The cluster gets initdb's defaults (as a fresh
PostgreSQL install, like the shared server's), except ``max_connections`` (400, as the
third-party benchmark's postgres.conf, so its 300-connection pool-exhaustion cell fits)
and ``listen_addresses`` (loopback only). As root, the server runs as the ``postgres``
user (initdb refuses root).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

PORT = 55432  # the first port tried; the next free one up to PORT + 40 is taken


def free_port(start: int = PORT) -> int:
    """A loopback port nothing listens on (another engineer's scratch cluster may)."""
    for port in range(start, start + 40):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {start}..{start + 39}")


def bindir(major: str = "15") -> Path:
    for candidate in (Path(f"/usr/lib/postgresql/{major}/bin"), Path("/usr/local/pgsql/bin")):
        if (candidate / "initdb").exists():
            return candidate
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    raise RuntimeError("initdb was not found: install the PostgreSQL server package")


class ScratchCluster:
    def __init__(
        self, port: int | None = None, major: str = "15", folder: str | None = None
    ) -> None:
        self.port = port or free_port()
        self.bin = bindir(major)
        self.dir = Path(folder or tempfile.mkdtemp(prefix="errands-bench-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self.user = "postgres" if os.geteuid() == 0 else None

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, argv: list[str], check: bool = True, timeout: float = 120) -> Any:
        if self.user:
            pw = pwd.getpwnam(self.user)

            def demote() -> None:
                os.setgid(pw.pw_gid)
                os.setuid(pw.pw_uid)

            return subprocess.run(
                argv, check=check, capture_output=True, text=True, timeout=timeout,
                preexec_fn=demote, cwd=str(self.dir),
            )  # fmt: skip
        return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=timeout)

    def init(self) -> None:
        if self.user:
            pw = pwd.getpwnam(self.user)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self._run([str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres",
                   "--auth=trust", "--no-sync"])  # fmt: skip
        with open(self.data / "postgresql.conf", "a") as f:
            f.write(
                "\n# errands bench scratch cluster\n"
                f"port = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.dir}'\nmax_connections = 400\n"
            )

    def start(self) -> None:
        self._run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log),
                   "-w", "-t", "60", "start"])  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        self._run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t",
                   "60", "stop"], check=False)  # fmt: skip

    def restart(self, down_seconds: float = 0.0, mode: str = "fast") -> dict[str, float]:
        """Stop (``fast``: what ``docker stop`` does to the postgres image), stay down
        ``down_seconds``, start again; the times of each step."""
        t0 = time.monotonic()
        self.stop(mode)
        t1 = time.monotonic()
        time.sleep(down_seconds)
        t2 = time.monotonic()
        self.start()
        return {
            "stop_s": t1 - t0,
            "down_s": time.monotonic() - t1,
            "start_s": time.monotonic() - t2,
        }

    def up(self) -> None:
        """initdb and start; the folder is removed again if the server does not start.
        A port taken between the choice and the server's bind (another process chose it
        too: two scratch clusters starting at once) moves the server to the next free one."""
        try:
            self.init()
            for attempt in range(5):
                try:
                    self.start()
                    break
                except subprocess.CalledProcessError:
                    taken = self.log.exists() and "Address already in use" in self.log.read_text()
                    if not taken or attempt == 4:
                        raise
                    self.port = free_port(self.port + 1)
                    with open(self.data / "postgresql.conf", "a") as f:
                        f.write(f"port = {self.port}  # the one before was taken\n")
        except Exception as exc:
            log = self.log.read_text()[-600:] if self.log.exists() else ""
            with contextlib.suppress(OSError):
                shutil.rmtree(self.dir)
            raise RuntimeError(f"the scratch cluster did not start: {exc} {log}") from exc

    def __enter__(self) -> ScratchCluster:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop("immediate")
        with contextlib.suppress(OSError):
            shutil.rmtree(self.dir)


class ServiceRestarter:
    """Restart a PostgreSQL the harness does not own, with commands the caller gives
    (``--pg-stop-cmd``/``--pg-start-cmd``, e.g. ``pg_ctlcluster 15 main stop -m fast``):
    for the lead's quiet run on the machine's own server, never by default."""

    def __init__(self, stop_cmd: str, start_cmd: str) -> None:
        self.stop_cmd, self.start_cmd = stop_cmd, start_cmd

    def restart(self, down_seconds: float = 0.0, mode: str = "fast") -> dict[str, float]:
        t0 = time.monotonic()
        subprocess.run(self.stop_cmd, shell=True, check=True, timeout=120)
        t1 = time.monotonic()
        time.sleep(down_seconds)
        t2 = time.monotonic()
        subprocess.run(self.start_cmd, shell=True, check=True, timeout=120)
        return {
            "stop_s": t1 - t0,
            "down_s": time.monotonic() - t1,
            "start_s": time.monotonic() - t2,
        }
