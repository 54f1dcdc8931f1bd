"""The PostgreSQL backend (``errands[postgres]``: psycopg 3 and psycopg_pool)."""

from .backend import PostgresBackend

__all__ = ["PostgresBackend"]
