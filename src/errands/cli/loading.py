"""Find the user's App from ``module:attribute`` (argument, -A/--app or ERRANDS_APP).

The finding is :func:`errands.loading.load_app`; here its errors become usage errors
(exit code 2, with the command's usage line).
"""

from __future__ import annotations

import getpass
import socket

import click

from .. import loading
from ..app import App


def load_app(
    path: str | None, url: str | None = None, *, need_code: bool = False, existing: bool = False
) -> App:
    """:func:`errands.loading.load_app`, its :class:`~errands.loading.AppLoadError` as a
    :class:`click.UsageError`."""
    try:
        return loading.load_app(path, url, need_code=need_code, existing=existing)
    except loading.AppLoadError as exc:
        raise click.UsageError(str(exc)) from None


def default_actor() -> str:
    """Who an admin command acts as in the audit log: ``cli:user@host``."""
    try:
        user = getpass.getuser()
    except Exception:
        user = "unknown"
    return f"cli:{user}@{socket.gethostname()}"
