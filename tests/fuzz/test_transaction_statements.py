"""Which statements ``ctx.transaction()`` refuses as ending its transaction
(:mod:`errands.worker.sqltext`): told by each statement's first words, the text cut into
tokens as the database's lexer cuts it. A ``;`` or a COMMIT inside a string, a quoted
name, a comment or a PostgreSQL dollar-quoted body is not a statement (the text was
split on every ``;``: ``DO $$ BEGIN PERFORM 1; END $$`` was refused as END, the job
dead for good); one at the top level still is.

Properties over generated text, and the databases themselves as the judges: a text the
check lets through never ends the transaction on a real SQLite or PostgreSQL, and the
check cuts SQLite statements where ``sqlite3.complete_statement`` does.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import closing, suppress
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from errands.worker.runtime import SAVEPOINT
from errands.worker.sqltext import Dialect, complete, ending_statement, statements
from tests.pg import pg_base_url, require_pg

RELAXED: dict[str, Any] = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much],
}
DIALECTS: list[Dialect] = ["sqlite", "postgres"]


def ends(text: str, dialect: Dialect, **kwargs: Any) -> str | None:
    return ending_statement(text, dialect, SAVEPOINT, **kwargs)


# -- what is refused, and what is not ------------------------------------------------------
REFUSED = [
    ("COMMIT", "COMMIT"),
    ("commit; select 1", "COMMIT"),
    ("select 1; commit", "COMMIT"),
    ("END", "END"),
    ("end transaction", "END"),
    ("ROLLBACK", "ROLLBACK"),
    ("rollback transaction", "ROLLBACK"),
    ("BEGIN", "BEGIN"),
    ("begin immediate", "BEGIN"),
    ("RELEASE errands_tx", "RELEASE"),
    ('release savepoint "errands_tx"', "RELEASE"),
    ("  /* c */ -- c\n Commit  ", "COMMIT"),
    ("select ';'; commit", "COMMIT"),
    ("select 1 /* ; */ ;\n end", "END"),
]
REFUSED_PG = [
    ("ABORT", "ABORT"),
    ("start transaction", "START TRANSACTION"),
    ("prepare transaction 'x'", "PREPARE TRANSACTION"),
    ("rollback and chain", "ROLLBACK"),
    ("commit and chain", "COMMIT"),
    ("select $$;$$; commit", "COMMIT"),
    ("DO $$ BEGIN PERFORM 1; END $$; COMMIT", "COMMIT"),
    (
        "CREATE FUNCTION f() RETURNS int LANGUAGE sql BEGIN ATOMIC SELECT 1; END; COMMIT",
        "COMMIT",
    ),
    ("CREATE FUNCTION begin() RETURNS int AS 'select 1' LANGUAGE sql; COMMIT", "COMMIT"),
]
ALLOWED = [
    "SELECT '; commit'",
    "SELECT 'it''s; commit'",
    'SELECT 1 AS "a; commit"',
    "SELECT 1 -- ; commit",
    "SELECT 1 /* ; commit */",
    "ROLLBACK TO errands_tx",
    "rollback transaction to savepoint s1",
    "RELEASE s1",
    "release savepoint errands_tx_2",
    "SAVEPOINT s1",
    "SELECT committed, ended FROM t",
    "INSERT INTO t (note) VALUES ('done; END')",
]
ALLOWED_PG = [
    "DO $$ BEGIN PERFORM 1; END $$",
    "DO $body$ BEGIN PERFORM 1; COMMIT; END $body$",
    "CREATE FUNCTION f() RETURNS int AS $$ BEGIN RETURN 1; END; $$ LANGUAGE plpgsql",
    "CREATE OR REPLACE PROCEDURE p() LANGUAGE sql BEGIN ATOMIC SELECT 1; "
    "SELECT CASE WHEN true THEN 1 END; END",
    "CREATE RULE r AS ON INSERT TO t DO ALSO (INSERT INTO a VALUES (1); INSERT INTO b VALUES (2))",
    "SELECT E'\\'; commit'",
    "SELECT 1 /* nested /* */ ; commit */",
    "SELECT $a$ $$; commit $$ $a$",
    "prepare q as select 1",
    "SELECT a$b FROM t",
]
ALLOWED_SQLITE = [
    "CREATE TRIGGER t AFTER INSERT ON x BEGIN UPDATE y SET a = 1; END",
    "CREATE TEMP TRIGGER t AFTER INSERT ON x BEGIN UPDATE y SET a = 1; DELETE FROM y; END;",
    "SELECT [a; commit] FROM t",
    "SELECT `a; commit` FROM t",
]


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize(("text", "verb"), REFUSED)
def test_a_statement_that_ends_the_transaction_is_refused(
    dialect: Dialect, text: str, verb: str
) -> None:
    assert ends(text, dialect) == verb


@pytest.mark.parametrize(("text", "verb"), REFUSED_PG)
def test_a_postgres_statement_that_ends_the_transaction_is_refused(text: str, verb: str) -> None:
    assert ends(text, "postgres") == verb


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("text", ALLOWED)
def test_a_semicolon_or_keyword_inside_a_literal_or_comment_is_not_a_statement(
    dialect: Dialect, text: str
) -> None:
    assert ends(text, dialect) is None


@pytest.mark.parametrize("text", ALLOWED_PG)
def test_a_dollar_quoted_body_or_routine_body_is_not_split_on_postgres(text: str) -> None:
    assert ends(text, "postgres") is None


@pytest.mark.parametrize("text", ALLOWED_SQLITE)
def test_a_trigger_body_or_bracketed_name_is_not_split_on_sqlite(text: str) -> None:
    assert ends(text, "sqlite") is None


def test_backslashes_escape_in_plain_strings_where_postgres_reads_them_so() -> None:
    text = "SELECT 'a\\'; commit; --'"
    assert ends(text, "postgres", standard_strings=False) is None
    assert ends(text, "postgres") == "COMMIT"  # (standard strings: the quote ends it)


# -- properties ----------------------------------------------------------------------------
# Text rich in what the lexers care about
PIECES = [
    ";", "'", "''", '"', "$$", "$a$", "$b", "E'", "\\", "--", "/*", "*/", "\n", " ", "(",
    ")", "[", "]", "`", "commit", "COMMIT", "end", "rollback", "to", "begin", "atomic",
    "release", "errands_tx", "savepoint", "abort", "x", "1", "é", "create", "trigger",
    "function", "case",
]  # fmt: skip
soup = st.lists(st.sampled_from(PIECES), max_size=25).map("".join)
ENDINGS = ["COMMIT", "end", "Rollback", "ABORT", "release errands_tx", "begin"]


def _quoted(body: str, dialect: Dialect, form: str) -> str | None:
    """``body`` inside a literal, name or comment of ``form`` (None: it cannot be)."""
    if form == "string":
        return "'" + body.replace("'", "''") + "'"
    if form == "name":
        return '"' + body.replace('"', '""') + '"'
    if form == "line":
        return None if "\n" in body else "-- " + body + "\n"
    if form == "block":
        nests = dialect == "postgres" and "/*" in body
        return None if "*/" in body or nests else "/*" + body + "*/"
    if form == "estring" and dialect == "postgres":
        return "E'" + body.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if form == "dollar" and dialect == "postgres":
        return None if "$q$" in body or body.endswith("$") else "$q$" + body + "$q$"
    return None


FORMS = ["string", "name", "line", "block", "estring", "dollar"]


@settings(max_examples=300, **RELAXED)
@given(st.sampled_from(DIALECTS), st.sampled_from(FORMS), soup, st.sampled_from(ENDINGS))
@example("postgres", "dollar", " BEGIN PERFORM 1; END ", "COMMIT")
def test_whatever_is_inside_a_literal_or_comment_is_never_a_statement(
    dialect: Dialect, form: str, body: str, ending: str
) -> None:
    """A statement whose literal, name or comment holds anything at all is not refused;
    the same followed by an ending statement at the top level is."""
    quoted = _quoted(body, dialect, form)
    assume(quoted is not None)
    assert quoted is not None
    text = f"SELECT {quoted} AS v"
    assert ends(text, dialect) is None, text
    verb = ends(f"{text};\n{ending}", dialect)
    assert verb is not None and verb.split()[0] == ending.split()[0].upper(), text


@settings(max_examples=300, **RELAXED)
@given(soup)
@example("CREATE TRIGGER t AFTER INSERT ON x BEGIN SELECT 1; END;")
@example("select 1; /* x")
def test_sqlite_statements_are_cut_where_sqlite_cuts_them(text: str) -> None:
    """The check ends an SQLite statement at a ``;`` exactly where SQLite's own
    tokenizer does (``sqlite3_complete``: strings, names, comments, trigger bodies)."""
    assert complete(text, "sqlite") == sqlite3.complete_statement(text), text


# -- the databases as judges ---------------------------------------------------------------
def _sqlite_still_open(conn: sqlite3.Connection) -> bool:
    if not conn.in_transaction:
        return False
    try:
        conn.execute(f"ROLLBACK TO {SAVEPOINT}")  # errands' savepoint still there
    except sqlite3.Error:
        return False
    return True


@settings(max_examples=300, **RELAXED)
@given(soup)
@example("CREATE TRIGGER tr AFTER INSERT ON t BEGIN SELECT 1; END")
@example("release savepoint errands_tx")
def test_a_text_let_through_never_ends_an_sqlite_transaction(text: str) -> None:
    """Whatever the check lets through, run on SQLite inside errands' transaction, leaves
    that transaction open, errands' savepoint with it."""
    assume(ends(text, "sqlite") is None)
    with closing(sqlite3.connect(":memory:", isolation_level=None)) as conn:
        conn.execute("CREATE TABLE t (x)")
        conn.execute("BEGIN")
        conn.execute(f"SAVEPOINT {SAVEPOINT}")
        conn.execute("SAVEPOINT s1")
        # (most of these texts are not SQL at all: refused as a whole)
        with suppress(sqlite3.Error, ValueError):
            conn.execute(text)
        assert _sqlite_still_open(conn), text


@pytest.fixture(scope="module")
def pg_conn() -> Iterator[Any]:
    require_pg()
    import psycopg

    with psycopg.connect(pg_base_url()) as conn:
        yield conn


@settings(max_examples=200, **RELAXED)
@given(soup)
@example("DO $$ BEGIN PERFORM 1; END $$")
@example("CREATE FUNCTION pg_temp.f() RETURNS int LANGUAGE sql BEGIN ATOMIC SELECT 1; END")
def test_a_text_let_through_never_ends_a_postgres_transaction(pg_conn: Any, text: str) -> None:
    """Whatever the check lets through, run on PostgreSQL (several statements in one
    text, as the simple query protocol takes them) inside errands' transaction, leaves
    that transaction open (aborted at worst), errands' savepoint with it."""
    import psycopg
    from psycopg.pq import TransactionStatus

    standard = pg_conn.info.parameter_status("standard_conforming_strings") != "off"
    assume(ends(text, "postgres", standard_strings=standard) is None)
    assume("\x00" not in text)
    pg_conn.rollback()
    pg_conn.execute(f"SAVEPOINT {SAVEPOINT}")
    pg_conn.execute("SAVEPOINT s1")
    with suppress(psycopg.Error):
        pg_conn.execute(text.encode(), prepare=False)
    status = pg_conn.info.transaction_status
    assert status in (TransactionStatus.INTRANS, TransactionStatus.INERROR), (text, status)
    pg_conn.execute(f"ROLLBACK TO SAVEPOINT {SAVEPOINT}")  # still there
    pg_conn.rollback()


def test_statements_are_listed_with_their_tokens() -> None:
    [first, second] = statements("select 'a;b' ; commit", "postgres")
    assert [t.text for t in first.tokens] == ["select", "a;b"] and first.ended
    assert second.word(0) == "COMMIT" and not second.ended
