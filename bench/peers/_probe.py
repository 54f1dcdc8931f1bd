"""What every adapter shares: the handler probe, worker processes, memory, results.

Standard library only: each peer's adapter runs with that peer's own venv python, so
nothing here may import errands or any peer.

The probe: a no-op handler calls :func:`hit` with its job's int argument. Each process
that runs handlers writes, into its own memory-mapped file under ``BENCH_PROBE_DIR``
(tmpfs), a header (jobs seen, first and last handler start) and the handler start time
of job *n* in slot *n*. Writing is a few memory stores, so it costs the queue under test
nothing measurable, and the driver reads every file to know progress, throughput,
pickup latency and which processes ran jobs, whatever the peer's process model.
Times are ``time.monotonic()``: CLOCK_MONOTONIC, one clock for every process.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

HEADER = struct.Struct("<qdd")  # count, first start, last start
SLOT = struct.Struct("<d")

_lock = threading.Lock()
_map: mmap.mmap | None = None
_pid = 0
_slots = 0


def _open() -> mmap.mmap | None:
    global _map, _pid, _slots
    folder = os.environ.get("BENCH_PROBE_DIR")
    if not folder:
        return None
    _slots = int(os.environ.get("BENCH_PROBE_SLOTS", "0"))
    _pid = os.getpid()
    path = os.path.join(folder, f"{_pid}.probe")
    size = HEADER.size + 2 * SLOT.size * (_slots + 1)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, size)
        _map = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return _map


# Synthetic work per job, seconds (BENCH_WORK_MS; the chaos scenarios use 1 ms, as the
# third-party harness's JOB_WORK_MS): 0 is a no-op. Handlers call work() / await awork().
WORK = float(os.environ.get("BENCH_WORK_MS", "0")) / 1000


def hit(n: int) -> None:
    """Record that the handler of job ``n`` started now (call it first thing).

    Slot *n* of the first region keeps the first start this process saw, slot *n* of the
    second the last one: a job run again (after a crash, say) shows as last > first, or
    in two processes' files."""
    now = time.monotonic()
    with _lock:
        m = _map if _pid == os.getpid() else None
        if m is None:
            m = _open()
            if m is None:
                return
        count, first, _last = HEADER.unpack_from(m, 0)
        HEADER.pack_into(m, 0, count + 1, first or now, now)
        if 0 <= n < _slots:
            off = HEADER.size + SLOT.size * n
            if not SLOT.unpack_from(m, off)[0]:
                SLOT.pack_into(m, off, now)
            SLOT.pack_into(m, off + SLOT.size * (_slots + 1), now)


def work() -> None:
    if WORK:
        time.sleep(WORK)


async def awork() -> None:
    if WORK:
        import asyncio

        await asyncio.sleep(WORK)


class Probe:
    """The driver's side: a fresh tmpfs folder, read back by summing every process file."""

    def __init__(self, slots: int) -> None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        import tempfile

        self.dir = tempfile.mkdtemp(prefix="errands-bench-", dir=base)
        self.slots = slots

    def env(self) -> dict[str, str]:
        return {"BENCH_PROBE_DIR": self.dir, "BENCH_PROBE_SLOTS": str(self.slots)}

    def _files(self) -> list[tuple[int, bytes]]:
        out = []
        for name in os.listdir(self.dir):
            if name.endswith(".probe"):
                with open(os.path.join(self.dir, name), "rb") as f:
                    out.append((int(name.split(".")[0]), f.read()))
        return out

    def totals(self) -> tuple[int, float, float]:
        """(jobs seen, first start, last start) over every process."""
        count, first, last = 0, 0.0, 0.0
        for _, data in self._files():
            if len(data) < HEADER.size:
                continue
            c, f, la = HEADER.unpack_from(data, 0)
            count += c
            if f and (not first or f < first):
                first = f
            last = max(last, la)
        return count, first, last

    def pids(self) -> list[int]:
        return sorted(pid for pid, _ in self._files())

    def by_process(self) -> list[dict[str, float]]:
        """Each process's jobs and its first and last handler start, in seconds after the
        first start of all: how evenly the processes shared the window."""
        heads = [HEADER.unpack_from(d, 0) for _, d in self._files() if len(d) >= HEADER.size]
        heads = [h for h in heads if h[0]]
        zero = min((h[1] for h in heads), default=0.0)
        return [
            {"jobs": c, "first_s": round(f - zero, 3), "last_s": round(la - zero, 3)}
            for c, f, la in sorted(heads, key=lambda h: h[1])
        ]

    def starts(self, n: int, last: bool = False) -> list[float]:
        """Handler start time of jobs 0..n-1 (0.0 where none was seen), earliest copy;
        ``last``: the latest start of each job over every process instead."""
        result = [0.0] * n
        base = HEADER.size + (SLOT.size * (self.slots + 1) if last else 0)
        for _, data in self._files():
            for i in range(min(n, self.slots)):
                off = base + SLOT.size * i
                if off + SLOT.size > len(data):
                    break
                (t,) = SLOT.unpack_from(data, off)
                if t and (not result[i] or (t > result[i] if last else t < result[i])):
                    result[i] = t
        return result

    def wait(
        self, count: int, timeout: float, cap: float | None = None
    ) -> tuple[int, float, float]:
        """Until ``count`` jobs ran, ``timeout`` passed, or ``cap`` s since the first one."""
        deadline = time.monotonic() + timeout
        while True:
            total = self.totals()
            now = time.monotonic()
            if total[0] >= count or now > deadline:
                return total
            if cap is not None and total[1] and now - total[1] > cap:
                return total
            time.sleep(0.01)

    def cleanup(self) -> None:
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


# -- processes ----------------------------------------------------------------------


def proc_status(pid: int, field: str) -> int | None:
    """A ``kB`` figure from /proc/<pid>/status (VmHWM, VmRSS), or None if gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU of ``pids`` so far (all threads), from /proc/<pid>/stat."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def server_cpu() -> dict[int, float]:
    """CPU so far of each PostgreSQL server process on this machine (comm ``postgres``).

    The benchmark's server runs beside the workers here, so what each job costs it is
    the CPU its processes spend while jobs flow (backends, WAL writer, checkpointer).
    """
    out: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/comm") as f:
                if f.read().strip() != "postgres":
                    continue
        except OSError:
            continue
        out[int(entry)] = cpu_seconds([int(entry)])
    return out


def machine_busy() -> float:
    """CPU seconds every core of this machine spent busy so far (/proc/stat: all but idle
    and iowait), whoever spent them."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def descendants(root: int) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


class Workers:
    """Worker processes of the peer under test, started from argv lists."""

    def __init__(self, commands: Sequence[Sequence[str]], env: dict[str, str], cwd: str) -> None:
        full = {**os.environ, **env}
        here = os.path.dirname(os.path.abspath(__file__))
        full["PYTHONPATH"] = here + os.pathsep + full.get("PYTHONPATH", "")
        full.setdefault("PYTHONUNBUFFERED", "1")
        self.log_path = os.path.join(env.get("BENCH_PROBE_DIR", "/tmp"), "workers.log")
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.procs = [
            subprocess.Popen(
                list(cmd),
                env=full,
                cwd=cwd,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            for cmd in commands
        ]

    def tree(self) -> list[int]:
        pids: list[int] = []
        for p in self.procs:
            if p.poll() is None:
                pids.extend(descendants(p.pid))
        return pids

    def check_alive(self) -> None:
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(
                    f"worker {p.args[:3]} exited with {p.returncode}: " + self.log_tail()
                )

    def log_tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return " | ".join(f.read().splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace: float = 10.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(deadline - time.monotonic(), 0.1))
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        self._log.close()


def memory(pids: Sequence[int]) -> dict[str, Any]:
    """Peak (VmHWM) and current (VmRSS) resident memory of each process, in kB."""
    out = {}
    for pid in pids:
        hwm = proc_status(pid, "VmHWM")
        if hwm is not None:
            out[str(pid)] = {"hwm_kb": hwm, "rss_kb": proc_status(pid, "VmRSS")}
    return out


def percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    k = (len(sorted_values) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


# -- the scenarios every adapter runs -----------------------------------------------


def throughput(
    spec: dict[str, Any],
    prefill: Callable[[int], float],
    commands: Callable[[int], list[list[str]]],
) -> dict[str, Any]:
    """Pre-fill ``jobs``, start the workers, time the handlers from first to last."""
    n = spec["jobs"]
    hooks = {"before_prefill": hook(spec, "before_prefill")}
    bulk_seconds = prefill(n)
    # ANALYZE (every PostgreSQL system alike) and any other marks the harness asks for,
    # between the prefill and the workers: see bench.pgstats.
    hooks["after_prefill"] = hook(spec, "after_prefill")
    probe = Probe(slots=0)
    workers = Workers(commands(spec["procs"]), probe.env(), spec["cwd"])
    try:
        started = time.monotonic()
        total = (0, 0.0, 0.0)
        deadline = started + spec.get("timeout", 120)
        cpu_mark: tuple[int, float] | None = None  # (jobs done, CPU s) once jobs flow
        server_mark: dict[int, float] = {}
        busy_mark = 0.0
        while time.monotonic() < deadline:
            total = probe.wait(n, timeout=0.5 if cpu_mark else 0.05, cap=spec.get("cap"))
            if cpu_mark is None and total[0] >= 50 and total[0] < n:
                cpu_mark = (probe.totals()[0], cpu_seconds(probe.pids()))
                server_mark = server_cpu()
                busy_mark = machine_busy()
            if total[0] >= n or (total[1] and time.monotonic() - total[1] > spec.get("cap", 1e9)):
                break
            workers.check_alive()
        count, first, last = total
        if count < 2:
            raise RuntimeError(f"only {count} job(s) ran: " + workers.log_tail())
        pids = probe.pids()
        cpu_us = server_us = machine_us = None
        if cpu_mark is not None and count > cpu_mark[0]:
            cpu_us = (cpu_seconds(pids) - cpu_mark[1]) / (count - cpu_mark[0]) * 1e6
            spent = sum(cpu - server_mark.get(pid, 0.0) for pid, cpu in server_cpu().items())
            server_us = spent / (count - cpu_mark[0]) * 1e6 if server_mark else None
            machine_us = (machine_busy() - busy_mark) / (count - cpu_mark[0]) * 1e6
        mem = memory(pids)
        tree = memory(workers.tree())
        shares = probe.by_process()
    finally:
        workers.stop()
        probe.cleanup()
    hooks["after_run"] = hook(spec, "after_run")
    return {
        "hooks": {k: v for k, v in hooks.items() if v is not None},
        "rate": (count - 1) / (last - first) if last > first else None,
        "done": count,
        "window_s": last - first,
        "startup_s": first - started if first else None,
        "capped": count < n,
        "bulk_rate": n / bulk_seconds if bulk_seconds else None,
        "job_pids": pids,
        "by_process": shares,
        "cpu_us_per_job": cpu_us,  # worker processes' CPU per job once jobs flowed
        # PostgreSQL's processes on this machine, over the same jobs (None: no server here)
        "server_cpu_us_per_job": server_us,
        "machine_cpu_us_per_job": machine_us,  # every busy core, whoever used it
        "memory": mem,
        "tree_memory": tree,
    }


def latency(
    spec: dict[str, Any],
    enqueue: Callable[[int], None],
    commands: Callable[[int], list[list[str]]],
    warmup: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """One idle worker; ``jobs`` single enqueues at ``rate``/s; enqueue to handler start."""
    n, rate = spec["jobs"], spec["rate"]
    probe = Probe(slots=n + 1)
    workers = Workers(commands(1), probe.env(), spec["cwd"])
    try:
        # A first job proves the worker is up and connected; then it idles a moment.
        deadline = time.monotonic() + spec.get("timeout", 120)
        (warmup or (lambda: enqueue(n)))()
        while probe.totals()[0] < 1:
            if time.monotonic() > deadline:
                raise RuntimeError("worker never ran the warm-up job: " + workers.log_tail())
            workers.check_alive()
            time.sleep(0.02)
        time.sleep(1.0)
        idle = memory(probe.pids())
        sent = [0.0] * n
        returned = [0.0] * n
        t0 = time.monotonic()
        for i in range(n):
            target = t0 + i / rate
            pause = target - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            sent[i] = time.monotonic()
            enqueue(i)
            returned[i] = time.monotonic()
        probe.wait(n + 1, timeout=30)
        starts = probe.starts(n)
    finally:
        workers.stop()
        probe.cleanup()
    lat = sorted((s - e) * 1000 for s, e in zip(starts, sent, strict=True) if s)
    after = sorted((s - r) * 1000 for s, r in zip(starts, returned, strict=True) if s)
    return {
        "p50_ms": percentile(lat, 0.50),
        "p95_ms": percentile(lat, 0.95),
        "p99_ms": percentile(lat, 0.99),
        "max_ms": lat[-1] if lat else None,
        "after_commit_p50_ms": percentile(after, 0.50),
        "after_commit_p99_ms": percentile(after, 0.99),
        "seen": len(lat),
        "idle_memory": idle,
    }


def hook(spec: dict[str, Any], name: str) -> Any:
    """Run the command the harness put in ``spec[name]`` (an argv); its last JSON line.

    The harness's own python runs it (psycopg, whatever the peer's venv has), so every
    system gets the same ANALYZE and the same measurements.
    """
    argv = spec.get(name)
    if not argv:
        return None
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{name} hook failed: {out.stderr.strip()[-500:]}")
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def commands_scenario(commands: Callable[[int], list[list[str]]]) -> Any:
    """An adapter scenario printing one replica's worker argv and the environment it needs
    (the chaos scenarios of bench.scenarios start, kill and restart replicas themselves)."""

    def scenario(spec: dict[str, Any]) -> dict[str, Any]:
        argvs = commands(1)
        env = {
            k: v for k, v in os.environ.items() if k.startswith("BENCH_") or k in ("ERRANDS_URL",)
        }
        return {"argv": argvs[0], "all": argvs, "env": env}

    return scenario


def produce(spec: dict[str, Any], connect: Callable[[], Callable[[int], None]]) -> dict[str, Any]:
    """Enqueue jobs 0, 1, 2, ... one call each at ``rate``/s until SIGTERM or ``seconds``.

    ``connect()`` gives an enqueue function on a new connection; when a call fails (the
    database restarted, the backend was killed) the producer reconnects and retries the
    same job, so every number it reports was acknowledged by the store. Progress is
    written to ``spec["progress"]`` (acknowledged count, failures) after every call.
    """
    rate = float(spec["rate"])
    deadline = time.monotonic() + float(spec.get("seconds", 1e9))
    path = spec["progress"]
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    enqueue: Callable[[int], None] | None = None
    sent = failures = 0
    t0 = time.monotonic()
    with open(path, "wb+") as f:
        os.ftruncate(f.fileno(), 24)
        m = mmap.mmap(f.fileno(), 24)
        while not stopping and time.monotonic() < deadline:
            target = t0 + sent / rate
            pause = target - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            try:
                if enqueue is None:
                    enqueue = connect()
                enqueue(sent)
                sent += 1
            except Exception as exc:
                failures += 1
                enqueue = None
                if failures <= 5 or failures % 100 == 0:
                    print(f"produce: call {failures} failed: {exc!r}"[:300], file=sys.stderr)
                time.sleep(0.2)
            struct.pack_into("<qqd", m, 0, sent, failures, time.monotonic())
        m.flush()
    return {"sent": sent, "failures": failures}


def progress(path: str) -> tuple[int, int]:
    """(jobs acknowledged, failed calls) of a running :func:`produce`."""
    try:
        with open(path, "rb") as f:
            data = f.read(24)
    except OSError:
        return 0, 0
    if len(data) < 24:
        return 0, 0
    sent, failures, _ = struct.unpack_from("<qqd", data, 0)
    return sent, failures


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(scenarios: dict[str, Callable[[dict[str, Any]], dict[str, Any]]]) -> None:
    """``adapter.py SCENARIO SPEC_JSON``: run it and print one JSON line last."""
    name, spec = sys.argv[1], json.loads(sys.argv[2])
    # Stopped by the harness: unwind, so the worker processes started here are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = scenarios[name](spec)
    sys.stdout.write("\n" + json.dumps({"ok": True, **result}) + "\n")
    sys.stdout.flush()
