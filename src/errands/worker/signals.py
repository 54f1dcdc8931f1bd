"""SIGTERM and SIGINT, acted on by a thread of their own.

A Python signal handler runs in the main thread, between two of its bytecodes, wherever
that thread is: possibly inside ``threading.Event.wait()`` or ``clear()`` with the
event's lock held (the worker's claim loop waits on an event thousands of times a
second), or inside a logging call. A handler that takes such a lock itself (``Event.set``
to wake the claim loop, a log line) then waits for ever for a lock its own thread holds:
the worker never stops, and a deploy's SIGTERM ends in a SIGKILL (the CI-sized chaos soak
had one worker not exit within 60 s of its SIGTERM).

So the handler installed here takes no lock: it counts the signal and writes its number
to a pipe, and a daemon thread reading the pipe calls ``on_signal(signum, count)``
(``count``: the signals received so far, this one included), where taking locks, logging
and waking threads is safe. ``on_repeat(signum)``, when given, runs in the handler itself
from the second signal on (it must take no lock and never block either: an exit at once,
which must not wait for a relay thread busy with the first signal, in a log call that
blocks).

A process forked from this one (a handler's ``multiprocessing.Pool`` under the fork start
method) inherits the handler but not the thread: a signal sent to it there is not the
worker's, and is handled as before the install (the default action for SIGTERM).
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
        self,
        on_signal: Callable[[int, int], None],
        *,
        on_repeat: Callable[[int], None] | None = None,
        signals: Sequence[int] = STOP_SIGNALS,
    ) -> None:
        self.on_signal = on_signal
        self.on_repeat = on_repeat
        self.signals = tuple(signals)
        self._previous: dict[int, Any] = {}
        self._write_fd = -1
        self._pid = 0
        self._count = 0

    def install(self) -> None:
        """Install the handlers (from the main thread, as Python requires) and start the
        thread that acts on them."""
        read_fd, self._write_fd = os.pipe()
        if hasattr(os, "set_blocking"):  # POSIX (Windows from 3.12)
            os.set_blocking(self._write_fd, False)  # a flood of signals never blocks
        self._pid = os.getpid()
        threading.Thread(
            target=self._relay, args=(read_fd,), name="errands-signals", daemon=True
        ).start()
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handler)

    def uninstall(self) -> None:
        """Put the handlers found at :meth:`install` back and end the thread."""
        try:
            for sig, previous in self._previous.items():
                # None: the previous handler was not installed from Python (an embedding
                # host's); the default is the closest Python can put back
                signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        finally:
            self._previous.clear()
            fd, self._write_fd = self._write_fd, -1  # a late handler writes nowhere
            if fd >= 0:
                os.close(fd)  # the thread reads the end of the pipe and leaves

    def _handler(self, signum: int, frame: Any) -> None:
        # Runs in the main thread between two bytecodes: no lock, no logging (see module).
        if os.getpid() != self._pid:  # a forked child's signal: not the worker's to act on
            previous = self._previous.get(signum)  # as if this handler were never installed
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
            os.kill(os.getpid(), signum)
            return
        self._count += 1
        if self._count > 1 and self.on_repeat is not None:
            self.on_repeat(signum)
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
