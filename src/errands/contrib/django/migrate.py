"""``manage.py migrate`` for errands' tables (called by this app's Django migration)."""

from __future__ import annotations

import logging

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS

from ...app import App
from .app import database_url

log = logging.getLogger("errands.django")


def errands_databases() -> dict[str, list[str]]:
    """Django database alias -> the errands URLs stored in it, from the TASKS setting.

    With no ErrandsBackend configured, the default database (the app was installed for a
    reason)."""
    from django.utils.module_loading import import_string

    from .backend import ErrandsBackend

    found: dict[str, list[str]] = {}
    for params in (getattr(settings, "TASKS", None) or {}).values():
        try:
            backend_class = import_string(str(params.get("BACKEND", "")))
        except ImportError:
            continue
        if not (isinstance(backend_class, type) and issubclass(backend_class, ErrandsBackend)):
            continue
        options = params.get("OPTIONS") or {}
        database = str(options.get("DATABASE") or DEFAULT_DB_ALIAS)
        url = options.get("URL") or database_url(database, options.get("URL_PARAMS"))
        found.setdefault(database, [])
        if url not in found[database]:
            found[database].append(url)
    if not found:
        found[DEFAULT_DB_ALIAS] = [database_url(DEFAULT_DB_ALIAS)]
    return found


def migrate_database(alias: str) -> list[str]:
    """Apply errands' migrations wherever errands keeps jobs in Django database ``alias``."""
    applied: list[str] = []
    for url in errands_databases().get(alias, []):
        app = App(url)
        try:
            names = app.migrate()
        finally:
            app.close()
        for name in names:
            log.info("errands: applied %s", name)
        applied += names
    return applied
