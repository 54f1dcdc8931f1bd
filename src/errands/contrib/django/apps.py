from __future__ import annotations

import sys
from typing import Any

from django.apps import AppConfig
from django.db.models.signals import post_migrate


class ErrandsConfig(AppConfig):
    """``errands.contrib.django`` in INSTALLED_APPS: its migration creates errands' tables
    in Django's database, and ``manage.py errands_worker`` runs the jobs."""

    name = "errands.contrib.django"
    label = "errands"
    verbose_name = "errands background jobs"

    def ready(self) -> None:
        from ._compat import register_checks

        register_checks()
        post_migrate.connect(apply_newer_schema, sender=self, dispatch_uid="errands.schema")


def apply_newer_schema(
    sender: Any, using: str, verbosity: int = 1, plan: Any = None, **kwargs: Any
) -> None:
    """After ``manage.py migrate`` (not after ``flush``, which sends no plan): apply the
    errands migrations newer than those the Django migration applied, so a database
    created by an older errands is upgraded by the usual command."""
    if plan is None:
        return
    from .migrate import migrate_database

    stdout = kwargs.get("stdout") or sys.stdout
    for name in migrate_database(using):
        if verbosity >= 1:
            stdout.write(f"  errands: applied {name}\n")
