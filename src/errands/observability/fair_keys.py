"""A fair queue's per-key figures, bounded for display and for metric labels: the ``n``
keys with the most recent worker time, then one ``"other"`` row summing the rest (so a
queue with 100,000 tenants still makes a bounded number of series)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..backends.base import FairKeyFigures

OTHER = "other"
TOP_KEYS_DEFAULT = 10


@dataclass(frozen=True)
class KeyRow:
    """One shown key (or ``"other"``): its figures and share of recent worker time."""

    figures: FairKeyFigures
    share: float  # of the queue's recent worker time, 0..1
    keys: int = 1  # how many keys the row sums ("other": the rest)

    def as_dict(self) -> dict[str, Any]:
        f = self.figures
        return {
            "key": f.key,
            "keys": self.keys,
            "weight": f.weight,
            "weight_source": f.weight_source if self.keys == 1 else None,
            "due": f.due,
            "running": f.running,
            "recent_worker_seconds": round(f.recent_seconds, 3),
            "share": round(self.share, 4),
            "worker_seconds_total": round(f.seconds_total, 3),
            "attempts": f.attempts,
            "mean_dwell_seconds": None if f.mean_dwell is None else round(f.mean_dwell, 3),
        }


def top_keys(figures: Sequence[FairKeyFigures], n: int = TOP_KEYS_DEFAULT) -> list[KeyRow]:
    """The ``n`` keys with the most recent worker time (then the most due jobs), then one
    ``"other"`` row for the rest, if any."""
    total = sum(f.recent_seconds for f in figures)
    ranked = sorted(figures, key=lambda f: (-f.recent_seconds, -f.due, f.key))
    top, rest = ranked[:n], ranked[n:]
    if any(f.key == OTHER for f in top):
        # a key named "other" shown beside the aggregate: two series with one label set
        # (an exposition Prometheus rejects whole); it is counted in the aggregate
        rest = [f for f in top if f.key == OTHER] + rest
        top = [f for f in top if f.key != OTHER]
    rows = [KeyRow(f, f.recent_seconds / total if total > 0 else 0.0) for f in top]
    if rest:
        other = FairKeyFigures(
            key=OTHER,
            recent_seconds=sum(f.recent_seconds for f in rest),
            seconds_total=sum(f.seconds_total for f in rest),
            attempts=sum(f.attempts for f in rest),
            dwell_total=sum(f.dwell_total for f in rest),
            running=sum(f.running for f in rest),
            due=sum(f.due for f in rest),
            weight=sum(f.weight for f in rest),
        )
        share = other.recent_seconds / total if total > 0 else 0.0
        rows.append(KeyRow(other, share, keys=len(rest)))
    return rows
