"""How much of a failure's text errands keeps: one cap for every error entry it writes.

A handler's exception is user code, and its message has no size of its own: a
``RuntimeError`` quoting a 5 MB response body was stored whole in the job's errors, once
per attempt, and went whole into the ``retrying``/``dead`` log lines, the dashboard's job
page and every ``dlq`` listing. Every error entry errands builds (a handler's exception in
the worker's threads, its event loop or a process-pool child; a rescue; a refused
outcome) keeps at most :data:`MESSAGE_LIMIT` characters of its message (the head, and how
many were cut) and :data:`TRACEBACK_LIMIT` of its traceback (the innermost frames, whose
parts are clipped the same way); a log line quotes at most :data:`LOG_LIMIT` of either's
lines.
"""

from __future__ import annotations

import traceback as tb
from collections.abc import Callable

MESSAGE_LIMIT = 8_000  # characters of an error entry's message (and of a traceback's part)
TRACEBACK_LIMIT = 16_000  # characters of an error entry's traceback (its innermost frames)
LOG_LIMIT = 1_000  # characters of a message, or of a traceback's line, in a log line

_NOTE_ROOM = 40  # "… (N more characters)", N up to 19 digits


def scrub(text: str, secrets: list[str]) -> str:
    """``text`` with each of ``secrets`` (a job's sensitive values) replaced by ``***``."""
    for secret in sorted(secrets, key=len, reverse=True):  # longest first: one may hold another
        text = text.replace(secret, "***")
    # PostgreSQL cannot store NUL: an error quoting one would wedge the outcome write
    return text.replace("\x00", "\\x00")


def clip(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """``text``, or its head and how many characters were cut: at most ``limit``
    characters all told, so clipping a clipped text again leaves it as it is."""
    if len(text) <= limit:
        return text
    if limit <= _NOTE_ROOM:  # no room to say what was cut
        return text[:limit]
    keep = limit - _NOTE_ROOM
    return f"{text[:keep]}… ({len(text) - keep} more characters)"


def clip_trace(trace: str) -> str:
    """A traceback's last :data:`TRACEBACK_LIMIT` characters (the innermost frames and
    the exception's line are the ones that say what failed)."""
    if len(trace) > TRACEBACK_LIMIT:
        return "...\n" + trace[-TRACEBACK_LIMIT:]
    return trace


def format_trace(exc: BaseException, clean: Callable[[str], str] = str) -> str:
    """``exc``'s traceback as :func:`traceback.format_exception` writes it, each part (a
    frame, an exception's line with its message) clipped to :data:`MESSAGE_LIMIT` first:
    a huge message would otherwise fill the whole :data:`TRACEBACK_LIMIT` and leave no
    frame. ``clean``: applied to each part before it is clipped (sensitive values
    scrubbed: a cut never leaves part of one). May raise (an exception whose ``__str__``
    raises): callers guard it."""
    return clip_trace("".join(clip(clean(part)) for part in tb.format_exception(exc)))


def clip_lines(text: str, limit: int = LOG_LIMIT) -> str:
    """``text`` with each line longer than ``limit`` clipped (a traceback in a log line:
    its frames kept, a huge message's line cut)."""
    if len(text) <= limit:
        return text
    return "\n".join(clip(line, limit) for line in text.split("\n"))
