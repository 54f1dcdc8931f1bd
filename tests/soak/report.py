"""The soak's report: the figures RELIABILITY.md asks for, then every other figure."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .checker import Findings
    from .run import SoakConfig
    from .store import Store

HEADLINE = (
    "enqueued",
    "lost",
    "duplicate executions",
    "faults injected",
    "recovery s (max, p99)",
    "pickup latency s (p50, p99)",
    "store health",
)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, tuple):
        return ", ".join("-" if v is None else _fmt(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k}={_fmt(v)}" for k, v in value.items()) or "-"
    if isinstance(value, list):
        return "; ".join(str(v) for v in value) or "-"
    return str(value)


def render(
    config: SoakConfig,
    findings: Findings,
    store: Store,
    timings: dict[str, float],
    info: dict[str, str],
) -> str:
    f = findings.figures
    states = f.get("states", {})
    share = f.get("explained share", 1.0)
    verdict = "PASS" if not findings.violations else f"FAIL ({len(findings.violations)})"
    lines = [
        f"errands chaos soak on {config.backend}: {verdict}",
        f"  {datetime.now(UTC):%Y-%m-%d %H:%M UTC}; {info.get('machine')}",
        "  " + ", ".join(f"{k} {v}" for k, v in info.items() if k != "machine"),
        f"  {config.jobs:,} jobs of the mix over {config.workers} worker processes x "
        f"{config.concurrency}, lease {config.lease:g} s, poll {config.poll_interval:g} s, "
        f"maintenance tick {config.maintenance_tick:g} s, seed {config.seed}",
        f"  workflows beside the mix: {config.workflows.batches:,} batches of "
        f"{config.workflows.batch_size} members, {config.workflows.dags:,} DAGs",
        "",
    ]
    if findings.violations:  # first: a failing test's message may be cut short in a CI log
        lines.append("  VIOLATIONS")
        lines.extend(f"  - {v}" for v in findings.violations)
        lines.append("")
    lines += [
        f"  enqueued            {f.get('enqueued', 0):>9,}   (+ {f.get('cron jobs', 0)} cron)",
        f"  completed           {states.get('completed', 0):>9,}",
        f"  dead                {states.get('dead', 0):>9,}   {_fmt(f.get('dead by reason'))}",
        f"  cancelled           {states.get('cancelled', 0):>9,}",
        f"  lost                {f.get('lost', 0):>9,}   (must be 0)",
        f"  duplicate executions{f.get('duplicate executions', 0):>9,}   "
        f"explained by recorded lease losses: {share:.0%} (must be 100 %)",
        f"  faults injected     {_fmt(f.get('faults injected'))}",
        f"  recovery time s     max, p99: {_fmt(f.get('recovery s (max, p99)'))} "
        f"(bound {f.get('recovery bound (2 x (lease + poll)) s', 0):g} s); "
        f"by fault: {_fmt(f.get('recovery s by fault (max)'))}",
        f"  pickup latency s    p50, p99: {_fmt(f.get('pickup latency s (p50, p99)'))}; "
        f"away from faults: {_fmt(f.get('pickup latency away from faults s (p50, p99)'))}",
        f"  rescued jobs s      p50, p99, max: "
        f"{_fmt(f.get('pickup latency of rescued jobs s (p50, p99, max)'))}",
        f"  store health        {f.get('store health')}",
        f"  workflows           {_fmt(f.get('workflows by shape'))} "
        f"(acknowledged / stored {f.get('workflows (acknowledged / stored)', '-')})",
        f"  workflow members    expected / enqueued / ended "
        f"{f.get('workflow members (expected / enqueued / ended)', '-')}",
        f"  callbacks fired     {_fmt(f.get('workflow callbacks fired'))}",
        f"  workflows stuck     {f.get('workflows stuck', 0):>9,}   (must be 0)",
        "",
        "  timings s: " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()),
    ]
    shown = {
        "states", "explained share", "dead by reason", "cron jobs", "recovery s by fault (max)",
        "recovery bound (2 x (lease + poll)) s", "notes", "episodes",
        "pickup latency away from faults s (p50, p99)",
        "pickup latency of rescued jobs s (p50, p99, max)", "workflows by shape",
        "workflows (acknowledged / stored)", "workflow members (expected / enqueued / ended)",
        "workflow callbacks fired", "workflows stuck", *HEADLINE,
    }  # fmt: skip
    for key, value in f.items():
        if key not in shown:
            lines.append(f"  {key}: {_fmt(value)}")
    for note in f.get("notes") or []:
        lines.append(f"  note: {note}")
    lines.append("  faults, in order (start after launch + duration, recovery s, detail):")
    lines.extend(f"    {e}" for e in f.get("episodes") or [])
    if findings.observations:
        lines.append("")
        lines.append("  OBSERVATIONS (known issues, reported without failing the run)")
        lines.extend(f"  - {o}" for o in findings.observations)
    return "\n".join(lines) + "\n"
