"""Claims whose reply was lost, given back at once (PostgreSQL).

A worker's claim is one statement (``job_claim``, in autocommit) or one transaction
(``job_claim_limited``). When its connection breaks once the statement or its COMMIT was
sent (a network blip, a session ended by ``pg_terminate_backend``, a server restart),
the server may have committed it, and the worker never learns which jobs it took: they
stayed ``running`` under its lease, unknown to it, until the lease ran out (30 s by
default, longer per job), and the leader then rescued them, charging each an attempt as
a lost worker's (counted towards poison). A transient network error delayed them by a
whole lease and recorded a crash that never happened.

Each claim has a lease token of its own, and every row it takes (and every start it logs
against a rate) carries it. So :class:`LostClaims` keeps the token of each claim whose
outcome is unknown and undoes that claim by its token (``job_claim_undo``: the jobs due
again, the attempt not charged, nothing recorded on them, the rate starts taken back; a
concurrency key's or a queue's running count is read from the running rows, and a fair
key's usage is folded only when an attempt ends, so nothing else is left behind):

- at once, on a fresh connection, waiting at most :data:`GIVE_BACK_WAIT` for one;
- else (the server is still away) before the next claim, on that claim's connection, at
  each claim until it gets through: a claim's round trip more, no wait of its own.

A claim refused by the server (a statement error, a serialization failure, a timeout:
the connection is still up) rolled back, and is not kept. A claim lost before anything
committed is undone too, finding nothing: cheaper than telling the cases apart.

What this cannot settle, the lease still does: a worker that stops (or a process that
dies) before the store comes back leaves the rows to their lease and the leader's rescue,
as before; so does a claim whose COMMIT the server carries out only after the give-back
looked (the client gave up on a connection the server was still serving).

SQLite needs none of this: its claim runs in this process, and its COMMIT either returns
or raises with the transaction rolled back (errands then rolls it back); a process that
dies after the COMMIT takes its claim loop with it, and the lease covers it.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import psycopg

from ...errors import is_transient
from .connections import lost

log = logging.getLogger("errands.postgres")

T = TypeVar("T")
Connect = Callable[[float | None], AbstractContextManager["psycopg.Connection[Any]"]]
Undo = Callable[["psycopg.Connection[Any]", list[str]], list[int]]

# Seconds the give-back right after a lost reply waits for a pool connection: a claim
# loop stays responsive while the server is away (the next claim gives them back).
GIVE_BACK_WAIT = 1.0


class LostClaims:
    """The tokens of claims whose outcome is unknown, and their give-back (see the
    module). ``connect(timeout)``: a pool connection; ``undo(conn, tokens)``: undo the
    claims of ``tokens`` on ``conn`` (its own transaction), returning the job ids given
    back."""

    def __init__(self, connect: Connect, undo: Undo) -> None:
        self._connect = connect
        self._undo = undo
        self._tokens: list[str] = []
        self._lock = threading.Lock()
        self._failing = False  # a give-back failed: said once, until one gets through

    @property
    def tokens(self) -> list[str]:
        with self._lock:
            return list(self._tokens)

    def run(self, claim: Callable[[psycopg.Connection[Any], str], T]) -> T:
        """``claim(conn, token)`` on a pool connection, with a fresh lease token, after
        giving back the claims lost before it; when it fails with its outcome unknown,
        its token is kept and its claim given back at once (or before the next claim)."""
        token = secrets.token_hex(8)
        try:
            with self._connect(None) as conn:
                self.give_back(conn)
                try:
                    return claim(conn, token)
                except Exception as exc:
                    # A statement the server refused (the connection still up) rolled
                    # the claim back. Anything else may have come after its commit.
                    if not isinstance(exc, psycopg.Error) or lost(conn):
                        with self._lock:
                            self._tokens.append(token)
                    raise
        except Exception as exc:
            if token in self.tokens:
                log.info("the reply to a claim was lost (%s): giving back what it took", exc)
                self._give_back_fresh()
            raise

    def give_back(self, conn: psycopg.Connection[Any]) -> None:
        """Undo the lost claims on ``conn``. Raises only when ``conn`` itself is lost
        (the claim that was to follow on it would fail too); a claim kept for a transient
        refusal is tried again next time, one refused for good is left to its lease."""
        tokens = self.tokens
        if not tokens:
            return
        try:
            ids = self._undo(conn, tokens)
        except Exception as exc:
            if isinstance(exc, psycopg.Error) and lost(conn):
                raise
            if is_transient(exc):
                self._say_failing(exc)
                return
            log.warning(
                "could not give back the jobs of %d claim(s) whose reply was lost (%s): they "
                "are rescued after their lease",
                len(tokens),
                exc,
            )
            ids = []
        with self._lock:
            self._tokens = [t for t in self._tokens if t not in tokens]
        self._failing = False
        if ids:
            shown = ", ".join(map(str, ids[:20])) + (
                f" and {len(ids) - 20} more" if len(ids) > 20 else ""
            )
            log.info(
                "gave back %d job(s) taken by a claim whose reply was lost (attempt not "
                "charged): %s",
                len(ids),
                shown,
            )

    def _give_back_fresh(self) -> None:
        """The give-back right after a lost reply, on a fresh connection (a short wait
        for one: while the server is away, the next claim gives them back)."""
        try:
            with self._connect(GIVE_BACK_WAIT) as conn:
                self.give_back(conn)
        except Exception as exc:
            self._say_failing(exc)

    def _say_failing(self, exc: Exception) -> None:
        level = logging.DEBUG if self._failing else logging.WARNING
        self._failing = True
        log.log(
            level,
            "the jobs of a claim whose reply was lost are not given back yet (%s): trying "
            "again before the next claim (if the worker stops first, they are rescued after "
            "their lease)",
            exc,
        )
