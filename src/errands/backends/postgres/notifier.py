"""LISTEN for new jobs so an idle worker starts them within milliseconds.

One dedicated connection per worker process LISTENs on the schema's channel; each
notification carries a queue name and wakes the producer if it serves that queue.
The connection is re-opened with backoff when it drops; while it is down, polling
carries on (``listening`` is cleared, and ``on_lost`` called, as soon as it drops). A
startup self-test NOTIFYs itself once and warns when nothing arrives (PgBouncer in
transaction mode, for one, passes no notifications): polling then does all the work and
idle pickup waits up to one poll interval.
"""

from __future__ import annotations

import logging
import random
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

log = logging.getLogger("errands.postgres")

SELF_TEST_TIMEOUT = 2.0
# After a loss, the first attempt to LISTEN again comes after RECONNECT_FIRST seconds
# (jittered up to twice that), each failed one doubling the pause up to RECONNECT_MAX.
RECONNECT_FIRST = 0.5
RECONNECT_MAX = 30.0


class Notifier:
    def __init__(
        self,
        conninfo: str,
        channel: str,
        on_queue: Callable[[str], None],
        on_listen: Callable[[], None] | None = None,
        name: str = "errands-listen",
        application_name: str | None = None,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        self.conninfo = conninfo
        self.channel = channel
        self.on_queue = on_queue
        self.on_listen = on_listen  # called after each (re)LISTEN: what came meanwhile is lost
        # called when the connection is lost: nothing is heard until the next on_listen
        self.on_lost = on_lost
        self.listening = threading.Event()  # set while LISTEN is in force
        self._options: dict[str, Any] = {}
        if application_name:
            self._options["application_name"] = application_name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None
        self._probe = f"__errands_selftest_{secrets.token_hex(4)}"
        self.self_test_passed: bool | None = None
        self.received = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        conn = self._conn
        if conn is not None:
            try:
                conn.cancel_safe(timeout=2.0)
            except Exception:  # already gone: nothing to interrupt
                log.debug("cancelling the LISTEN connection failed", exc_info=True)
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        pause = RECONNECT_FIRST
        first = True
        while not self._stop.is_set():
            try:
                with psycopg.connect(self.conninfo, autocommit=True, **self._options) as conn:
                    self._conn = conn
                    conn.execute(f'LISTEN "{self.channel}"')
                    self.listening.set()
                    if self.on_listen is not None:
                        self.on_listen()
                    if first:
                        conn.execute("SELECT pg_notify(%s, %s)", (self.channel, self._probe))
                        self._probe_deadline = time.monotonic() + SELF_TEST_TIMEOUT
                    pause = RECONNECT_FIRST
                    self._listen(conn, first)
                    first = False
            except Exception as exc:
                if self._stop.is_set():
                    break
                self._lost()
                log.warning(
                    "LISTEN connection lost (%s); reconnecting in %.1f s, polling meanwhile",
                    exc,
                    pause,
                )
                self._stop.wait(pause * (1 + random.random()))
                pause = min(pause * 2, RECONNECT_MAX)
            finally:
                self._conn = None
                self.listening.clear()

    def _lost(self) -> None:
        """LISTEN is no longer in force: say so at once, not after the pause before the
        next attempt (``listening`` stayed set through it, so the result hub's waiters
        took the store for pushing and slept on), and call ``on_lost`` once per loss."""
        self._conn = None
        if not self.listening.is_set():
            return  # a failed attempt to reconnect: the loss was told already
        self.listening.clear()
        if self.on_lost is not None:
            try:
                self.on_lost()
            except Exception:  # never the end of this thread
                log.exception("the LISTEN connection's on_lost callback failed")

    def _listen(self, conn: psycopg.Connection[tuple[object, ...]], testing: bool) -> None:
        while not self._stop.is_set():
            for note in conn.notifies(timeout=0.5):
                if note.payload == self._probe:
                    self.self_test_passed = True
                    continue
                self.received += 1
                self.on_queue(note.payload)
            if (
                testing
                and self.self_test_passed is None
                and time.monotonic() > self._probe_deadline
            ):
                self.self_test_passed = False
                log.warning(
                    "LISTEN/NOTIFY self-test failed: no notification arrived within %.0f s "
                    "(PgBouncer in transaction mode?). Workers fall back to polling; idle "
                    "pickup waits up to one poll interval",
                    SELF_TEST_TIMEOUT,
                )
