"""Hiding sensitive arguments wherever a job's data is shown (CLI, dashboard).

A job's ``sensitive`` arguments are masked in its arguments (:func:`errands.payload.mask`)
and, since results, error messages and tracebacks may quote them, their values are also
replaced by ``***`` anywhere in free text or nested JSON shown beside them.
"""

from __future__ import annotations

from typing import Any

from .jobs import Job
from .jsontext import int_text, json_text
from .payload import MASK

__all__ = ["MASK", "mask_text", "mask_value", "sensitive_values"]


def sensitive_values(job: Job) -> list[str]:
    """The text of every sensitive argument, longest first (to hide it in free text):
    the whole value as JSON and, for a dict or list, every scalar inside it (a token
    nested in ``credentials`` may be quoted on its own)."""
    if not job.sensitive or not isinstance(job.args, dict):
        return []
    found: set[str] = set()
    for name in job.sensitive:
        value = job.args.get(name)
        if value is None:
            continue
        _collect(value, found)
        if not isinstance(value, str):
            found.add(json_text(value, default=str))
    return sorted((t for t in found if len(t) >= 3), key=len, reverse=True)


def _collect(value: Any, found: set[str]) -> None:
    if isinstance(value, dict):
        for item in value.values():
            _collect(item, found)
    elif isinstance(value, list | tuple):
        for item in value:
            _collect(item, found)
    elif isinstance(value, str):
        found.add(value)
    elif value is not None and not isinstance(value, bool):
        found.add(int_text(value) if isinstance(value, int) else str(value))  # any length
        found.add(json_text(value, default=str))


def mask_text(text: str | None, secrets: list[str]) -> str:
    """``text`` with every sensitive value replaced by ``***`` (errors may quote arguments)."""
    if not text:
        return text or ""
    for secret in secrets:
        if len(secret) >= 3:
            text = text.replace(secret, MASK)
    return text


def mask_value(value: Any, secrets: list[str]) -> Any:
    """A JSON value with sensitive values masked anywhere inside it (results, meta): text
    that quotes one, and a number equal to one (a sensitive amount echoed in a result)."""
    if not secrets:
        return value
    if isinstance(value, str):
        return mask_text(value, secrets)
    if isinstance(value, list):
        return [mask_value(v, secrets) for v in value]
    if isinstance(value, dict):
        return {k: mask_value(v, secrets) for k, v in value.items()}
    if isinstance(value, int | float) and not isinstance(value, bool):
        text = int_text(value) if isinstance(value, int) else str(value)  # an int any length
        return MASK if text in secrets else value
    return value
