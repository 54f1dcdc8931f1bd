from .backend import SQLiteBackend

__all__ = ["SQLiteBackend"]
