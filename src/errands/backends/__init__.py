"""Storage backends behind one protocol; :func:`open_backend` picks one from a URL."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from ..errors import ConfigurationError
from .base import Backend, Capabilities

SQLITE_URL_DEFAULT = "sqlite:///errands.db"

__all__ = [
    "SQLITE_URL_DEFAULT",
    "Backend",
    "Capabilities",
    "migration_script",
    "open_backend",
    "redact_url",
]

_AUTHORITY = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*:(?://)?)?([^/?#]*)")
_PASSWORD_IN_QUERY = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)
_LOOSE_PASSWORD = re.compile(r":[^:/?#@\s]+@")  # ':secret@' in a mistyped URL


def redact_url(url: str) -> str:
    """``url`` with any password shown as ``***``, for messages and logs."""
    text = str(url)
    found = _AUTHORITY.match(text)
    if found is not None and "@" in found[2]:
        userinfo, host = found[2].rsplit("@", 1)  # a password may hold '@': the last one ends it
        if ":" in userinfo:
            user = userinfo.split(":", 1)[0]
            text = f"{found[1] or ''}{user}:***@{host}{text[found.end() :]}"
    return _PASSWORD_IN_QUERY.sub(r"\1***", _LOOSE_PASSWORD.sub(":***@", text))


def url_scheme(url: str) -> str:
    """The URL's scheme, lowercased; a URL that cannot be parsed is a clear error."""
    try:
        return urlsplit(url).scheme.lower() if "://" in url else ""
    except ValueError:  # an unclosed '[' of an IPv6 host, say (its text may quote a password)
        raise ConfigurationError(
            f"malformed database URL {redact_url(url)!r}: its host part cannot be parsed (an "
            "unclosed '[' or a bad IPv6 address?); write postgresql://user@host:5432/dbname"
        ) from None


def migration_script(url: str, after: int = 0) -> str:
    """The SQL of every migration newer than ``after`` for this URL, without connecting.

    For teams that apply migrations with their own tooling (``errands migrate --sql``).
    It records each version in ``errands_migrations`` as ``errands migrate`` would.
    """
    scheme = url_scheme(url)
    if scheme == "sqlite":
        from .sqlite.backend import MIGRATIONS

        lines = [
            "CREATE TABLE IF NOT EXISTS errands_migrations (version INTEGER PRIMARY KEY, "
            "name TEXT NOT NULL, applied_at REAL NOT NULL);"
        ]
        for version, name, sql in MIGRATIONS:
            if version > after:
                lines += [
                    f"-- migration {version:04d}_{name}",
                    "BEGIN IMMEDIATE;",
                    sql.strip(),
                    "INSERT INTO errands_migrations (version, name, applied_at) VALUES "
                    f"({version}, '{name}', (julianday('now') - 2440587.5) * 86400.0);",
                    "COMMIT;",
                ]
        return "\n".join(lines) + "\n"
    if scheme in ("postgres", "postgresql"):
        from .postgres.backend import MIGRATE_LOCK_TIMEOUT, fill_markers
        from .postgres.backend import MIGRATIONS as PG_MIGRATIONS
        from .postgres.config import parse_postgres_url

        schema = parse_postgres_url(url).schema
        lines = [
            f'CREATE SCHEMA IF NOT EXISTS "{schema}";',
            f'CREATE TABLE IF NOT EXISTS "{schema}".errands_migrations (version integer PRIMARY '
            "KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now());",
        ]
        for version, name, sql in PG_MIGRATIONS:
            if version > after:
                lines += [
                    f"-- migration {version:04d}_{name}",
                    "BEGIN;",
                    # as errands migrate: lock waits end, the migration rolled back
                    f"SET LOCAL lock_timeout = '{MIGRATE_LOCK_TIMEOUT}';",
                    fill_markers(sql, schema).strip(),
                    f'INSERT INTO "{schema}".errands_migrations (version, name) '
                    f"VALUES ({version}, '{name}');",
                    "COMMIT;",
                ]
        return "\n".join(lines) + "\n"
    open_backend(url)  # raises the clear error for an unsupported URL
    return ""


def open_backend(url: str, **options: object) -> Backend:
    scheme = url_scheme(url)
    if scheme == "sqlite":
        from .sqlite import SQLiteBackend

        return SQLiteBackend(url, **options)  # type: ignore[arg-type]
    if scheme in ("postgres", "postgresql"):
        from .postgres import PostgresBackend

        return PostgresBackend(url, **options)  # type: ignore[arg-type]
    raise ConfigurationError(
        f"unsupported database URL {redact_url(url)!r}: use sqlite:///relative/path.db, "
        "sqlite:////absolute/path.db, sqlite:///:memory: or postgresql://user@host/dbname "
        "(set it with errands.App(url) or the ERRANDS_URL environment variable)"
    )
