"""Jinja filters: times, durations, JSON, and masking of sensitive values in free text."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from ..jsontext import json_text


def to_epoch(value: datetime | float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        return value.timestamp()
    return float(value)


def when(value: datetime | float | None) -> str:
    """``2026-05-01 12:00:03 UTC``; an em dash for no time."""
    epoch = to_epoch(value)
    if epoch is None:
        return "—"
    return datetime.fromtimestamp(epoch, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def iso(value: datetime | float | None) -> str:
    epoch = to_epoch(value)
    return "" if epoch is None else datetime.fromtimestamp(epoch, tz=UTC).isoformat()


def duration(seconds: float | None) -> str:
    """``850 ms``, ``12 s``, ``4 min 3 s``, ``2 h 5 min``, ``3 d 4 h``."""
    if seconds is None:
        return "—"
    if seconds < 0:
        seconds = 0.0
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s" if secs and minutes < 10 else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"


def ago(value: datetime | float | None, now: float | None = None) -> str:
    epoch = to_epoch(value)
    if epoch is None:
        return "—"
    delta = (now if now is not None else time.time()) - epoch
    if abs(delta) < 1:
        return "just now"
    if delta < 0:
        return "in " + duration(-delta)
    return duration(delta) + " ago"


def pretty_json(value: Any) -> str:
    return json_text(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)


def short_json(value: Any, limit: int = 90) -> str:
    text = json_text(
        value, sort_keys=True, ensure_ascii=False, separators=(", ", ": "), default=str
    )
    return text if len(text) <= limit else text[: limit - 1] + "…"


def trace_id(meta: Any) -> str | None:
    """The trace id in a job's meta: ``trace_id``, or from a W3C ``traceparent``."""
    if not isinstance(meta, dict):
        return None
    stack: list[Any] = [meta]
    while stack:
        item = stack.pop()
        if not isinstance(item, dict):
            continue
        for key in ("trace_id", "traceId"):
            value = item.get(key)
            if isinstance(value, str) and value:
                return value
        parent = item.get("traceparent")
        if isinstance(parent, str):
            parts = parent.split("-")
            if len(parts) >= 3 and len(parts[1]) == 32:
                return parts[1]
        stack.extend(v for v in item.values() if isinstance(v, dict))
    return None


def progress_message(job: Any) -> str:
    """A job's ``ctx.progress`` message, its sensitive arguments' values masked (as its
    errors are): ``ctx.progress(.5, f"sending to {email}")`` showed the address."""
    from ..masking import mask_text, sensitive_values

    message = job.progress.message if job.progress is not None else ""
    return mask_text(message, sensitive_values(job)) if message else ""


FILTERS = {
    "progress_message": progress_message,
    "when": when,
    "iso": iso,
    "duration": duration,
    "ago": ago,
    "pretty_json": pretty_json,
    "short_json": short_json,
}
