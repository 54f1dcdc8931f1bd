"""Fixtures for the security tests: ``store_url`` is one store per backend per module,
as in the bad-input tests; the fuzz apps are importable, as they are for the CLI."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("starlette", reason="the dashboard extra is not installed")

from tests.fuzz.conftest import store_url  # noqa: F401
from tests.fuzz.support import APPS_DIR

if str(APPS_DIR) not in sys.path:
    sys.path.insert(0, str(APPS_DIR))
