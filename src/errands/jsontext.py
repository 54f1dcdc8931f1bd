"""JSON text with ints of any length: a stored row may hold an int of more digits than
Python's int/str conversion takes (sys.get_int_max_str_digits, 4,300 by default), which
``json.loads`` and ``json.dumps`` then refuse with a ValueError. Rows written before such
ints were refused (2026-12-06: a job's arguments, result or step result) read back and
show whole through these, the limit left as it is: it is process-wide, and lifting it for
one read lifted it for every thread of the process.
"""

from __future__ import annotations

import json
from typing import Any


def int_of(digits: str) -> int:
    """The int JSON digits (``-?[0-9]+``) spell, however many: ``int()`` refuses more
    than this process's limit (sys.get_int_max_str_digits, 4,300 by default), so a longer
    run is read in halves, each within it. The limit itself is left as it is (it is
    process-wide: lifting it for one read lifted it for every thread)."""
    try:
        return int(digits)
    except ValueError:
        body = digits.removeprefix("-")
        if len(body) < 2 or not body.isdigit():  # not a run of digits: int() said why
            raise
    low = len(body) // 2
    value = int_of(body[:-low]) * 10**low + int_of(body[-low:])
    return -value if digits.startswith("-") else value


def int_text(value: int) -> str:
    """``value``'s decimal digits, however many (``str()`` refuses more than this
    process's limit): a longer int is written in halves, each within it."""
    if value < 0:
        return "-" + int_text(-value)
    try:
        return int.__repr__(value)
    except ValueError:
        pass
    low = int(value.bit_length() * 0.30102999566398) // 2  # about half its digits
    high, rest = divmod(value, 10**low)
    return int_text(high) + int_text(rest).rjust(low, "0")


def loads_stored(text: str) -> Any:
    """Stored JSON text read back as ``json.loads`` reads it, but an int of more digits
    than this process's limit (a row stored before such ints were refused, 2026-12-06:
    a job's arguments, result or step result) is read whole, the limit lifted for this
    read only (a ``parse_int`` hook; sys.set_int_max_str_digits is process-wide). Text
    that is not JSON raises json.loads's own error."""
    try:
        return json.loads(text)
    except ValueError as exc:
        first = exc
    try:  # (the hook costs a call per int: only for the text that needs it)
        return json.loads(text, parse_int=int_of)
    except ValueError:
        raise first from None


def json_text(value: Any, **options: Any) -> str:
    """``json.dumps(value, **options)``, with an int of more digits than this process's
    limit written whole (json.dumps raises ValueError for one, whatever ``default=``): a
    stored one read back by :func:`loads_stored` and shown by the CLI or the dashboard."""
    try:
        return json.dumps(value, **options)
    except ValueError:
        long_ints: dict[str, str] = {}
        marked = _mark_long_ints(value, long_ints, f"\x00errands-int-{id(long_ints)}-")
        if not long_ints:
            raise  # another ValueError (a cycle, a NaN refused): as json.dumps says it
        text = json.dumps(marked, **options)
        for mark, digits in long_ints.items():
            text = text.replace(json.dumps(mark), digits)
        return text


def _mark_long_ints(
    value: Any, found: dict[str, str], prefix: str, inside: frozenset[int] = frozenset()
) -> Any:
    """``value`` with each int too long for ``str()`` replaced by a marker string,
    ``found`` mapping each marker to the int's digits. A container inside itself is left
    as it is (``inside``: those being walked): json.dumps then says it is circular."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            int.__repr__(value)
        except ValueError:
            mark = f"{prefix}{len(found)}\x00"
            found[mark] = int_text(value)
            return mark
        return value
    if not isinstance(value, dict | list | tuple) or id(value) in inside:
        return value
    inside = inside | {id(value)}
    if isinstance(value, dict):
        return {k: _mark_long_ints(v, found, prefix, inside) for k, v in value.items()}
    return [_mark_long_ints(v, found, prefix, inside) for v in value]
