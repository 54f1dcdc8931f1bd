"""PostgreSQL URL options of errands, split from the libpq connection string."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from ...errors import ConfigurationError
from .. import redact_url

SCHEMA_DEFAULT = "public"
POOL_SIZE_DEFAULT = 10
NOTIFY_WINDOW_DEFAULT = 0.005
NOTIFY_WINDOW_MAX = 60.0  # seconds: past a poll interval or two, polling finds the jobs anyway
CONNECT_TIMEOUT_DEFAULT = 10.0
# At most 50 characters: the notification channels are named errands_jobs_<schema> and
# errands_done_<schema>, and PostgreSQL refuses a channel name of 64 bytes or more in
# pg_notify (a finish would fail) while LISTEN silently cuts it (no waiter would hear).
_SCHEMA = re.compile(r"^[a-z_][a-z0-9_]{0,49}$")

# libpq options errands sets unless the URL gives them. A connection dropped without a
# reset (a NAT or firewall idle timeout, a fail-over that moves the server's address) is
# found within about a minute: keepalive probes on an idle connection (the LISTEN one saw
# no error and waiters fell back to a 30 s recheck; libpq's own start after 2 hours),
# and a statement whose data goes unacknowledged for 60 s fails instead of retrying for
# about 15 minutes (stalling the completer or the claims).
LIBPQ_DEFAULTS = {
    "keepalives": "1",
    "keepalives_idle": "30",
    "keepalives_interval": "10",
    "keepalives_count": "3",
    "tcp_user_timeout": "60000",
}

# Options errands reads from the URL; everything else goes to libpq untouched.
OPTIONS = {
    "schema": "the schema holding errands' tables (default public)",
    "pool_size": "connections per process for errands' own statements (default 10)",
    "tx_pool_size": "connections per process for handlers' ctx.transaction() (default: -c)",
    "auto_migrate": "apply migrations when the app first connects (default false)",
    "prepare": "server-side prepared statements: true (default), or false behind a pooler in "
    "transaction mode that keeps none (PgBouncer before 1.21, or max_prepared_statements = 0)",
    "notify_window": "seconds within which one process sends at most one NOTIFY per queue",
    "listen": "workers LISTEN for new jobs: true (default), or false to rely on polling alone",
}


@dataclass(frozen=True)
class PostgresConfig:
    conninfo: str
    schema: str
    pool_size: int
    auto_migrate: bool
    prepare: bool
    notify_window: float
    listen: bool
    display: str  # the URL without a password, for messages
    # Connections for handlers' ctx.transaction(), a pool of their own; None: as many as
    # the worker runs handlers at once (Backend.configure_worker), else POOL_SIZE_DEFAULT.
    tx_pool_size: int | None = None


def _flag(name: str, value: str) -> bool:
    lowered = value.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigurationError(f"PostgreSQL URL option {name}={value!r}: write true or false")


def parse_postgres_url(url: str) -> PostgresConfig:
    parts = urlsplit(url)
    if parts.scheme not in ("postgres", "postgresql"):
        raise ConfigurationError(f"not a PostgreSQL URL: {redact_url(url)!r}")
    ours: dict[str, str] = {}
    theirs: list[tuple[str, str]] = []
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        (ours.__setitem__(key, value) if key in OPTIONS else theirs.append((key, value)))
    schema = ours.get("schema", SCHEMA_DEFAULT)
    if not _SCHEMA.match(schema):
        raise ConfigurationError(
            f"PostgreSQL URL option schema={schema!r}: use lowercase letters, digits and '_', "
            "starting with a letter or '_', at most 50 characters (errands names its "
            "notification channels after the schema, and PostgreSQL caps those names)"
        )
    try:
        pool_size = int(ours.get("pool_size", POOL_SIZE_DEFAULT))
        tx_pool_size = int(ours["tx_pool_size"]) if "tx_pool_size" in ours else None
        notify_window = float(ours.get("notify_window", NOTIFY_WINDOW_DEFAULT))
    except ValueError as exc:
        raise ConfigurationError(f"PostgreSQL URL {redact_url(url)!r}: {exc}") from None
    if pool_size < 2:
        raise ConfigurationError("PostgreSQL URL option pool_size must be at least 2")
    if tx_pool_size is not None and tx_pool_size < 1:
        raise ConfigurationError("PostgreSQL URL option tx_pool_size must be at least 1")
    if not 0 <= notify_window <= NOTIFY_WINDOW_MAX:  # NaN fails both: refused too
        raise ConfigurationError(
            f"PostgreSQL URL option notify_window={ours.get('notify_window')!r}: give seconds "
            f"from 0 (a NOTIFY at every enqueue) to {NOTIFY_WINDOW_MAX:g}; nan, inf or a "
            "negative value turned every NOTIFY off"
        )
    netloc = parts.netloc
    if "@" in netloc and ":" in netloc.rsplit("@", 1)[0]:  # the last '@' ends a password
        user = netloc.rsplit("@", 1)[0].split(":", 1)[0]
        netloc_display = f"{user}:***@{netloc.rsplit('@', 1)[1]}"
    else:
        netloc_display = netloc
    given = {key for key, _ in theirs}
    theirs += [(key, value) for key, value in LIBPQ_DEFAULTS.items() if key not in given]
    # Spaces as %20, not '+': libpq reads a URI's '+' as itself (options=-c a=b reached
    # the server as "-c+a=b", refused, and a value with a space could not be given).
    query = urlencode(theirs, quote_via=quote)
    conninfo = urlunsplit(("postgresql", parts.netloc, parts.path, query, parts.fragment))
    return PostgresConfig(
        conninfo=conninfo,
        schema=schema,
        pool_size=pool_size,
        auto_migrate=_flag("auto_migrate", ours.get("auto_migrate", "false")),
        prepare=_flag("prepare", ours.get("prepare", "true")),
        notify_window=notify_window,
        listen=_flag("listen", ours.get("listen", "true")),
        tx_pool_size=tx_pool_size,
        display=urlunsplit(
            ("postgresql", netloc_display, parts.path, urlencode(sorted(ours.items())), "")
        ),
    )
