"""How much of a failure errands keeps: a handler's exception message has no size of its
own, and every error entry keeps its head and says how much was cut (errands.errortext),
on a real worker and store."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import pytest

import errands
from errands.errortext import LOG_LIMIT, MESSAGE_LIMIT, TRACEBACK_LIMIT

HUGE = 2_000_000  # characters of the handler's message


def _cut(message: str) -> int:
    """How many characters the note at the end of a clipped message says were cut."""
    match = re.search(r"… \((\d+) more characters\)$", message)
    assert match, message[-200:]
    return int(match.group(1))


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_huge_exception_message_is_stored_clipped_saying_how_much_was_cut(
    app: errands.App, worker_factory, kind: str
) -> None:
    """Given a handler raising an exception whose message is 2 million characters, on
    each of its 3 attempts, then each error entry keeps the message's head (at most
    MESSAGE_LIMIT characters, ending with how many were cut) and a traceback that still
    names the handler's frame, within TRACEBACK_LIMIT: the job's errors are tens of
    kilobytes, not 6 MB. The message was stored whole, once per attempt."""
    if kind == "sync":

        @app.job(name="size.huge", retries=2, backoff=0.01)
        def huge() -> None:
            raise RuntimeError("E" * HUGE)

    else:

        @app.job(name="size.huge", retries=2, backoff=0.01)
        async def huge() -> None:
            await asyncio.sleep(0)
            raise RuntimeError("E" * HUGE)

    handle = huge.enqueue()
    with worker_factory(), pytest.raises(errands.JobFailed):
        handle.result(timeout=30)
    job = handle.job()
    assert len(job.errors) == 3
    for error in job.errors:
        assert len(error.message) <= MESSAGE_LIMIT
        assert error.message.startswith("EEEE")
        kept = len(error.message) - len(re.sub(r"^E+", "", error.message))
        assert kept + _cut(error.message) == HUGE
        assert error.traceback is not None and len(error.traceback) <= TRACEBACK_LIMIT + 4
        assert "in huge" in error.traceback  # the frame survives the message
        assert "more characters)" in error.traceback
    stored = json.dumps([e.__dict__ for e in job.errors], default=str)
    assert len(stored) < 3 * (MESSAGE_LIMIT + TRACEBACK_LIMIT + 1_000)


def test_a_secret_at_the_cut_of_a_huge_message_is_scrubbed_whole(
    app: errands.App, worker_factory
) -> None:
    """Given a sensitive argument quoted where a huge message is cut, then no part of it
    is kept: the value is scrubbed before the message is clipped (clipping first would
    cut it in two, and its first half no longer matches the value)."""
    secret = "tok-0123456789abcdef"

    @app.job(name="size.secret", sensitive={"token"}, retries=0)
    def leaks(token: str) -> None:
        raise RuntimeError("x" * (MESSAGE_LIMIT - 50) + token + "y" * HUGE)

    handle = leaks.enqueue(token=secret)
    with worker_factory(), pytest.raises(errands.JobFailed):
        handle.result(timeout=30)
    [error] = handle.job().errors
    assert len(error.message) <= MESSAGE_LIMIT
    assert secret[:6] not in error.message
    assert secret[:6] not in (error.traceback or "")
    assert "***" in error.message


def test_the_log_lines_of_a_huge_failure_quote_a_short_clip(
    app: errands.App, worker_factory, caplog: pytest.LogCaptureFixture
) -> None:
    """Given a job failing with a 2-million-character message, retried once then dead,
    then its ``retrying`` and ``dead`` log lines quote at most LOG_LIMIT characters of
    the message, and their tracebacks no line longer than that: each line was 2 MB (5
    MB JSON lines with a 5 MB message)."""
    caplog.set_level(logging.INFO)

    @app.job(name="size.logged", retries=1, backoff=0.01)
    def logged() -> None:
        raise RuntimeError("E" * HUGE)

    handle = logged.enqueue()
    with worker_factory(), pytest.raises(errands.JobFailed):
        handle.result(timeout=30)
    lines = [r for r in caplog.records if getattr(r, "job_name", None) == "size.logged"]
    failures = [r for r in lines if r.levelno >= logging.WARNING]
    assert [getattr(r, "event", "") for r in failures] == [
        "errands.job.retrying",
        "errands.job.dead",
    ]
    for record in failures:
        text = record.getMessage()
        assert len(text) < LOG_LIMIT + 200, len(text)
        assert "more characters)" in text
        assert record.exc_text and "in logged" in record.exc_text
        assert max(len(line) for line in record.exc_text.split("\n")) <= LOG_LIMIT
    assert len(caplog.text) < 20 * LOG_LIMIT + 2 * TRACEBACK_LIMIT
