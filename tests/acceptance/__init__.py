"""Acceptance tests: real ``errands`` worker and CLI processes, real signals, real SQLite files.

Run them alone with ``pytest tests/acceptance`` (or ``-m acceptance``); skip them with
``-m "not acceptance"``. The apps the workers run live in ``apps/``.
"""
