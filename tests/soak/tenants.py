"""The checks of the soak's fair queue (issue 19): quiet tenants beside a noisy one.

The workload sends quiet tenants' jobs (``soak.tenant``, tenants ``quiet0`` ..) in the
mix and, now and then, a burst of the noisy tenant's into the same fair queue. Checked
from the job rows, the ``soak_effects`` run rows and the fair usage rows:

- **starvation bound**: a quiet tenant's job is not overtaken by the noisy burst that
  was due before it. The property test's bound (every backlogged key is claimed within
  ceil(keys / slots) + 1 claim rounds) counted in claims: at most
  ``slots x (ceil(keys / slots) + 1)`` of the noisy tenant's jobs, due before the quiet
  job, are claimed between the quiet job falling due and its claim. FIFO would let the
  whole burst (100) go first. Enforced at full size, reported at CI size (a run that
  small may not overlap a burst and a quiet job often enough to mean much);
- **no fair slot leaked**: every claim of a tenant's job is folded into its key's usage
  exactly once, on whatever path it ended (completion, failure, rescue, release): per
  key, the usage's attempts equal the claims of its jobs (each job's attempt number
  plus its uncharged releases); and after the drain no key has a job running or due.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from typing import TYPE_CHECKING

from soak_app import NOISY, QUIET_TENANTS, TENANTS_QUEUE

from .records import Findings, JobInfo, Run, percentile

if TYPE_CHECKING:
    from .store import Store

TENANT_JOB = "soak.tenant"
SLOTS = 24  # the cluster's: 3 workers x 8 (cluster.py)


def check(
    out: Findings, store: Store, jobs: dict[int, JobInfo], runs: list[Run], *, enforce: bool
) -> None:
    _starvation(out, runs, enforce)
    _folds(out, store, jobs)


def _tenant(run: Run) -> str:
    return (run.detail or "").removeprefix("tenant:")


def _starvation(out: Findings, runs: list[Run], enforce: bool) -> None:
    started = [
        r
        for r in runs
        if r.name == TENANT_JOB
        and r.kind == "run"
        and r.claimed_at is not None
        and r.run_at is not None
    ]
    noisy = sorted((r.claimed_at, r.run_at) for r in started if _tenant(r) == NOISY)  # type: ignore[misc]
    quiet = [r for r in started if _tenant(r) != NOISY]
    claimed = [c for c, _ in noisy]
    bound = SLOTS * (math.ceil((QUIET_TENANTS + 1) / SLOTS) + 1)
    ahead: list[int] = []
    over: list[tuple[int, int, int]] = []
    for q in quiet:
        assert q.claimed_at is not None and q.run_at is not None
        lo = bisect.bisect_right(claimed, q.run_at)
        hi = bisect.bisect_left(claimed, q.claimed_at)
        # noisy claims while the quiet job waited, of noisy jobs due before it
        n = sum(1 for _, due in noisy[lo:hi] if due <= q.run_at)
        ahead.append(n)
        if n > bound:
            over.append((q.job_id, q.attempt, n))
    waits = {
        who: [max(r.claimed_at - r.run_at, 0.0) for r in rs]  # type: ignore[operator]
        for who, rs in (("quiet", quiet), ("noisy", [r for r in started if _tenant(r) == NOISY]))
    }
    out.figures["fair queue runs (quiet tenants / noisy tenant)"] = (
        f"{len(quiet)} / {len(started) - len(quiet)}"
    )
    out.figures["fair queue pickup s p50/p99 (quiet / noisy)"] = " / ".join(
        f"{percentile(w, 50) or 0:.3f}/{percentile(w, 99) or 0:.3f}"
        for w in (waits["quiet"], waits["noisy"])
    )
    out.figures["noisy jobs claimed ahead of a quiet one (p99, max; bound)"] = (
        f"{percentile([float(a) for a in ahead], 99) or 0:.0f}, {max(ahead, default=0)}; {bound}"
    )
    if not over:
        return
    message = (
        f"{len(over)} of {len(quiet)} quiet tenants' jobs waited while more than {bound} "
        "of the noisy tenant's jobs due before them were claimed"
    )
    if enforce:
        out.fail("fair starvation", message, sorted(over, key=lambda x: -x[2]))
    else:
        out.observations.append(f"fair starvation (reported at this size): {message}")


def _folds(out: Findings, store: Store, jobs: dict[int, JobInfo]) -> None:
    claims: Counter[str] = Counter()
    left: Counter[str] = Counter()
    for job in jobs.values():
        if job.name != TENANT_JOB:
            continue
        key = f"tenant:{job.args.get('tenant')}"
        released = sum(  # (one entry may count releases in a row)
            int(e.get("times") or 1) for e in job.errors if e.get("kind") == "released"
        )
        claims[key] += job.attempt + released
        if job.state in ("running", "available", "scheduled", "retryable"):
            left[key] += 1
    folded = {
        str(key): int(attempts)
        for key, attempts in store.query(
            "SELECT key, attempts FROM {s}errands_fair_usage WHERE queue = %s",
            (TENANTS_QUEUE,),
        )
    }
    out.figures["fair keys: claims folded / claims made"] = (
        f"{sum(folded.values())} / {sum(claims.values())} over {len(claims)} keys"
    )
    wrong = sorted(
        (key, folded.get(key, 0), made)
        for key, made in claims.items()
        if folded.get(key, 0) != made
    )
    if wrong:
        out.fail(
            "fair slot leaked",
            f"{len(wrong)} key(s) whose usage folded another number of claims than were made "
            "(key, folded, made)",
            wrong,
        )
    if left:
        out.fail(
            "fair slot leaked",
            "keys with jobs running or due after the drain",
            sorted(left.items()),
        )
