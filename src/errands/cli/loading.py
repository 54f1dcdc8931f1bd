"""Find the user's App from ``module:attribute`` (argument, -A/--app or ERRANDS_APP).

The finding is :func:`errands.loading.load_app`; here its errors become usage errors
(exit code 2, with the command's usage line).
"""

from __future__ import annotations

import getpass
import os
import socket

import click

from .. import loading
from ..app import App
from ..backends import redact_url
from .render import notice

URL_HELP = "database URL, overriding the app's (without an app: ERRANDS_URL)"


def load_app(
    path: str | None, url: str | None = None, *, need_code: bool = False, existing: bool = False
) -> App:
    """:func:`errands.loading.load_app`, its :class:`~errands.loading.AppLoadError` as a
    :class:`click.UsageError` (an error raised by the user's module while importing it
    stays an error of its own: exit 1, no usage line).

    One rule for the URL, the same as ``errands.App``: ``--url`` on the command line wins,
    then the URL written in the app's code, then ``ERRANDS_URL``, then
    ``sqlite:///errands.db``. A SQLite file's path is made absolute, so every message and
    log line says which file it is."""
    try:
        app = loading.load_app(path, url, need_code=need_code, existing=existing)
    except loading.AppImportError:
        raise
    except loading.AppLoadError as exc:
        raise click.UsageError(str(exc)) from None
    from_env = os.environ.get("ERRANDS_URL")
    if path and not url and from_env and from_env != app.url:
        notice(
            f"ERRANDS_URL ({redact_url(from_env)}) is not used: {path} names its "
            f"own database ({redact_url(loading.absolute_url(app.url))}), and a URL in code "
            "wins over ERRANDS_URL; pass --url to choose another"
        )
    app.url = loading.absolute_url(app.url)
    return app


def default_actor() -> str:
    """Who an admin command acts as in the audit log: ``cli:user@host``."""
    try:
        user = getpass.getuser()
    except Exception:
        user = "unknown"
    return f"cli:{user}@{socket.gethostname()}"
