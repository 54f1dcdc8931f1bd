"""Find the user's App from a ``module:attribute`` path.

Below both the CLI (``errands worker shop.jobs:app``, -A/--app, ERRANDS_APP) and the
worker (a process-pool child imports the app again in its own process), so neither has to
import the other. The CLI turns :class:`AppLoadError` into a usage error.
"""

from __future__ import annotations

import importlib
import os
import sys

from .app import App
from .errors import ConfigurationError


class AppLoadError(ConfigurationError):
    """No App at the path given (or no path and no URL); the message says what to pass."""


def load_app(
    path: str | None, url: str | None = None, *, need_code: bool = False, existing: bool = False
) -> App:
    """Import ``module:attr`` and return the App; with only ``url``, a bare App on it.

    ``need_code``: the caller runs jobs, so the module defining them is required.
    ``existing``: the caller only reads or administers, so a SQLite file that does not
    exist is a typo, not a new database to create.
    """
    if not path:
        if need_code:
            raise AppLoadError(
                "no app given: a worker needs the module that defines your jobs; pass "
                "module:app (as in `errands worker shop.jobs:app`), -A/--app module:app, "
                "or set ERRANDS_APP"
            )
        if not (url or os.environ.get("ERRANDS_URL")):
            raise AppLoadError(
                "no database given: pass --url (e.g. --url sqlite:///errands.db), "
                "-A/--app module:app, or set ERRANDS_URL or ERRANDS_APP"
            )
        app = App(url) if url else App()
        if existing:
            _check_exists(app.url)
        return app
    module_name, _, attr = path.partition(":")
    attr = attr or "app"
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise AppLoadError(
            f"cannot import module {module_name!r} (from {path!r}): {exc}. "
            "Run from your project's folder, or check the module path"
        ) from None
    try:
        app = getattr(module, attr)
    except AttributeError:
        raise AppLoadError(
            f"module {module_name!r} has no attribute {attr!r}; "
            f"write module:attribute, as in {module_name}:app"
        ) from None
    if not isinstance(app, App):
        raise AppLoadError(f"{path!r} is a {type(app).__name__}, not an errands.App")
    if url:
        app.url = url
    if existing:
        _check_exists(app.url)
    return app


def _check_exists(url: str) -> None:
    if not url.startswith("sqlite:"):
        return
    from .backends.sqlite.backend import parse_sqlite_url

    path, _ = parse_sqlite_url(url)
    if path != ":memory:" and not os.path.exists(path):
        raise AppLoadError(
            f"no errands database at {os.path.abspath(path)!r} (from {url}); check --url, "
            "ERRANDS_URL or the folder you run from"
        )
