"""The layering of ``src/errands``: which part may import which.

- The core (the worker, the backends, the job context and everything they build on)
  never imports a front end built on top of it: the CLI, the dashboard, the framework
  integrations, the test toolkit. What both sides need lives in the core (app loading in
  ``errands.loading``, the fault-point hook in ``errands.faults``).
- The framework integrations (``errands.contrib``) reach a store only through the Backend
  protocol: never a backend's SQL, its internals or its private (``_``) names.

Checked on the syntax tree, so every import counts: at module level, inside a function,
under ``TYPE_CHECKING``; relative imports are resolved. A failure names the file, the line
and the import.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

FRONT_ENDS = ("errands.cli", "errands.dashboard", "errands.contrib", "errands.testing")
# Not core either: the demo app (run by the CLI) and ``python -m errands``.
OUTSIDE_THE_CORE = (*FRONT_ENDS, "errands.demo", "errands.__main__")

# What errands.contrib may import from errands.backends, and why.
CONTRIB_MAY_USE = {
    "errands.backends": "open_backend and the Backend protocol",
    "errands.backends.base": "the protocol's parameter and result types",
    "errands.backends.postgres.config": "parse_postgres_url (a URL's schema, for tests)",
}


@dataclass(frozen=True)
class Import:
    where: str  # "src/errands/worker/process_pool.py:185"
    module: str  # the importing module
    target: str  # the module imported (from)
    names: tuple[str, ...]  # the names of ``from target import ...``; () for ``import``

    def modules(self) -> list[str]:
        """The target, and each imported name that is a module of errands itself."""
        return [self.target] + [
            f"{self.target}.{name}" for name in self.names if is_module(f"{self.target}.{name}")
        ]


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def is_module(dotted: str) -> bool:
    path = SRC.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(source: str, module: str, *, package: bool = False) -> list[Import]:
    """Every import of errands in ``source``, the text of ``module``."""
    path = "src/" + module.replace(".", "/") + ("/__init__.py" if package else ".py")
    here = module if package else module.rpartition(".")[0]
    found = []
    nodes = (n for n in ast.walk(ast.parse(source, path)) if isinstance(n, ast.stmt))
    for node in sorted(nodes, key=lambda n: n.lineno):
        pairs: list[tuple[str, tuple[str, ...]]]
        if isinstance(node, ast.Import):
            pairs = [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            pairs = [(target, tuple(alias.name for alias in node.names))]
        else:
            continue
        found += [
            Import(f"{path}:{node.lineno}", module, target, names)
            for target, names in pairs
            if within(target, "errands")
        ]
    return found


def all_imports() -> Iterator[Import]:
    for file in sorted((SRC / "errands").rglob("*.py")):
        parts = file.relative_to(SRC).with_suffix("").parts
        package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if package else parts)
        yield from imports_of(file.read_text(encoding="utf-8"), module, package=package)


def core_importing_front_ends(found: Iterable[Import]) -> list[str]:
    problems = []
    for imp in found:
        if any(within(imp.module, outside) for outside in OUTSIDE_THE_CORE):
            continue
        for target in imp.modules():
            for front_end in FRONT_ENDS:
                if within(target, front_end):
                    problems.append(
                        f"{imp.where}: {imp.module} imports {target}, but the core must not "
                        f"import the front end {front_end}; move what both need into the core"
                    )
    return problems


def contrib_reaching_into_backends(found: Iterable[Import]) -> list[str]:
    problems = []
    for imp in found:
        if not within(imp.module, "errands.contrib"):
            continue
        for target in imp.modules():
            if within(target, "errands.backends") and target not in CONTRIB_MAY_USE:
                problems.append(
                    f"{imp.where}: {imp.module} imports {target}, a backend's internals; "
                    f"contrib may import only from {', '.join(CONTRIB_MAY_USE)} (give the "
                    "Backend protocol a public call for what it needs)"
                )
        if within(imp.target, "errands.backends"):
            private = [name for name in imp.names if name.startswith("_")]
            if private:
                problems.append(
                    f"{imp.where}: {imp.module} imports {', '.join(private)} from "
                    f"{imp.target}: a backend's private names"
                )
    return problems


def test_the_core_does_not_import_the_cli_the_dashboard_contrib_or_the_test_tools() -> None:
    """errands.worker, errands.backends, errands.context and the rest of the core import no
    front end (errands.cli, errands.dashboard, errands.contrib, errands.testing)."""
    assert core_importing_front_ends(all_imports()) == []


def test_contrib_uses_the_backends_only_through_their_public_protocol() -> None:
    """errands.contrib imports from errands.backends only the protocol, open_backend and
    URL parsing: no backend's SQL (Q, fill_markers) or private names (_RAW_QUERIES)."""
    assert contrib_reaching_into_backends(all_imports()) == []


def test_the_checks_find_what_they_guard() -> None:
    """The checks are not vacuous: the imports this layering replaced are each reported,
    with their file and line; the allowed forms are not."""
    worker = imports_of(
        "import os\nfrom ..cli.loading import load_app\nfrom .. import loading, testing\n",
        "errands.worker.process_pool",
    )
    assert core_importing_front_ends(worker) == [
        "src/errands/worker/process_pool.py:2: errands.worker.process_pool imports "
        "errands.cli.loading, but the core must not import the front end errands.cli; move "
        "what both need into the core",
        "src/errands/worker/process_pool.py:3: errands.worker.process_pool imports "
        "errands.testing, but the core must not import the front end errands.testing; move "
        "what both need into the core",
    ]
    backend = imports_of(
        "def f():\n    from errands.testing.faults import fault_point\n",
        "errands.backends.sqlite",
        package=True,
    )
    assert [p.split(": ")[0] for p in core_importing_front_ends(backend)] == [
        "src/errands/backends/sqlite/__init__.py:2"
    ]
    django = imports_of(
        "from ...backends import Backend, open_backend\n"
        "from ...backends.postgres.backend import _RAW_QUERIES, fill_markers\n"
        "from ...backends.postgres.config import parse_postgres_url\n",
        "errands.contrib.django.app",
    )
    problems = contrib_reaching_into_backends(django)
    assert [p.split(": ", 1)[0] for p in problems] == [
        "src/errands/contrib/django/app.py:2",
        "src/errands/contrib/django/app.py:2",
    ]
    assert "imports errands.backends.postgres.backend, a backend's internals" in problems[0]
    assert "imports _RAW_QUERIES from errands.backends.postgres.backend" in problems[1]
