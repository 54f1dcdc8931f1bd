#!/usr/bin/env python
"""Django's own ``tests/tasks`` against ``ErrandsBackend``: ``python upstream.py --db sqlite``.

The test modules come from the sdist of the Django release pinned here (the sdist on PyPI
ships ``tests/``), fetched once with pip and kept beside the test databases. Every
``override_settings(TASKS=...)`` in them that names Django's ``DummyBackend`` or
``ImmediateBackend`` is rewritten to name ``errands.contrib.django.ErrandsBackend`` (same
aliases and QUEUES), and their ``SimpleTestCase``s may use the database that backend
stores jobs in. Nothing else changes: the tests use Django's public Tasks API, so what
passes is Django's contract as a queued backend meets it.

A queued backend cannot pass the tests that assume the Dummy or Immediate backend's
in-process behaviour (a task that has run by the time ``enqueue`` returns, the Dummy
backend's in-memory ``results``, its class name and OPTIONS). Those are listed in
:data:`EXPECTED_FAILURES`, each with the reason, and run as expected failures: one that
passes fails the run (so the list, and docs/integrations.md which prints it, stays true),
and so does any other test that fails.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
import unittest
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DJANGO_VERSION = "6.1.3"  # integration/requirements-django6.txt pins the same release
# ErrandsBackend with DummyBackend's results and clear() (upstream_backend.py)
ERRANDS_BACKEND = "upstream_backend.ErrandsBackendForDjangoTests"
REWRITTEN = {
    "django.tasks.backends.dummy.DummyBackend",
    "django.tasks.backends.immediate.ImmediateBackend",
}

# Why a queued backend fails these; docs/integrations.md shows the same list.
IMMEDIATE = (
    "expects the task to have run by the time enqueue() returns (ImmediateBackend): a queued "
    "backend returns it READY, and a worker runs it later"
)
IMMEDIATE_LIMITS = (
    "expects ImmediateBackend's limits (no run_after, no get_result/refresh), which "
    "ErrandsBackend does not have"
)
CLASS = "asserts that the backend is Django's DummyBackend or ImmediateBackend class"
SYNC_IN_ASYNC = (
    "calls the synchronous get_result() or results from async code: a database-backed "
    "backend refuses that (SynchronousOnlyOperation), as Django's ORM does"
)
IN_MEMORY = (
    "changes DummyBackend's in-memory result object and expects refresh() to read that change back"
)

EXPECTED_FAILURES: dict[str, str] = {
    "test_dummy_backend.DummyBackendTestCase.test_using_correct_backend": CLASS,
    "test_dummy_backend.DummyBackendTestCase.test_enqueue_task_async": SYNC_IN_ASYNC,
    "test_dummy_backend.DummyBackendTestCase.test_get_missing_result": SYNC_IN_ASYNC,
    "test_dummy_backend.DummyBackendTestCase.test_refresh_result": IN_MEMORY,
    "test_dummy_backend.DummyBackendTestCase.test_refresh_result_async": SYNC_IN_ASYNC,
    "test_immediate_backend.ImmediateBackendTestCase.test_using_correct_backend": CLASS,
    "test_immediate_backend.ImmediateBackendTestCase.test_enqueue_task": IMMEDIATE,
    "test_immediate_backend.ImmediateBackendTestCase.test_enqueue_task_async": IMMEDIATE,
    "test_immediate_backend.ImmediateBackendTestCase.test_catches_exception": IMMEDIATE,
    "test_immediate_backend.ImmediateBackendTestCase.test_throws_keyboard_interrupt": IMMEDIATE,
    "test_immediate_backend.ImmediateBackendTestCase.test_complex_exception": IMMEDIATE,
    "test_immediate_backend.ImmediateBackendTestCase.test_complex_return_value": IMMEDIATE,
    "test_immediate_backend.ImmediateBackendTestCase.test_result": IMMEDIATE,
    "test_immediate_backend.ImmediateBackendTestCase.test_result_async": IMMEDIATE,
    "test_immediate_backend.ImmediateBackendTestCase.test_cannot_get_result": IMMEDIATE_LIMITS,
    "test_immediate_backend.ImmediateBackendTestCase.test_cannot_refresh_result": (
        IMMEDIATE_LIMITS
    ),
    "test_immediate_backend.ImmediateBackendTestCase.test_cannot_pass_run_after": (
        IMMEDIATE_LIMITS
    ),
    "test_immediate_backend.ImmediateBackendTestCase.test_enqueue_logs": IMMEDIATE,
    "test_immediate_backend.ImmediateBackendTestCase.test_failed_logs": IMMEDIATE,
    "test_immediate_backend.ImmediateBackendTestCase.test_successful_task_no_none_in_logs": (
        IMMEDIATE
    ),
    "test_immediate_backend.ImmediateBackendTestCase.test_takes_context": IMMEDIATE,
    "test_immediate_backend.ImmediateBackendTestCase.test_context": IMMEDIATE,
    "test_immediate_backend.ImmediateBackendTransactionTestCase"
    ".test_doesnt_wait_until_transaction_commit_by_default": IMMEDIATE,
    "test_tasks.TaskTestCase.test_using_correct_backend": CLASS,
    "test_tasks.TaskTestCase.test_get_backend": CLASS,
    "test_tasks.TaskTestCase.test_enqueue_task_async": SYNC_IN_ASYNC,
    "test_tasks.TaskTestCase.test_get_missing_result": SYNC_IN_ASYNC,
    "test_tasks.TaskTestCase.test_refresh_result": SYNC_IN_ASYNC,
    "test_tasks.TaskTestCase.test_task_error_invalid_exception": IMMEDIATE,
    "test_tasks.TaskTestCase.test_task_error_unknown_module": IMMEDIATE,
}


def upstream_tests(state: Path) -> Path:
    """The folder holding Django's ``tests/tasks`` package (fetched on first use)."""
    folder = state / f"django-{DJANGO_VERSION}-tests"
    if (folder / "tasks" / "__init__.py").is_file():
        return folder
    with tempfile.TemporaryDirectory() as download:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--no-binary", ":all:", f"django=={DJANGO_VERSION}", "--dest", download],
            check=True,
        )  # fmt: skip
        [sdist] = Path(download).glob("*.tar.gz")
        prefix = f"django-{DJANGO_VERSION}/tests/tasks/"
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
            for member in members:
                member.name = "tasks/" + member.name[len(prefix) :]
            partial = folder.with_suffix(".partial")
            archive.extractall(partial, members=members, filter="data")
    partial.rename(folder)
    return folder


def rewrite_tasks_settings() -> None:
    """Make every ``override_settings(TASKS=...)`` name ErrandsBackend for Django's own
    Dummy and Immediate backends (before the test modules are imported)."""
    from django.test import utils

    original = utils.override_settings.__init__

    def __init__(self: Any, **kwargs: Any) -> None:
        if isinstance(kwargs.get("TASKS"), dict):
            kwargs["TASKS"] = {
                alias: {**conf, "BACKEND": ERRANDS_BACKEND}
                if conf.get("BACKEND") in REWRITTEN
                else conf
                for alias, conf in kwargs["TASKS"].items()
            }
        original(self, **kwargs)

    utils.override_settings.__init__ = __init__  # type: ignore[method-assign]


def prepare(suite: unittest.TestSuite, expected: dict[str, str]) -> list[str]:
    """Let every test use the database (ErrandsBackend stores jobs there) and mark the
    expected failures; returns the ids of the tests found."""
    found = []
    for test in iterate(suite):
        cls = type(test)
        cls.databases = {"default"}
        name = test.id().removeprefix("tasks.")
        found.append(name)
        if name in expected:
            # On the test (one instance per method), as unittest.expectedFailure marks a
            # class: Django wraps async test methods, which would drop a mark on the method.
            setattr(test, "__unittest_expecting_failure__", True)  # noqa: B010
    return found


def iterate(suite: unittest.TestSuite) -> list[unittest.TestCase]:
    tests: list[unittest.TestCase] = []
    for item in suite:
        tests += iterate(item) if isinstance(item, unittest.TestSuite) else [item]
    return tests


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("-v", "--verbosity", type=int, default=1)
    parser.add_argument("--list", action="store_true", help="print the expected failures")
    parser.add_argument(
        "--fetch", action="store_true", help="only fetch Django's tests/tasks (no run)"
    )
    parser.add_argument(
        "--discover",
        action="store_true",
        help="run without the list and print the tests that fail (when moving the pin)",
    )
    options = parser.parse_args()
    if options.list:
        for name, why in EXPECTED_FAILURES.items():
            print(f"{name}: {why}")
        return 0
    sys.path.insert(0, str(HERE))
    os.environ["ERRANDS_DJANGO_DB"] = options.db
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "test_settings")

    import django

    if django.get_version() != DJANGO_VERSION:
        print(f"Django {django.get_version()} is installed; these runs pin {DJANGO_VERSION}")
        return 2
    import test_settings
    from django.conf import settings
    from django.test.utils import get_runner

    tests = upstream_tests(test_settings.STATE.parent)
    if options.fetch:
        return 0
    sys.path.insert(0, str(tests))
    rewrite_tasks_settings()
    django.setup()
    print(f"Django {DJANGO_VERSION}'s tests/tasks on ErrandsBackend ({options.db})", flush=True)
    runner = get_runner(settings)(verbosity=options.verbosity, interactive=False)
    suite = runner.build_suite(["tasks"])
    found = prepare(suite, {} if options.discover else EXPECTED_FAILURES)
    missing = sorted(set(EXPECTED_FAILURES) - set(found))
    if missing and not options.discover:  # a test renamed or removed upstream: the list must follow
        print("expected failures that are not in Django's tests:", *missing, sep="\n  ")
        return 1
    runner.setup_test_environment()
    old_config = runner.setup_databases(aliases=runner.get_databases(suite))
    try:
        result = runner.run_suite(suite)
    finally:
        runner.teardown_databases(old_config)
        runner.teardown_test_environment()
    if options.discover:
        failing = sorted({t.id() for t, _ in result.failures + result.errors})
        print("failing:", *[name.removeprefix("tasks.") for name in failing], sep="\n  ")
    print(
        f"{len(result.expectedFailures)} expected failures (tests that assume the Dummy or "
        "Immediate backend's in-process behaviour: docs/integrations.md)"
    )
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
