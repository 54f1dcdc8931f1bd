"""The errands[django] extra declares the django-tasks range the integration supports."""

from __future__ import annotations

import ast
import tomllib
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
