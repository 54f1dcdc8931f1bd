"""errands keeps its own tables (created by its own migrations, not by Django models).

This module exists so that Django sends ``post_migrate`` for this app: after every
``manage.py migrate``, errands applies the schema migrations of the installed errands
release (see apps.py), so upgrading errands needs no new Django migration.
"""
