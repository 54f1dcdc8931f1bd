"""Find the user's App from ``module:attribute`` (argument, -A/--app or ERRANDS_APP)."""

from __future__ import annotations

import getpass
import importlib
import os
import socket
import sys

import click

from ..app import App


def load_app(path: str | None, url: str | None = None) -> App:
    """Import ``module:attr`` and return the App; with only ``url``, a bare App on it."""
    if not path:
        if url:
            return App(url)
        if os.environ.get("ERRANDS_URL"):
            return App()
        raise click.UsageError(
            "no app given: pass module:app (as in `errands worker shop.jobs:app`), "
            "-A/--app module:app, or set ERRANDS_APP"
        )
    module_name, _, attr = path.partition(":")
    attr = attr or "app"
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise click.UsageError(
            f"cannot import module {module_name!r} (from {path!r}): {exc}. "
            "Run from your project's folder, or check the module path"
        ) from None
    try:
        app = getattr(module, attr)
    except AttributeError:
        raise click.UsageError(
            f"module {module_name!r} has no attribute {attr!r}; "
            f"write module:attribute, as in {module_name}:app"
        ) from None
    if not isinstance(app, App):
        raise click.UsageError(f"{path!r} is a {type(app).__name__}, not an errands.App")
    if url:
        app.url = url
    return app


def default_actor() -> str:
    """Who an admin command acts as in the audit log: ``cli:user@host``."""
    try:
        user = getpass.getuser()
    except Exception:
        user = "unknown"
    return f"cli:{user}@{socket.gethostname()}"
