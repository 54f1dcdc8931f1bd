"""The source itself (DESIGN §4, issue 10 item 4): nothing in src/errands deserialises with
pickle or marshal, evaluates strings as code, runs a shell, or loads YAML unsafely; and SQL
is never assembled from values: statements come from the queries.sql files (bound
parameters only) or from the few allow-listed constants below, each with its reason.

Checked on the syntax tree, so docstrings that say "never pickled" do not count and an
aliased import (``import pickle as p``) does.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "errands"
SOURCES = sorted(p for p in SRC.rglob("*.py") if "static" not in p.parts)

BANNED_MODULES = {
    "pickle",
    "cPickle",
    "_pickle",
    "marshal",
    "shelve",
    "dill",
    "cloudpickle",
    "jsonpickle",
}
BANNED_CALLS = {"eval", "exec", "execfile", "__import__"}
BANNED_ATTRIBUTE_CALLS = {
    ("yaml", "load"): "yaml.load runs constructors; use yaml.safe_load",
    ("yaml", "unsafe_load"): "runs arbitrary constructors",
    ("yaml", "full_load"): "runs constructors",
    ("os", "system"): "runs a shell",
    ("os", "popen"): "runs a shell",
    ("subprocess", "getoutput"): "runs a shell",
    ("subprocess", "getstatusoutput"): "runs a shell",
}

# SQL built with an f-string or concatenation, where every interpolated value is safe.
SQL_FORMATTING_ALLOWED = {
    ("backends/sqlite/backend.py", "PRAGMA busy_timeout"): "an int() of the configured timeout",
    ("backends/sqlite/backend.py", "PRAGMA synchronous"): "checked against SYNCHRONOUS_CHOICES",
    ("backends/sqlite/backend.py", "PRAGMA journal_size_limit"): "an int() of a module constant",
    ("backends/postgres/notifier.py", "LISTEN"): "the channel is built from the schema name, "
    "which parse_postgres_url restricts to [a-z_][a-z0-9_]*",
    ("contrib/django/test.py", "DELETE FROM"): "table names from the constant TABLES",
    ("contrib/django/test.py", "TRUNCATE"): "the checked schema name and the constant TABLES",
    ("testing/_store.py", ""): "the test tools splice only '?' placeholder lists, the constant "
    "_SQLITE_NOW and the checked schema name; every value is bound",
}


def _trees() -> Iterator[tuple[str, ast.AST]]:
    for path in SOURCES:
        yield str(path.relative_to(SRC)), ast.parse(path.read_text(encoding="utf-8"), str(path))


def _dotted(node: ast.AST) -> tuple[str, ...]:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return tuple(reversed(parts))


EXECUTE = {("execute",), ("executemany",), ("executescript",)}


def banned_imports(name: str, tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module]
        elif isinstance(node, ast.Call) and _dotted(node.func)[-1:] in {
            ("import_module",),
            ("__import__",),
        }:
            modules = [
                a.value
                for a in node.args
                if isinstance(a, ast.Constant) and isinstance(a.value, str)
            ]
        for module in modules:
            if module.split(".")[0] in BANNED_MODULES:
                found.append(f"{name}:{node.lineno}: imports {module}")
    return found


def code_or_shell_calls(name: str, tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        dotted = _dotted(node.func)
        if len(dotted) == 1 and dotted[0] in BANNED_CALLS:
            found.append(f"{name}:{node.lineno}: {dotted[0]}(...)")
        why = BANNED_ATTRIBUTE_CALLS.get(dotted[-2:])  # type: ignore[call-overload]
        if why:
            found.append(f"{name}:{node.lineno}: {'.'.join(dotted)}: {why}")
        for keyword in node.keywords:
            if keyword.arg == "shell" and not (
                isinstance(keyword.value, ast.Constant) and keyword.value.value is False
            ):
                found.append(f"{name}:{node.lineno}: shell=... in {'.'.join(dotted)}")
    return found


def _sql_text(node: ast.AST) -> str | None:
    """The literal text of a statement built by f-string, concatenation or %, else None."""
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value for v in node.values if isinstance(v, ast.Constant))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mod):
        left = _sql_text(node.left)
        if left is not None:
            return left
        if isinstance(node.left, ast.Constant) and isinstance(node.left.value, str):
            return node.left.value
    if isinstance(node, ast.Call) and _dotted(node.func)[-1:] == ("format",):
        target = node.func.value  # type: ignore[attr-defined]
        if isinstance(target, ast.Constant) and isinstance(target.value, str):
            return target.value
    return None


def formatted_sql(name: str, tree: ast.AST, used: set[tuple[str, str]]) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and _dotted(node.func)[-1:] in EXECUTE and node.args):
            continue
        text = _sql_text(node.args[0])
        if text is None:
            continue
        allowed = [
            key
            for key in SQL_FORMATTING_ALLOWED
            if key[0] == name and text.lstrip().startswith(key[1])
        ]
        if allowed:
            used.update(allowed)
        else:
            found.append(f"{name}:{node.lineno}: SQL built from values: {text[:60]!r}")
    return found


def test_the_scan_sees_the_whole_package_and_catches_what_it_claims() -> None:
    assert len(SOURCES) > 40
    assert any(p.name == "payload.py" for p in SOURCES)
    planted = ast.parse(
        "import pickle as p\n"
        "from marshal import loads\n"
        "importlib.import_module('dill')\n"
        "eval(text)\n"
        "exec(code)\n"
        "yaml.load(stream)\n"
        "subprocess.run(cmd, shell=True)\n"
        "conn.execute(f'SELECT * FROM jobs WHERE queue = {queue}')\n"
        "cur.execute('SELECT ' + column)\n"
        "cur.execute('DELETE FROM %s' % table)\n"
        "cur.execute('SELECT {}'.format(x))\n"
        "conn.execute('SELECT 1 WHERE queue = :queue', {'queue': queue})\n"
        "Q['job_get']; re.compile(x); conn.execute(Q['job_get'], params)\n"
    )
    assert len(banned_imports("x.py", planted)) == 3
    assert len(code_or_shell_calls("x.py", planted)) == 4
    assert len(formatted_sql("x.py", planted, set())) == 4


def test_nothing_imports_pickle_marshal_or_another_code_deserialiser() -> None:
    assert [f for name, tree in _trees() for f in banned_imports(name, tree)] == []


def test_nothing_evaluates_strings_as_code_or_runs_a_shell() -> None:
    assert [f for name, tree in _trees() for f in code_or_shell_calls(name, tree)] == []


def test_sql_is_only_ever_formatted_from_allow_listed_safe_values() -> None:
    """Every execute() runs a named query, a constant, or psycopg's sql.SQL with
    Identifiers; an f-string or concatenation must be in the allow-list with its reason."""
    used: set[tuple[str, str]] = set()
    assert [f for name, tree in _trees() for f in formatted_sql(name, tree, used)] == []
    assert used == set(SQL_FORMATTING_ALLOWED), "an allow-list entry no longer matches code"


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_every_named_query_takes_its_values_as_bound_parameters(backend: str) -> None:
    """SQLite queries use :name placeholders and nothing else; PostgreSQL's use %(name)s and
    only the markers the loader fills from constants ({schema}, {job_columns}; {fair_fold},
    {fair_due}, {notify_ended} and {dead_locked}: the fair_fold_cte, fair_due,
    notify_ended_cte and dead_locked_cte blocks of the same file; {done_channel}: the
    results channel's name, a literal built from the validated schema name)."""
    folder = SRC / "backends" / backend
    texts = [(folder / "queries.sql").read_text()]
    texts += [p.read_text() for p in sorted((folder / "migrations").glob("*.sql"))]
    for text in texts:
        code = "\n".join(line.split("--", 1)[0] for line in text.splitlines())
        code = re.sub(r"'(?:[^']|'')*'", "''", code)  # string literals ('{}' defaults) aside
        if backend == "sqlite":
            assert "{" not in code and "%(" not in code and "%s" not in code
            assert re.findall(r"\?\d*", code) == [], "positional ? placeholders"
        else:
            markers = set(re.findall(r"(?<!\{)\{(\w*)\}(?!\})", code))
            allowed = {"schema", "job_columns", "fair_fold", "fair_due", "notify_ended"}
            allowed |= {"dead_locked"}
            assert markers <= allowed | {"done_channel"}, markers
            assert re.findall(r"%[^(%]", code) == [], "a bare % (positional or stray) in SQL"
