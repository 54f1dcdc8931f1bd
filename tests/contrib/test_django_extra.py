"""The errands[django] extra declares the django-tasks range the integration supports."""

from __future__ import annotations

import ast
import tomllib
from contextlib import closing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_django_extra_allows_exactly_the_django_tasks_range_the_compat_layer_names() -> None:
    source = (ROOT / "src/errands/contrib/django/_compat.py").read_text()
    [declared] = [
        node.value.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Assign)
        and any(getattr(t, "id", "") == "DJANGO_TASKS_RANGE" for t in node.targets)
        and isinstance(node.value, ast.Constant)
    ]
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["django"]
    assert f"django-tasks{declared}" in extra
    assert any(item.startswith("django>=5.2") for item in extra)
    requirements = (ROOT / "integration/requirements-django52.txt").read_text()
    assert f"django-tasks{declared}" in requirements  # the stack CI runs on Django 5.2


def test_the_django_test_helpers_empty_every_errands_table(tmp_path: Path) -> None:
    """clear_jobs() (and TransactionTestCase) empty the tables TABLES names: it left out
    the workflows, signals, fair usage and weights and dead-hook records, which then
    carried over into the next test. It names every table a migrated store has."""
    import sqlite3

    import errands

    source = (ROOT / "src/errands/contrib/django/test.py").read_text()
    [tables] = [
        ast.literal_eval(node.value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Assign)
        and any(getattr(t, "id", "") == "TABLES" for t in node.targets)
    ]
    store = tmp_path / "e.db"
    errands.App(f"sqlite:///{store}").migrate()
    with closing(sqlite3.connect(store)) as conn:
        present = {
            name
            for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            if name.startswith("errands_") and name != "errands_migrations"
        }
    assert set(tables) == present
