"""A worker running in a background thread of the web process (development and tests).

Production runs workers as their own processes (``errands worker`` or
``python manage.py errands_worker``); an embedded worker shares the web process's
lifetime, CPU and crashes, which is what you want on a laptop and in a test.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError

if TYPE_CHECKING:
    from ..app import App
    from ..worker.worker import Worker

START_TIMEOUT_DEFAULT = 30.0
log = logging.getLogger("errands.worker")


class EmbeddedWorker:
    """``app.worker(**options)`` run in a daemon thread; a context manager.

    ``start()`` returns once the worker claims jobs (or raises what stopped it from
    starting, such as an outdated schema); ``stop()`` is a graceful stop: in-flight jobs
    get ``grace`` seconds, then whatever still runs is released back to the queue.
    """

    def __init__(self, app: App, **options: Any) -> None:
        self.app = app
        self.worker: Worker = app.worker(**options)
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.exit_code: int | None = None

    def __enter__(self) -> EmbeddedWorker:
        if self.thread is None:
            self.start()
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        stopped = self.stop()
        if exc_type is not None:
            return
        if not stopped:
            raise ConfigurationError(
                "the embedded errands worker did not stop in time: a handler ignores the "
                "shutdown (its job was released and will be rescued)"
            )
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        """Raise what ended the worker's thread early (an exception, or a non-zero exit
        code): a block run with a worker that died in it must not end as if it had run."""
        if self.error is not None:
            raise ConfigurationError(
                f"the embedded errands worker failed while running: {self.error}"
            ) from self.error
        if self.exit_code not in (None, 0):
            raise ConfigurationError(
                f"the embedded errands worker exited with code {self.exit_code}"
            )

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def _run(self) -> None:
        try:
            self.exit_code = self.worker.run(install_signals=False)
        except BaseException as exc:  # reported by start() or stop()
            self.error = exc

    def start(self, timeout: float = START_TIMEOUT_DEFAULT) -> EmbeddedWorker:
        if self.thread is not None:
            raise ConfigurationError("this embedded worker was already started")
        self.thread = threading.Thread(
            target=self._run, name=f"errands-worker-{self.worker.id}", daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.worker.started_at:
            if not self.thread.is_alive():
                error = self.error
                raise ConfigurationError(
                    f"the embedded errands worker did not start: {error}"
                ) from error
            if time.monotonic() > deadline:
                # Stopped before raising: no one gets this object back to stop it, and
                # the worker would claim jobs (and hold connections) for the rest of the
                # process, in later tests too.
                self.worker.stop()
                self.thread.join(self.worker.grace + 10.0)
                raise ConfigurationError(
                    f"the embedded errands worker did not start within {timeout:g} s (it "
                    "was stopped)"
                )
            time.sleep(0.01)
        return self

    def stop(self, timeout: float | None = None) -> bool:
        """Stop gracefully and wait for the thread (at most ``grace`` + 10 s by default);
        False when it is still running then."""
        thread = self.thread
        if thread is None:
            return True
        self.worker.stop()
        thread.join(self.worker.grace + 10.0 if timeout is None else timeout)
        if thread.is_alive():
            log.warning("the embedded errands worker %s did not stop in time", self.worker.id)
            return False
        return True
