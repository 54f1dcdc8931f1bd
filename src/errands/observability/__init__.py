"""Logs, metrics and traces of errands."""
