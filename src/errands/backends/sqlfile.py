"""Load named SQL blocks from a ``.sql`` file.

A block starts with a line ``-- name: query_name`` and runs to the next such line.
Every backend keeps its SQL in one ``queries.sql`` with the same query names.

A block holding the marker ``$RESCUED`` is written once and loaded twice: as
``query_name`` for fresh jobs (``rescues = 0``) and as ``query_name_suspect`` for rescued
ones (``rescues > 0``). The claim queries differ by that one predicate; two literal texts
(rather than a bound parameter) let each use its own partial index.
"""

from __future__ import annotations

import re
from importlib import resources

_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)
RESCUED = "$RESCUED"


def load_queries(package: str, filename: str = "queries.sql") -> dict[str, str]:
    text = resources.files(package).joinpath(filename).read_text(encoding="utf-8")
    parts = _NAME.split(text)
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        variants = {name: body.strip()}
        if RESCUED in body:
            variants = {
                name: body.strip().replace(RESCUED, "rescues = 0"),
                f"{name}_suspect": body.strip().replace(RESCUED, "rescues > 0"),
            }
        for variant, sql in variants.items():
            if variant in queries:
                raise ValueError(f"{package}/{filename}: query {variant!r} is defined twice")
            queries[variant] = sql
    return queries


def load_migrations(package: str) -> list[tuple[int, str, str]]:
    """Return ``(version, name, sql)`` for every ``NNNN_name.sql`` under ``migrations/``."""
    folder = resources.files(package).joinpath("migrations")
    found = []
    for entry in folder.iterdir():
        match = re.fullmatch(r"(\d{4})_(\w+)\.sql", entry.name)
        if match:
            found.append((int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort()
    versions = [v for v, _, _ in found]
    if versions != list(range(1, len(versions) + 1)):
        raise ValueError(f"{package} migrations must be numbered 0001, 0002, ... without gaps")
    return found
