"""Close names for a name that matches nothing (a mistyped queue or job name)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def close_names(word: str, candidates: Iterable[str], limit: int = 3) -> list[str]:
    """The candidates ``word`` most likely meant: the same name under a module prefix
    (``charge_order`` -> ``shop.charge_order``), names it starts or ends (``email`` ->
    ``emails``), then the closest spellings."""
    names = sorted(set(candidates) - {word})
    lowered = word.lower()
    found = [n for n in names if n.lower().rsplit(".", 1)[-1] == lowered]
    found += [n for n in names if n.lower().startswith(lowered) or lowered.startswith(n.lower())]
    found += [n for n in names if lowered in n.lower()]
    found += difflib.get_close_matches(word, names, n=limit, cutoff=0.6)
    return list(dict.fromkeys(found))[:limit]


def did_you_mean(what: str, word: str, candidates: Iterable[str]) -> str:
    """``no queue 'email' (did you mean emails?)``, or listing a few known ones."""
    names = sorted(set(candidates))
    close = close_names(word, names)
    if close:
        return f"no {what} {word!r} (did you mean {' or '.join(close)}?)"
    if names:
        shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
        return f"no {what} {word!r} (known: {shown})"
    return f"no {what} {word!r}"
