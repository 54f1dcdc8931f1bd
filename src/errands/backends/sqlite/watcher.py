"""Wake-ups for SQLite: notice other connections' commits through ``PRAGMA data_version``.

SQLite has no LISTEN/NOTIFY, but ``PRAGMA data_version`` changes on a connection whenever
another connection commits to the file. Reading it is a cheap, lock-free read, so one
thread checks it every few milliseconds and wakes the producer: an idle worker on the
same host starts a new job within milliseconds instead of one poll interval. Commits of
any kind wake it (a wasted claim at worst); polling stays as the fallback.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
from collections.abc import Callable

log = logging.getLogger("errands.sqlite")

CHECK_INTERVAL = 0.005


class DataVersionWatcher:
    def __init__(
        self,
        path: str,
        on_queue: Callable[[str | None], None],
        on_listen: Callable[[], None] | None = None,
    ) -> None:
        self.path = path
        self.on_queue = on_queue
        self.on_listen = on_listen  # called once the first version is read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="errands-watch", daemon=True)
        self.self_test_passed: bool | None = True
        self.listening = threading.Event()  # set once the first version is read

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            log.warning("cannot watch %s for commits (%s); polling only", self.path, exc)
            return
        try:
            last = conn.execute("PRAGMA data_version").fetchone()[0]
            self.listening.set()  # any commit from here on is seen
            if self.on_listen is not None:
                self.on_listen()
            while not self._stop.wait(CHECK_INTERVAL):
                try:
                    version = conn.execute("PRAGMA data_version").fetchone()[0]
                except sqlite3.Error:
                    continue
                if version != last:
                    last = version
                    self.on_queue(None)
        finally:
            self.listening.clear()
            with contextlib.suppress(sqlite3.Error):
                conn.close()
