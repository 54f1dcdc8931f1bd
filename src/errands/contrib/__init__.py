"""Integrations with web frameworks: ``errands.contrib.django`` (a ``django.tasks`` backend),
``errands.contrib.fastapi`` (lifespan and dependency) and ``errands.contrib.flask``.

Each imports its framework, so import only the one you use. See docs/integrations.md.
"""
