"""The checks of the workload shapes issue 16 part B added to the soak.

Each shape is where a defect of part A lived; each check proves its outcome under the
chaos, from the job rows, the ``soak_effects`` rows and the ledger:

- ``slow_return``, ``tx_hold``: a handler that returns normally after being asked to
  stop (operator cancel, lost lease, self-fencing) is never recorded ``completed``
  (its result says ``cut_short``);
- ``keyed_a``/``keyed_b``: one job per account at a time, across queues and queue
  overrides: no two runs of one account overlap, unless a recorded loss ended one;
- ``uniq_retry``: ``ctx.idempotency_key`` is the same on every run of a job and never
  another job's, also when ``unique_for`` let a second job take the key;
- ``signalled``: each ends completed with the payload the workload sent;
- on_dead hooks: run for dead jobs only (the slow one of ``soak.hooked`` included);
- graceful stops mid-job (``sigterm``): every worker exits 0, the long job is released
  (kind ``released``) and runs again;
- ``ctx.progress``: stored while long jobs run (reported).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import TYPE_CHECKING

from .records import LOSS_KINDS, Findings, JobInfo, Run

if TYPE_CHECKING:
    from .chaos import Chaos
    from .workload import Ledger


def check(
    out: Findings,
    jobs: dict[int, JobInfo],
    by_job: dict[int, list[Run]],
    ledger: Ledger,
    chaos: Chaos,
) -> None:
    _cut_short(out, jobs)
    _keys(out, jobs, by_job)
    _idempotency_keys(out, jobs, by_job, ledger)
    _signals(out, jobs, ledger)
    _hooks(out, jobs, by_job)
    _releases(out, jobs, chaos)
    _progress(out, jobs, chaos)


def _lost_tokens(job: JobInfo) -> set[str]:
    return {
        str(e["lease_token"])
        for e in job.errors
        if e.get("kind") in LOSS_KINDS and e.get("lease_token")
    }


# -- A3: a return after a stop request is not a completion ------------------------------------
def _cut_short(out: Findings, jobs: dict[int, JobInfo]) -> None:
    wrong = [
        (j.id, j.name, j.attempt, brief_result(j))
        for j in jobs.values()
        if j.state == "completed" and isinstance(j.result, dict) and j.result.get("cut_short")
    ]
    ended = Counter(j.state for j in jobs.values() if j.name == "soak.slow_return")
    out.figures["slow_return jobs ended (returns after a stop request)"] = dict(ended)
    if wrong:
        out.fail(
            "A3",
            f"{len(wrong)} handler(s) that returned after being asked to stop were recorded "
            "completed",
            wrong,
        )


def brief_result(job: JobInfo) -> object:
    return {k: v for k, v in job.result.items() if k != "token"}


# -- A5: per-key limits across queues ----------------------------------------------------------
def _keys(out: Findings, jobs: dict[int, JobInfo], by_job: dict[int, list[Run]]) -> None:
    """Each keyed run spans its ``run`` row to its ``end`` row (both written while its row
    is ``running``); runs of one account, each not ended by a recorded loss, must not
    overlap."""
    spans: dict[str, list[tuple[float, float, int, int]]] = defaultdict(list)
    for job in jobs.values():
        if job.name not in ("soak.keyed_a", "soak.keyed_b"):
            continue
        lost = _lost_tokens(job)
        rows = by_job.get(job.id, [])
        for start in (r for r in rows if r.kind == "run" and r.token not in lost):
            end = [r for r in rows if r.kind == "end" and r.token == start.token]
            if end and start.detail:
                spans[start.detail].append((start.at, end[0].at, job.id, start.attempt))
    overlaps = []
    for account, items in spans.items():
        items.sort()
        latest: tuple[float, float, int, int] | None = None
        for span in items:
            if latest is not None and span[0] < latest[1]:
                overlaps.append((account, latest[2], span[2], round(latest[1] - span[0], 3)))
            if latest is None or span[1] > latest[1]:
                latest = span
    out.figures["keyed runs checked for overlap (accounts)"] = (
        f"{sum(len(v) for v in spans.values())} ({len(spans)})"
    )
    if overlaps:
        out.fail(
            "A5",
            f"{len(overlaps)} overlap(s) of two runs of one account (concurrency_limit=1)",
            overlaps,
        )


# -- A6: one idempotency key per job, for life ---------------------------------------------------
def _idempotency_keys(
    out: Findings, jobs: dict[int, JobInfo], by_job: dict[int, list[Run]], ledger: Ledger
) -> None:
    owner: dict[str, int] = {}
    changed, shared = [], []
    for job in jobs.values():
        if job.name != "soak.uniq_retry":
            continue
        seen = {r.detail for r in by_job.get(job.id, []) if r.kind == "run" and r.detail}
        if len(seen) > 1:
            changed.append((job.id, sorted(seen)))
        for key in seen:
            if owner.setdefault(key, job.id) != job.id:
                shared.append((key, owner[key], job.id))
    second_jobs = sum(1 for _, first, second in ledger.unique_pairs if first != second)
    out.figures["unique_for keys enqueued again (a second job made)"] = (
        f"{len(ledger.unique_pairs)} ({second_jobs})"
    )
    if changed:
        out.fail("A6", f"{len(changed)} job(s) saw ctx.idempotency_key change", changed)
    if shared:
        out.fail("A6", f"{len(shared)} ctx.idempotency_key(s) shared by two jobs", shared)


# -- durable signals -----------------------------------------------------------------------------
def _signals(out: Findings, jobs: dict[int, JobInfo], ledger: Ledger) -> None:
    wrong, unsent = [], []
    for job in jobs.values():
        if job.name != "soak.signalled":
            continue
        sent = ledger.signals.get(job.id)
        if sent is None:
            unsent.append(job.id)
        elif job.state == "completed" and (job.result or {}).get("payload") != sent:
            wrong.append((job.id, (job.result or {}).get("payload"), sent))
    out.figures["signals sent / jobs waiting for one"] = (
        f"{len(ledger.signals)} / {sum(1 for j in jobs.values() if j.name == 'soak.signalled')}"
    )
    if unsent:
        out.fail("signals", f"{len(unsent)} signalled job(s) the workload never signalled",
                 unsent)  # fmt: skip
    if wrong:
        out.fail("signals", f"{len(wrong)} job(s) got another payload than the one sent", wrong)


# -- A7: on_dead hooks, a slow one among them -----------------------------------------------------
def _hooks(out: Findings, jobs: dict[int, JobInfo], by_job: dict[int, list[Run]]) -> None:
    """Every dead job's on_dead hooks ran at least once: a death and the record that its
    hooks are due are one write, and the leader runs those its worker did not (killed
    first). More than once is allowed (reported): a worker killed after its hooks ran but
    before it marked them done, or one that fell past the grace. A hook for a job that is
    not dead is a violation."""
    ran: Counter[int] = Counter()
    for job_id, rows in by_job.items():
        ran[job_id] += sum(1 for r in rows if r.kind == "hook")
    dead = [j for j in jobs.values() if j.state == "dead"]
    hooked = [j for j in dead if j.name == "soak.hooked"]
    not_dead = [(i, jobs[i].state) for i in ran if ran[i] and i in jobs and jobs[i].state != "dead"]
    out.figures["on_dead hooks ran for dead jobs (slow hooks)"] = (
        f"{sum(1 for j in dead if ran[j.id])} of {len(dead)} "
        f"({sum(1 for j in hooked if ran[j.id])} of {len(hooked)})"
    )
    out.figures["on_dead hooks run more than once for a job"] = sum(
        1 for n in ran.values() if n > 1
    )
    never = [j.id for j in dead if not ran[j.id]]
    if never:
        out.fail("A7", f"{len(never)} dead job(s) whose on_dead hooks never ran", never)
    if not_dead:
        out.fail("hooks", f"{len(not_dead)} on_dead hook(s) ran for a job that is not dead",
                 not_dead)  # fmt: skip


# -- F4 / A10: graceful stops mid-job --------------------------------------------------------------
def _releases(out: Findings, jobs: dict[int, JobInfo], chaos: Chaos) -> None:
    releases = sum(1 for j in jobs.values() for e in j.errors if e.get("kind") == "released")
    targets = [jobs[i] for i in chaos.released_targets if i in jobs]
    with_release = [
        j for j in targets if any(e.get("kind") == "released" for e in j.errors)
    ]  # fmt: skip
    out.figures["graceful stops mid-job: exits"] = dict(Counter(str(c) for c in chaos.stop_exits))
    out.figures["graceful stops cut short by an armed fault point (F2 crash)"] = dict(
        Counter(chaos.stops_crashed)
    )
    out.figures["releases recorded (targets of a graceful stop released)"] = (
        f"{releases} ({len(with_release)} of {len(targets)})"
    )
    bad_exits = [c for c in chaos.stop_exits if c != 0]
    if bad_exits:
        out.fail("F4", f"{len(bad_exits)} worker(s) did not exit 0 on a graceful stop mid-run",
                 bad_exits)  # fmt: skip
    if targets and not with_release:
        out.fail("A10", f"none of the {len(targets)} long jobs running at a graceful stop "
                 "has its release recorded", [j.id for j in targets])  # fmt: skip


def _progress(out: Findings, jobs: dict[int, JobInfo], chaos: Chaos) -> None:
    long_names = ("soak.slow", "soak.slow_return", "soak.aslow")
    long_done = [j for j in jobs.values() if j.name in long_names and j.state == "completed"]
    out.figures["ctx.progress stored (long jobs completed / fault targets seen running)"] = (
        f"{sum(1 for j in long_done if j.progress is not None)} of {len(long_done)} / "
        f"{dict(chaos.progress_seen)}"
    )
