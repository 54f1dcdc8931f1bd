"""SIGTERM and SIGINT, acted on by a thread of their own.

A Python signal handler runs in the main thread, between two of its bytecodes, wherever
that thread is: possibly inside ``threading.Event.wait()`` or ``clear()`` with the
event's lock held (the worker's claim loop waits on an event thousands of times a
second), or inside a logging call. A handler that takes such a lock itself (``Event.set``
to wake the claim loop, a log line) then waits for ever for a lock its own thread holds:
the worker never stops, and a deploy's SIGTERM ends in a SIGKILL (the CI-sized chaos soak
had one worker not exit within 60 s of its SIGTERM).

So the handler installed here does one thing no lock guards: it writes the signal's
number to a pipe. A daemon thread reads the pipe and calls ``on_signal(signum, count)``
(``count``: the signals received so far, this one included), where taking locks, logging
and waking threads is safe.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("errands.worker")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class SignalRelay:
    def __init__(
        self, on_signal: Callable[[int, int], None], signals: Sequence[int] = STOP_SIGNALS
    ) -> None:
        self.on_signal = on_signal
        self.signals = tuple(signals)
        self._previous: dict[int, Any] = {}
        self._write_fd = -1
        self._thread: threading.Thread | None = None

    def install(self) -> None:
        """Install the handlers (from the main thread, as Python requires) and start the
        thread that acts on them."""
        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # a flood of signals never blocks the handler
        self._thread = threading.Thread(
            target=self._relay, args=(read_fd,), name="errands-signals", daemon=True
        )
        self._thread.start()
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handler)

    def uninstall(self) -> None:
        """Put the handlers found at :meth:`install` back and end the thread."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if self._write_fd >= 0:
            os.close(self._write_fd)  # the thread reads the end of the pipe and leaves
            self._write_fd = -1

    def _handler(self, signum: int, frame: Any) -> None:
        # Runs in the main thread between two bytecodes: no lock, no logging, no allocation
        # of threads here (see the module).
        with contextlib.suppress(OSError):  # the pipe is full: the signals in it suffice
            os.write(self._write_fd, bytes([signum]))

    def _relay(self, read_fd: int) -> None:
        count = 0
        try:
            while data := os.read(read_fd, 64):
                for signum in data:
                    count += 1
                    try:
                        self.on_signal(signum, count)
                    except Exception:  # the next signal must still be acted on
                        log.exception("acting on signal %d failed", signum)
        finally:
            os.close(read_fd)
