"""Bad input to the real command line (DESIGN §11): unknown options and values, malformed
URLs of every scheme, unreachable databases, outdated schemas and unparseable cron
expressions each give exactly one ``error:`` line naming the problem, a non-zero exit,
no traceback, and never a password from the URL.

Every command is its own ``python -m errands`` process, run all at once (each is mostly
interpreter start-up) by a module fixture; the tests then judge one result each.
"""

from __future__ import annotations

import contextlib
import secrets
import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

import errands
from tests.pg import require_pg

from .support import PASSWORD, CliResult, cli_env, closed_port, run_cli_many

# One xdist process takes the whole module: its fixture starts ~40 interpreters at once,
# and every process that ran a test of it paid that again (10 s each under load).
pytestmark = pytest.mark.xdist_group("bad_cli")

Case = tuple[Sequence[str | bytes], int, str]

PORT = closed_port()
PG_AT_PORT = f"postgresql://bob:{PASSWORD}@127.0.0.1:{PORT}"

BAD_ARGUMENTS: dict[str, Case] = {
    "unknown-option": (["jobs", "list", "--frobnicate"], 2, "No such option '--frobnicate'"),
    "id-not-a-number": (["jobs", "show", "twelve"], 2, "'twelve' is not a valid integer"),
    "worker-queue-name": (
        ["worker", "fuzz_app:app", "-q", "emails,bad queue!"],
        1,
        "queue name 'bad queue!'",
    ),
    "pause-queue-name": (
        ["queues", "pause", "'; DROP TABLE errands_jobs; --"],
        1,
        'queue name "\'; DROP TABLE errands_jobs; --"',
    ),
    "worker-switch-interval-zero": (
        ["worker", "fuzz_app:app", "--switch-interval", "0"],
        2,
        "'--switch-interval': 0.0 is not in the range 0.0005<=x<=1.0",
    ),
    "worker-switch-interval-nan": (
        ["worker", "fuzz_app:app", "--switch-interval", "nan"],
        2,
        "'--switch-interval': 'nan' is not a finite number",
    ),
    # bytes that are not UTF-8 reach Python as lone surrogates, which no database stores
    "undecodable-filter": (["jobs", "list", "--queue", b"emails\xff"], 1, "not valid Unicode"),
}

BAD_URLS: dict[str, Case] = {
    "unknown-scheme-with-password": (
        ["status", "--url", f"mysql://bob:{PASSWORD}@db.internal/shop"],
        1,
        "unsupported database URL 'mysql://bob:***@db.internal/shop'",
    ),
    "unclosed-ipv6-bracket": (
        ["status", "--url", f"postgresql://bob:{PASSWORD}@[::1/shop"],
        1,
        "malformed database URL 'postgresql://bob:***@[::1/shop'",
    ),
    "sqlite-host-part": (
        ["status", "--url", "sqlite://localhost/errands.db"],
        1,
        "has a host part 'localhost'",
    ),
    "sqlite-bad-synchronous": (
        ["worker", "fuzz_app:app", "--url", "sqlite:///{folder}/w.db?synchronous=SOMETIMES"],
        1,
        "synchronous='SOMETIMES': choose one of OFF, NORMAL, FULL, EXTRA",
    ),
    "postgres-bad-schema": (
        ["status", "--url", PG_AT_PORT + "/shop?schema=public;drop"],
        1,
        "option schema='public;drop'",
    ),
    "postgres-pool-size-not-a-number": (
        ["status", "--url", PG_AT_PORT + "/shop?pool_size=lots"],
        1,
        f"PostgreSQL URL 'postgresql://bob:***@127.0.0.1:{PORT}/shop?pool_size=lots'",
    ),
}

REFUSED = f"cannot connect to PostgreSQL at postgresql://bob:***@127.0.0.1:{PORT}/shop"
UNREACHABLE: dict[str, Case] = {
    "status": (["status", "--url", PG_AT_PORT + "/shop"], 1, REFUSED),
    "worker": (["worker", "fuzz_app:app", "--url", PG_AT_PORT + "/shop"], 1, REFUSED),
    "password-in-query": (
        [
            "jobs",
            "list",
            "--url",
            f"postgresql://127.0.0.1:{PORT}/shop?user=bob&password={PASSWORD}",
        ],
        1,
        f"cannot connect to PostgreSQL at postgresql://127.0.0.1:{PORT}/shop",
    ),
}

OUTDATED: dict[str, Case] = {
    "sqlite-migration-record-edited": (
        ["worker", "fuzz_app:app", "--url", "sqlite:///{folder}/edited.db"],
        1,
        "cannot apply errands migration 0003_limits",
    ),
    "postgres-schema-at-version-2": (
        ["worker", "fuzz_app:app", "--url", "{pg_old}"],
        1,
        "has errands schema version 2, this errands needs",
    ),
    "postgres-migration-record-edited": (
        ["migrate", "--url", "{pg_edited}"],
        1,
        "cannot apply errands migration 0003_limits",
    ),
    "postgres-schema-at-version-2-supervisor": (
        ["worker", "fuzz_app:app", "--url", "{pg_old}", "--processes", "2"],
        1,
        "run: errands migrate",
    ),
}

BAD_CRON: dict[str, Case] = {
    "worker": (["worker", "fuzz_bad_cron:app"], 1, "bad cron expression '61 25 * * *'"),
    "unknown-time-zone": (
        ["worker", "fuzz_bad_tz:app"],
        1,
        "unknown time zone 'Mars/Olympus_Mons'",
    ),
}

GROUPS = {
    "arguments": BAD_ARGUMENTS,
    "urls": BAD_URLS,
    "unreachable": UNREACHABLE,
    "outdated": OUTDATED,
    "cron": BAD_CRON,
}


def _edited_sqlite_store(path: Path) -> None:
    """A current schema whose errands_migrations was cut back to version 2 by hand."""
    app = errands.App(f"sqlite:///{path}")
    app.migrate()
    app.close()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("DELETE FROM errands_migrations WHERE version > 2")
        conn.commit()


@contextlib.contextmanager
def _postgres_schema_at(version: int | None, recorded: int) -> Iterator[str | None]:
    """A URL on a schema whose tables are at ``version`` (None: the latest) and whose
    errands_migrations records ``recorded``; None when PostgreSQL is away."""
    from tests.pg import drop_schema, pg_base_url, pg_unavailable_reason, with_params

    if pg_unavailable_reason() is not None:
        yield None
        return
    import psycopg

    from errands.backends.postgres.backend import MIGRATIONS, fill_markers

    schema = f"t_old_{secrets.token_hex(5)}"
    try:
        with psycopg.connect(pg_base_url(), autocommit=True) as conn, conn.transaction():
            conn.execute(f'CREATE SCHEMA "{schema}"')
            conn.execute(
                f'CREATE TABLE "{schema}".errands_migrations (version integer PRIMARY KEY, '
                "name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
            )
            for number, name, sql in MIGRATIONS[:version]:
                conn.execute(fill_markers(sql, schema).encode())
                if number <= recorded:
                    conn.execute(
                        f'INSERT INTO "{schema}".errands_migrations (version, name) '
                        "VALUES (%s, %s)",
                        (number, name),
                    )
        yield with_params(pg_base_url(), schema=schema)
    finally:
        with contextlib.suppress(Exception):  # a server restarting under us leaves it behind
            drop_schema(schema)


def _fill(arg: str | bytes, folder: Path, placeholders: dict[str, str | None]) -> str | bytes:
    if isinstance(arg, bytes):
        return arg
    arg = arg.replace("{folder}", str(folder))
    for marker, url in placeholders.items():
        arg = arg.replace(marker, url or "")
    return arg


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, CliResult | None]]:
    folder = tmp_path_factory.mktemp("cli")
    store = folder / "errands.db"
    app = errands.App(f"sqlite:///{store}")
    app.migrate()
    app.close()
    _edited_sqlite_store(folder / "edited.db")
    with contextlib.ExitStack() as schemas:
        placeholders = {
            "{pg_old}": schemas.enter_context(_postgres_schema_at(2, 2)),
            "{pg_edited}": schemas.enter_context(_postgres_schema_at(None, 2)),
        }
        commands: dict[str, Sequence[str | bytes]] = {}
        for group, cases in GROUPS.items():
            for label, (args, _, _) in cases.items():
                needs = {m for m in placeholders for a in args if isinstance(a, str) and m in a}
                if any(placeholders[m] is None for m in needs):
                    continue
                commands[f"{group}/{label}"] = [_fill(a, folder, placeholders) for a in args]
        ran: dict[str, CliResult | None] = dict(
            run_cli_many(commands, cli_env(f"sqlite:///{store}"), folder)
        )
        yield {key: ran.get(key) for key in (f"{g}/{c}" for g, cs in GROUPS.items() for c in cs)}


def _judge(results: dict[str, CliResult | None], key: str, code: int, message: str) -> None:
    result = results[key]
    if result is None:
        require_pg()  # skips (or, under CI=true, fails) saying how to enable it
    assert "Traceback" not in result.output, result
    assert result.code == code, result
    assert result.stdout == "", result
    assert len(result.error_lines) == 1, result
    assert message in result.error_lines[0], result
    assert PASSWORD not in result.output, result


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_cli_arguments_give_one_clear_error_line_and_a_nonzero_exit(
    results: dict[str, CliResult | None], case: str
) -> None:
    _, code, message = BAD_ARGUMENTS[case]
    _judge(results, f"arguments/{case}", code, message)


@pytest.mark.parametrize("case", list(BAD_URLS))
def test_bad_database_urls_are_refused_clearly_without_printing_the_password(
    results: dict[str, CliResult | None], case: str
) -> None:
    _, code, message = BAD_URLS[case]
    _judge(results, f"urls/{case}", code, message)


@pytest.mark.parametrize("case", list(UNREACHABLE))
def test_an_unreachable_database_is_one_error_line_with_the_password_masked(
    results: dict[str, CliResult | None], case: str
) -> None:
    _, code, message = UNREACHABLE[case]
    _judge(results, f"unreachable/{case}", code, message)


@pytest.mark.parametrize("case", list(OUTDATED))
def test_a_worker_refuses_an_outdated_or_inconsistent_schema_saying_what_to_do(
    results: dict[str, CliResult | None], case: str
) -> None:
    _, code, message = OUTDATED[case]
    _judge(results, f"outdated/{case}", code, message)
    result = results[f"outdated/{case}"]
    assert result is not None
    if "version-2" in case:  # outdated: the fix is to migrate (an edited record is not)
        assert "run: errands migrate" in result.error_lines[0]


@pytest.mark.parametrize("case", list(BAD_CRON))
def test_an_unparseable_cron_expression_or_time_zone_stops_the_cli_at_import(
    results: dict[str, CliResult | None], case: str
) -> None:
    _, code, message = BAD_CRON[case]
    _judge(results, f"cron/{case}", code, message)
