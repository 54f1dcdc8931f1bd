#!/usr/bin/env python
"""Run the Django backend test suite: ``python integration/django/runtests.py --db sqlite``.

Uses Django's own test runner (errands' DiscoverRunner), on Django >= 6.0 (``django.tasks``)
or Django 5.2 with the ``django-tasks`` backport, whichever is installed.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("-v", "--verbosity", type=int, default=1)
    parser.add_argument("--failfast", action="store_true")
    parser.add_argument("--durations", type=int, help="show the N slowest tests")
    parser.add_argument("labels", nargs="*", default=["backend_tests"])
    options = parser.parse_args()
    sys.path.insert(0, HERE)
    os.environ["ERRANDS_DJANGO_DB"] = options.db
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "test_settings")

    import django
    from django.conf import settings
    from django.test.utils import get_runner

    django.setup()
    from errands.contrib.django._compat import FRAMEWORK

    print(
        f"Django {django.get_version()} ({FRAMEWORK}) on {options.db}, "
        f"Python {sys.version.split()[0]}",
        flush=True,
    )
    runner = get_runner(settings)(
        verbosity=options.verbosity,
        interactive=False,
        failfast=options.failfast,
        durations=options.durations,
    )
    failures = runner.run_tests(options.labels)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
