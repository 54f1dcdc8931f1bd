"""The default worker's log output (issue 17): one line per finished job, written off the
worker's threads by ``BackgroundHandler``, every line kept until a graceful stop, and a
failed attempt's lines at WARNING / ERROR with its (scrubbed) traceback."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

import errands
from errands.observability.events import Event
from errands.observability.lifecycle_log import log_event, worker_log
from errands.observability.logcontext import (
    BackgroundHandler,
    JsonFormatter,
    TextFormatter,
    direct_writer,
    install_record_factory,
)
from tests.integration.helpers import wait_until

SRC = str(Path(errands.__file__).resolve().parents[1])


def _handler(stream: Any, **options: Any) -> tuple[BackgroundHandler, logging.Logger]:
    handler = BackgroundHandler(stream, **options)
    handler.setFormatter(TextFormatter())
    logger = logging.getLogger(f"test.writer.{id(handler)}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    return handler, logger


def test_the_background_writer_writes_every_line_of_every_thread_in_order_by_close() -> None:
    stream = io.StringIO()
    handler, logger = _handler(stream)

    def burst(name: str) -> None:
        for i in range(2000):
            logger.info("%s line %d", name, i)

    threads = [threading.Thread(target=burst, args=(f"t{n}",)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    handler.close()  # what logging.shutdown() does at exit, after flush()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 8000
    for n in range(4):
        mine = [int(line.rsplit(" ", 1)[1]) for line in lines if f" t{n} line " in line]
        assert mine == list(range(2000))
    logger.removeHandler(handler)


def test_a_line_keeps_the_message_of_the_moment_it_was_logged() -> None:
    """The writer formats later: the text is made when the line is logged (a mutable
    argument changed afterwards does not change the line), the traceback too."""
    stream = io.StringIO()
    handler, logger = _handler(stream)
    cart = ["apple"]
    logger.info("cart %s", cart)
    cart.append("pear")
    try:
        raise KeyError("sku-1")
    except KeyError:
        logger.exception("lookup failed")
    handler.flush()
    text = stream.getvalue()
    assert "cart ['apple']\n" in text
    assert "lookup failed\nTraceback (most recent call last):" in text
    assert "KeyError: 'sku-1'" in text
    handler.close()
    logger.removeHandler(handler)


def test_a_writer_that_falls_behind_makes_the_logging_thread_wait_never_drop() -> None:
    """With the stream blocked, at most ``capacity`` lines wait: the thread logging the
    next one writes the backlog itself (and so waits, as on a plain stream)."""
    gate = threading.Event()

    entered = threading.Event()

    class SlowStream(io.StringIO):
        def write(self, text: str) -> int:
            entered.set()
            gate.wait(10)
            return super().write(text)

    stream = SlowStream()
    handler, logger = _handler(stream, capacity=10)

    def log_many() -> None:
        for i in range(100):
            logger.info("line %d", i)

    thread = threading.Thread(target=log_many)
    thread.start()
    assert entered.wait(10)
    thread.join(timeout=0.5)  # it cannot finish while the stream blocks: 100 > 10 lines
    assert thread.is_alive() and len(handler._records) <= 10
    gate.set()
    thread.join(timeout=10)
    handler.close()
    assert [line.rsplit(" ", 1)[1] for line in stream.getvalue().splitlines()] == [
        str(i) for i in range(100)
    ]
    logger.removeHandler(handler)


SCRIPT = textwrap.dedent(
    """
    import logging, os, sys
    from errands.observability.logcontext import configure_logging

    configure_logging("text", "info")
    log = logging.getLogger("shop")
    log.info("before the fork")
    pid = os.fork()
    if pid == 0:
        log.info("in the child")
        logging.shutdown()
        os._exit(0)
    os.waitpid(pid, 0)
    for i in range(3000):
        log.info("line %d", i)
    # no flush: the interpreter's exit (logging.shutdown at exit) writes what is queued
    """
)


def test_lines_queued_at_exit_are_written_and_a_forked_child_logs_too(tmp_path: Path) -> None:
    script = tmp_path / "logs_at_exit.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": SRC}
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert sum("before the fork" in line for line in lines) == 1
    assert sum("in the child" in line for line in lines) == 1
    assert [line.rsplit(" ", 1)[1] for line in lines if " line " in line] == [
        str(i) for i in range(3000)
    ]


APP_MODULE = textwrap.dedent(
    """
    import errands

    app = errands.App()


    @app.job(name="quick.add")
    def add(n: int) -> int:
        return n + 1
    """
)


def test_a_gracefully_stopped_worker_has_written_the_line_of_every_job_it_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real ``errands worker`` at its defaults: one INFO line per finished job, none
    for its start, every one of them on stderr after SIGTERM."""
    (tmp_path / "quick_app.py").write_text(APP_MODULE)
    url = f"sqlite:///{tmp_path}/quick.db"
    monkeypatch.setenv("ERRANDS_URL", url)
    sys.path.insert(0, str(tmp_path))
    try:
        import quick_app

        handles = quick_app.app.enqueue_many([quick_app.add.bind(n=i) for i in range(300)])
        stderr = (tmp_path / "worker.err").open("w+")
        env = {**os.environ, "ERRANDS_URL": url, "PYTHONPATH": f"{tmp_path}{os.pathsep}{SRC}"}
        worker = subprocess.Popen(
            [sys.executable, "-m", "errands", "worker", "quick_app:app", "--poll-interval", "0.05"],
            cwd=tmp_path, env=env, stderr=stderr, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            wait_until(
                lambda: all(h.job().state.value == "completed" for h in handles),
                timeout=30,
                what="the worker to run the jobs",
            )
        finally:
            worker.send_signal(signal.SIGTERM)
            assert worker.wait(timeout=30) == 0
        stderr.seek(0)
        lines = stderr.read().splitlines()
        stderr.close()
    finally:
        quick_app.app.close()
        sys.path.remove(str(tmp_path))
        sys.modules.pop("quick_app", None)
    finished = [line for line in lines if "] completed in " in line]
    assert sorted(int(line.split("[job ", 1)[1].split()[0]) for line in finished) == sorted(
        h.id for h in handles
    )
    assert all(" INFO " in line and "quick.add@default #1]" in line for line in finished)
    assert not [line for line in lines if "] started " in line]  # DEBUG, not shown at INFO


def test_a_failed_attempt_logs_its_traceback_at_warning_and_the_dead_one_at_error(
    app: errands.App, worker_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)

    @app.job(name="log.fragile", retries=1, backoff=0.01)
    def fragile(order: int) -> None:
        raise ConnectionError(f"payment gateway down for order {order}")

    handle = fragile.enqueue(order=7)
    with worker_factory(), pytest.raises(errands.JobFailed):
        handle.result(timeout=10)

    mine = [r for r in caplog.records if getattr(r, "job_id", None) == handle.id]
    retrying = [r for r in mine if getattr(r, "event", "") == "errands.job.retrying"]
    dead = [r for r in mine if getattr(r, "event", "") == "errands.job.dead"]
    assert [r.levelno for r in retrying] == [logging.WARNING]
    assert [r.levelno for r in dead] == [logging.ERROR]
    for record, attempt in ((retrying[0], 1), (dead[0], 2)):
        assert (record.job_name, record.attempt) == ("log.fragile", attempt)  # type: ignore[attr-defined]
        assert "ConnectionError: payment gateway down for order 7" in record.getMessage()
        text = TextFormatter().format(record)
        assert "\nTraceback (most recent call last):" in text
        assert "in fragile" in text and text.rstrip().endswith(
            "ConnectionError: payment gateway down for order 7"
        )


@pytest.mark.parametrize("formatter", [TextFormatter, JsonFormatter])
def test_a_lifecycle_line_reads_the_same_whether_the_writer_gets_a_record_or_its_fields(
    formatter: type[logging.Formatter],
) -> None:
    """With the background writer alone on the root logger (a worker's setup), errands'
    own lines hand it their fields instead of a LogRecord; any other handler or filter
    gets records again. Both ways write the same line."""
    stream = io.StringIO()
    handler = BackgroundHandler(stream)
    handler.setFormatter(formatter())
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    install_record_factory()
    job = {"job_id": 41, "job_name": "shop.charge", "queue": "payments", "max_attempts": 3}
    events = [
        Event("errands.job.completed", {**job, "attempt": 1, "duration": 0.0123}),
        Event(
            "errands.job.retrying",
            {
                **job,
                "attempt": 2,
                "duration": 0.5,
                "delay": 2.25,
                "error_type": "ValueError",
                "error_message": "bad card ***",
                "traceback": "Traceback (most recent call "
                'last):\n  File "shop.py", line 3, in charge\nValueError: bad card ***\n',
            },
        ),
    ]

    def written() -> list[str]:
        for event in events:
            log_event(event)
        handler.flush()
        text = stream.getvalue()
        stream.seek(0)
        stream.truncate()
        if formatter is JsonFormatter:
            return [json.dumps({**json.loads(line), "ts": "-"}) for line in text.splitlines()]
        return [line[24:] if line[:4].isdigit() else line for line in text.splitlines()]

    try:
        root.handlers[:] = [handler]
        root.setLevel(logging.INFO)
        assert direct_writer(worker_log, logging.INFO) is handler
        direct = written()
        handler.addFilter(lambda record: True)
        assert direct_writer(worker_log, logging.INFO) is None
        through_records = written()
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
        handler.close()
    assert direct == through_records
    assert len(direct) == (2 if formatter is JsonFormatter else 5)  # with the traceback lines
    if formatter is JsonFormatter:
        completed, retrying = (json.loads(line) for line in direct)
        assert (completed["message"], completed["job_id"]) == ("completed in 0.012 s", 41)
        assert retrying["level"] == "warning" and retrying["attempt"] == 2
        assert retrying["exception"].endswith("ValueError: bad card ***")
    else:
        assert (
            "INFO    errands.worker [job 41 shop.charge@payments #1] completed in 0.012 s"
            in (direct[0])
        )
        assert direct[1].startswith("WARNING errands.worker [job 41 shop.charge@payments #2]")
        assert direct[-1] == "ValueError: bad card ***"


def test_any_other_handler_on_the_way_gets_real_records() -> None:
    handler = BackgroundHandler(io.StringIO())
    handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    saved = root.handlers[:]
    try:
        root.handlers[:] = [handler]
        assert direct_writer(worker_log, logging.INFO) is handler
        extra = logging.StreamHandler(io.StringIO())
        worker_log.addHandler(extra)
        try:
            assert direct_writer(worker_log, logging.INFO) is None
        finally:
            worker_log.removeHandler(extra)
        root.handlers[:] = [handler, logging.StreamHandler(io.StringIO())]
        assert direct_writer(worker_log, logging.INFO) is None
        root.handlers[:] = [handler]
        handler.setLevel(logging.ERROR)
        assert direct_writer(worker_log, logging.INFO) is None
    finally:
        root.handlers[:] = saved
        handler.close()
