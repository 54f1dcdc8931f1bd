"""Creates errands' tables by running errands' own migrations (the same SQL as
``errands migrate``) on each database an ``ErrandsBackend`` stores jobs in.

errands records what it applied in its own ``errands_migrations`` table and applying is
idempotent and safe to run concurrently. A later errands release that changes its schema
needs no new Django migration: after every ``manage.py migrate`` this app applies errands'
newer migrations (a ``post_migrate`` receiver, see apps.py).
"""

from __future__ import annotations

from typing import Any

from django.db import migrations


def apply_errands_schema(apps: Any, schema_editor: Any) -> None:
    from errands.contrib.django.migrate import migrate_database

    migrate_database(schema_editor.connection.alias)


class Migration(migrations.Migration):
    # errands' migrations run on errands' own connection, in their own transactions
    # (SQLite: BEGIN IMMEDIATE; PostgreSQL: under an advisory lock), so not in Django's.
    atomic = False
    initial = True
    dependencies: list[tuple[str, str]] = []
    operations = [
        migrations.RunPython(apply_errands_schema, migrations.RunPython.noop, elidable=False),
    ]
