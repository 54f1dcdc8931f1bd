"""Tools for testing code that uses errands (product code, documented in docs/testing.md).

``errands.testing.faults``: fault points that crash a worker process at exact places
(before or after the completion commit, after a step), for proving effects happen once.
"""
