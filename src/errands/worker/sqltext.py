"""The statements of an SQL text, as far as ``ctx.transaction()`` needs to know them: which
of them would end the transaction errands commits with the job (COMMIT, END, ROLLBACK
without TO, ...), told from their first words.

A text is cut into tokens the way the database's own lexer cuts it, so that a ``;`` or a
COMMIT inside a string literal, a quoted identifier, a comment or a PostgreSQL
dollar-quoted body is not taken for a statement of its own (``DO $$ BEGIN PERFORM 1;
END $$`` was refused as END: the text was split on every ``;``):

- both: ``'...'`` strings (``''`` for a quote), ``"..."`` identifiers (``""``), ``--``
  line comments and ``/* */`` block comments;
- PostgreSQL: ``E'...'`` strings (backslash escapes; plain strings too when the
  connection has ``standard_conforming_strings`` off), ``$$...$$`` and ``$tag$...$tag$``
  bodies, nested block comments, ``;`` inside parentheses (``CREATE RULE ... DO
  (...; ...)``) and inside a ``CREATE FUNCTION|PROCEDURE ... BEGIN ATOMIC ... END`` body
  (as psql tells them);
- SQLite: ``[...]`` and ```...``` identifiers, and a ``CREATE TRIGGER ... BEGIN ...;
  END`` body, whose statements end only at ``; END ;`` (as ``sqlite3_complete`` tells
  them: its ``END`` is not a statement).

Text the database could not parse may be cut otherwise; it fails there before anything
of it runs (PostgreSQL parses a whole multi-statement text first, and sqlite3 runs one
statement a call), so erring either way costs nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Dialect = Literal["sqlite", "postgres"]

WORD, QUOTED, STRING, SEMI, OPEN, CLOSE, OTHER = "word", "quoted", "string", ";", "(", ")", "?"
_SPACE = " \t\n\v\f\r"
# PostgreSQL's dollar-quote delimiter: $$ or $tag$ (a tag as an identifier, without "$");
# every character past ASCII counts as a letter, as both lexers count its bytes
_DOLLAR = re.compile(r"\$(?:[A-Za-z_\u0080-\U0010ffff][A-Za-z0-9_\u0080-\U0010ffff]*)?\$")


@dataclass(frozen=True, slots=True)
class Token:
    kind: str  # WORD, QUOTED (identifier), STRING, SEMI, OPEN, CLOSE or OTHER
    text: str  # a word as written; a quoted identifier's or a string's value


@dataclass(frozen=True, slots=True)
class Statement:
    tokens: tuple[Token, ...]
    ended: bool  # ended by its ";" (else by the end of the text)

    def word(self, i: int) -> str | None:
        """Its ``i``-th token upper-cased when it is a word, else None."""
        if i < len(self.tokens) and self.tokens[i].kind == WORD:
            return self.tokens[i].text.upper()
        return None


def _ident_char(c: str) -> bool:
    return (c.isascii() and (c.isalnum() or c in "_$")) or not c.isascii()


def _ident_start(c: str) -> bool:
    return (c.isascii() and (c.isalpha() or c == "_")) or not c.isascii()


def tokens(text: str, dialect: Dialect, *, standard_strings: bool = True) -> list[Token]:
    """The tokens of ``text`` (whitespace and comments left out). Whatever is not
    closed (a string, an identifier, a comment, a dollar-quoted body) runs to the end."""
    return _scan(text, dialect, standard_strings)[0]


def _scan(text: str, dialect: Dialect, standard_strings: bool) -> tuple[list[Token], bool]:
    """:func:`tokens`, and whether a block comment was left open at the end."""
    pg = dialect == "postgres"
    out: list[Token] = []
    open_comment = False
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in _SPACE:
            i += 1
        elif text.startswith("--", i):
            end = text.find("\n", i)
            i = n if end < 0 else end + 1
        elif text.startswith("/*", i):
            i = _block_comment_end(text, i, nested=pg)
            open_comment = i < 0
            i = n if i < 0 else i
        elif c == "'":
            i, value = _quoted_end(text, i, "'", backslashes=pg and not standard_strings)
            out.append(Token(STRING, value))
        elif c == '"':
            i, value = _quoted_end(text, i, '"', backslashes=False)
            out.append(Token(QUOTED, value))
        elif not pg and c == "`":
            i, value = _quoted_end(text, i, "`", backslashes=False)
            out.append(Token(QUOTED, value))
        elif not pg and c == "[":
            end = text.find("]", i + 1)
            end = n if end < 0 else end
            out.append(Token(QUOTED, text[i + 1 : end]))
            i = end + 1
        elif pg and c == "$" and (found := _DOLLAR.match(text, i)) is not None:
            tag = found.group()
            end = text.find(tag, found.end())
            value = text[found.end() : n if end < 0 else end]
            out.append(Token(STRING, value))
            i = n if end < 0 else end + len(tag)
        elif _ident_start(c):
            j = i + 1
            while j < n and _ident_char(text[j]):
                j += 1
            word = text[i:j]
            if pg and word in ("E", "e") and j < n and text[j] == "'":  # E'...': escapes
                i, value = _quoted_end(text, j, "'", backslashes=True)
                out.append(Token(STRING, value))
            else:
                out.append(Token(WORD, word))
                i = j
        elif c.isdigit():
            j = i + 1
            while j < n and (_ident_char(text[j]) or text[j] == "."):
                j += 1
            out.append(Token(OTHER, text[i:j]))
            i = j
        else:
            out.append(Token({";": SEMI, "(": OPEN, ")": CLOSE}.get(c, OTHER), c))
            i += 1
    return out, open_comment


def _block_comment_end(text: str, i: int, *, nested: bool) -> int:
    """Where the block comment opened at ``i`` ends (PostgreSQL's nest); -1: it does not."""
    depth, j, n = 1, i + 2, len(text)
    while j < n:
        if text.startswith("*/", j):
            depth -= 1
            j += 2
            if depth == 0:
                return j
        elif nested and text.startswith("/*", j):
            depth += 1
            j += 2
        else:
            j += 1
    return -1


def _quoted_end(text: str, i: int, quote: str, *, backslashes: bool) -> tuple[int, str]:
    """Where the quoted text opened at ``i`` ends, and its value (a doubled quote is one;
    ``backslashes``: a backslash escapes the character after it)."""
    parts: list[str] = []
    j, n = i + 1, len(text)
    while j < n:
        c = text[j]
        if backslashes and c == "\\":
            parts.append(text[j : j + 2])
            j += 2
        elif c == quote:
            if text.startswith(quote, j + 1):
                parts.append(quote)
                j += 2
            else:
                return j + 1, "".join(parts)
        else:
            parts.append(c)
            j += 1
    return n, "".join(parts)


def statements(text: str, dialect: Dialect, *, standard_strings: bool = True) -> list[Statement]:
    """The statements of ``text`` (empty ones left out), each with its tokens."""
    return _split(tokens(text, dialect, standard_strings=standard_strings), dialect)[0]


def _split(found: list[Token], dialect: Dialect) -> tuple[list[Statement], bool]:
    """The statements of ``found``, and whether its last token is a ";" that ended one
    (an empty one too)."""
    out: list[Statement] = []
    cut = False
    current: list[Token] = []
    depth = 0  # parentheses (PostgreSQL)
    atomic = 0  # PostgreSQL: BEGIN ATOMIC ... END (and CASE ... END) in a routine's body
    for k, token in enumerate(found):
        if token.kind == SEMI and _ends_here(current, dialect, depth, atomic):
            if current:
                out.append(Statement(tuple(current), True))
            current, depth, atomic, cut = [], 0, 0, True
            continue
        cut = False
        current.append(token)
        if dialect != "postgres":
            continue
        if token.kind == OPEN:
            depth += 1
        elif token.kind == CLOSE:
            depth = max(depth - 1, 0)
        elif token.kind == WORD and depth == 0 and _routine(current):
            word = token.text.upper()
            after = found[k + 1] if k + 1 < len(found) else None
            if word == "BEGIN" and after is not None and after.kind == WORD:
                atomic += after.text.upper() == "ATOMIC"
            elif word == "CASE" and atomic:
                atomic += 1
            elif word == "END" and atomic:
                atomic -= 1
    if current:
        out.append(Statement(tuple(current), False))
    return out, cut


def _routine(current: list[Token]) -> bool:
    """Whether the statement so far is CREATE [OR REPLACE] FUNCTION|PROCEDURE ..."""
    words = [t.text.upper() if t.kind == WORD else "" for t in current[:4]]
    if words[:1] != ["CREATE"]:
        return False
    if words[1:3] == ["OR", "REPLACE"]:
        words = words[2:]
    return len(words) > 1 and words[1] in ("FUNCTION", "PROCEDURE")


def _ends_here(current: list[Token], dialect: Dialect, depth: int, atomic: int) -> bool:
    """Whether a ``;`` after ``current`` ends the statement."""
    if dialect == "postgres":
        return depth == 0 and atomic == 0
    # SQLite (sqlite3_complete): in CREATE [TEMP] TRIGGER, only "; END ;" ends it
    words = [t.text.upper() if t.kind == WORD else "" for t in current]
    if words[:1] == ["EXPLAIN"]:
        words = words[3:] if words[1:3] == ["QUERY", "PLAN"] else words[1:]
    if words[:1] != ["CREATE"]:
        return True
    rest = words[1:]
    while rest[:1] in (["TEMP"], ["TEMPORARY"]):
        rest = rest[1:]
    if rest[:1] != ["TRIGGER"]:
        return True
    return len(current) >= 2 and current[-2].kind == SEMI and words[-1] == "END"


def complete(text: str, dialect: Dialect = "sqlite") -> bool:
    """Whether ``text`` ends with a statement its ``;`` ended, nothing after it but
    whitespace and closed comments (``sqlite3.complete_statement`` for SQLite)."""
    found, open_comment = _scan(text, dialect, True)
    return _split(found, dialect)[1] and not open_comment


def ending_statement(
    text: str, dialect: Dialect, savepoint: str, *, standard_strings: bool = True
) -> str | None:
    """The first statement of ``text`` that would end (or replace) the open transaction,
    named by its first word(s), or None: COMMIT, END, ABORT, BEGIN, START TRANSACTION,
    PREPARE TRANSACTION, ROLLBACK (not ROLLBACK [TRANSACTION|WORK] TO [SAVEPOINT] ...)
    and RELEASE [SAVEPOINT] of errands' own ``savepoint``."""
    for statement in statements(text, dialect, standard_strings=standard_strings):
        verb = _ending(statement, savepoint.lower())
        if verb is not None:
            return verb
    return None


def _ending(statement: Statement, savepoint: str) -> str | None:
    first = statement.word(0)
    if first in ("COMMIT", "END", "ABORT", "BEGIN"):
        return first
    if first in ("START", "PREPARE") and statement.word(1) == "TRANSACTION":
        return f"{first} TRANSACTION"
    if first == "ROLLBACK":
        at = 2 if statement.word(1) in ("TRANSACTION", "WORK") else 1
        return None if statement.word(at) == "TO" else first
    if first == "RELEASE":
        at = 2 if statement.word(1) == "SAVEPOINT" and len(statement.tokens) > 2 else 1
        if at < len(statement.tokens):
            name = statement.tokens[at]
            if name.kind in (WORD, QUOTED, STRING) and name.text.lower() == savepoint:
                return first
    return None
