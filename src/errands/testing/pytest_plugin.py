"""pytest fixtures for apps built on errands, prefixed ``errands_`` (docs/testing.md).

Installed with errands through the ``pytest11`` entry point, so they are available in
every test without imports:

- ``errands_testing``: a factory, ``errands_testing(app, mode="manual", fresh_store=False,
  **options)`` → :class:`errands.testing.Tester`, closed when the test ends.
  ``fresh_store=True`` points the App at a new SQLite file in the test's temporary folder
  for the test's duration.
- ``errands_app``: *yours to define* (in your conftest.py): the App the fixtures below
  use, pointed at a test database.
- ``errands_manual`` / ``errands_inline``: a Tester on ``errands_app`` in that mode.
- ``errands_worker``: a real in-process worker on ``errands_app`` for the test's duration.

Nothing here runs unless a test asks for one of these fixtures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from errands import App
    from errands.testing import Tester


@pytest.fixture
def errands_testing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Tester]]:
    """A factory of :class:`errands.testing.Tester`, each closed when the test ends."""
    from errands.testing import Tester

    made: list[Tester] = []

    def make(
        app: App, mode: str = "manual", *, fresh_store: bool = False, **options: Any
    ) -> Tester:
        if fresh_store and "url" not in options:
            folder: Path = tmp_path_factory.mktemp("errands")
            options["url"] = f"sqlite:///{folder / 'errands.db'}"
        tester = Tester(app, mode, **options)  # type: ignore[arg-type]
        made.append(tester)
        return tester

    yield make
    for tester in reversed(made):
        tester.close()


@pytest.fixture
def errands_app() -> App:
    """Define this fixture in your conftest.py: the App your tests use."""
    pytest.fail(
        "the errands_ fixtures need an `errands_app` fixture: define one in your conftest.py "
        "that returns your errands.App pointed at a test database, e.g.\n\n"
        "    @pytest.fixture\n"
        "    def errands_app(tmp_path):\n"
        "        app = myproject.jobs.app\n"
        "        app.url = f'sqlite:///{tmp_path}/errands.db'\n"
        "        yield app\n"
        "        app.close()\n",
        pytrace=False,
    )


@pytest.fixture
def errands_manual(errands_testing: Callable[..., Tester], errands_app: App) -> Tester:
    """A manual-mode Tester on ``errands_app``: jobs wait for ``drain()``."""
    return errands_testing(errands_app, "manual")


@pytest.fixture
def errands_inline(errands_testing: Callable[..., Tester], errands_app: App) -> Tester:
    """An inline-mode Tester on ``errands_app``: jobs run at enqueue."""
    return errands_testing(errands_app, "inline")


@pytest.fixture
def errands_worker(errands_manual: Tester) -> Iterator[Any]:
    """A real worker running ``errands_app``'s jobs in a thread for the whole test."""
    with errands_manual.worker() as worker:
        yield worker
