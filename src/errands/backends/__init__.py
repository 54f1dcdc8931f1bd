"""Storage backends behind one protocol; :func:`open_backend` picks one from a URL."""

from __future__ import annotations

from urllib.parse import urlsplit

from ..errors import ConfigurationError
from .base import Backend, Capabilities

SQLITE_URL_DEFAULT = "sqlite:///errands.db"

__all__ = ["SQLITE_URL_DEFAULT", "Backend", "Capabilities", "open_backend"]


def open_backend(url: str, **options: object) -> Backend:
    scheme = urlsplit(url).scheme.lower() if "://" in url else ""
    if scheme == "sqlite":
        from .sqlite import SQLiteBackend

        return SQLiteBackend(url, **options)  # type: ignore[arg-type]
    if scheme in ("postgres", "postgresql"):
        raise ConfigurationError(
            f"PostgreSQL URL {url!r}: the PostgreSQL backend is not part of this release yet; "
            "use sqlite:///path/to/errands.db for now"
        )
    raise ConfigurationError(
        f"unsupported database URL {url!r}: use sqlite:///relative/path.db, "
        "sqlite:////absolute/path.db or sqlite:///:memory: "
        "(set it with errands.App(url) or the ERRANDS_URL environment variable)"
    )
