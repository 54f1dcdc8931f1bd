"""Waiting for jobs to end: ``handle.result()``, ``as_completed``, ``wait_all`` and their
async forms, all on one implementation.

A wait goes in rounds (:class:`Rounds`): take the rows the result hub read for it when
it woke it (errands.results), read the jobs it must read itself, hand over those that
ended, then pause until woken or until the pacer says to look again. Two drivers run
those rounds and differ only in how they read and how they wait: :func:`follow` in the
caller's thread, :func:`afollow` in a task, whose reads run in a thread (errands' own:
errands.offloop) and whose pauses are awaited (``Waiter.await_wake``), so the event loop
never blocks. One wait, however many jobs, is one registration with the hub
and one read per round (in chunks of READ_CHUNK): ``await_all`` on 200 jobs is one
waiter, where ``asyncio.gather`` of 200 ``aresult()`` calls was 200 waiters, each
reading in a thread of its own.

The reads go through the wait's :class:`~errands.results.Pacer`, so a timeout holds
while the store cannot be read: a read waits for a connection no longer than the time
left (an async one is awaited no longer than that, whatever holds it up), a read that
fails is made again after the pause, and once the deadline passes the ResultTimeout
says the store could not be read.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterable, Iterator
from contextlib import aclosing, closing
from datetime import timedelta
from typing import TYPE_CHECKING

from . import offloop
from .errors import ConfigurationError
from .results import Pacer, ResultHub, Waiter

if TYPE_CHECKING:
    from .handle import JobHandle
    from .jobs import Job

READ_CHUNK = 1000  # jobs a wait reads in one query
POLL_DEFAULT = 0.05  # the longest pause between reads of a wait that must poll


class Rounds:
    """The state of one wait on jobs of one App, and what each round of it does; the
    drivers only read (``read``) and pause (``pause``, then ``woke``) as they can."""

    def __init__(
        self,
        handles: dict[int, JobHandle],
        timeout: float | timedelta | None,
        poll: float | timedelta,
        what: Callable[[], str] | None = None,
    ) -> None:
        apps = {id(h.app): h.app for h in handles.values()}
        if len(apps) > 1:
            raise ConfigurationError("as_completed and wait_all take handles of one App")
        self.pending = handles
        self.app = next(iter(apps.values()))
        self.hub: ResultHub = self.app.results
        self.pacer = Pacer(self.hub, poll, timeout)  # the timeout runs from here
        self.what = what or (lambda: f"{len(self.pending)} job(s) still not finished")
        self._handed: dict[int, Job] = {}
        self._read_all = True  # the first look reads every job
        self._read_all_at = 0.0

    def take(self, waiter: Waiter) -> Callable[[], dict[int, Job]] | None:
        """Keep the rows the hub read for us when it woke us; the read this round must
        make itself (None: nothing to read): every other pending job, on the first look,
        a poll or a safety recheck, or after a wake that brought no rows. (Reading every
        pending job on each push made a wait on N jobs O(N^2) rows, and one query per job
        per wake before that: 95,000 reads for 1,000 jobs.)"""
        self._handed = {i: waiter.rows.pop(i).to_job() for i in self.pending if i in waiter.rows}
        if not self._read_all:
            return None
        self._read_all_at = time.monotonic()
        unread = [h for i, h in self.pending.items() if i not in self._handed]
        return functools.partial(self.read, unread) if unread else None

    def read(self, handles: list[JobHandle]) -> dict[int, Job]:
        """The jobs of ``handles``, in chunks (blocking: the async driver runs it in a
        thread, which may outlive the round). A job not found is read alone: JobNotFound
        says it was pruned."""
        backend = self.app.backend
        ids = [h.id for h in handles]
        jobs: dict[int, Job] = {}
        for start in range(0, len(ids), READ_CHUNK):
            found = backend.job_get_many(ids[start : start + READ_CHUNK])
            jobs.update((row.id, row.to_job()) for row in found)
        for handle in handles:
            if handle.id not in jobs:
                jobs[handle.id] = handle._read()
        return jobs

    def ended(self, read: dict[int, Job] | None) -> list[tuple[JobHandle, Job]]:
        """The handles (and jobs) whose jobs are over, in the order given, from the rows
        handed over and those ``read`` (None: not read, or the read failed); no longer
        pending."""
        jobs = self._handed | (read or {})
        over: list[tuple[JobHandle, Job]] = []
        for job_id, handle in list(self.pending.items()):
            job = jobs.get(job_id)
            if job is not None and handle._read_finished(job) is not None:
                del self.pending[job_id]
                over.append((handle, job))
        return over

    def pause(self) -> float:
        """How long to wait before the next round; ResultTimeout once the time is up."""
        return self.pacer.next(self.what())

    def woke(self, waiter: Waiter, woken: bool) -> None:
        """After the pause: whether the next round reads every pending job itself."""
        self._read_all = (
            waiter.take_read_all()
            or self.pacer.error is not None  # the last read failed
            or not woken
            or not self.hub.pushing
            # the safety recheck, also while other jobs' ends keep waking it
            or self.pacer.recheck_due(self._read_all_at)
        )


def follow(
    handles: Iterable[JobHandle],
    timeout: float | timedelta | None,
    poll: float | timedelta,
    what: Callable[[], str] | None = None,
) -> Generator[tuple[JobHandle, Job], None, None]:
    """Each handle with its job, as the job ends; waits in this thread."""
    pending = {h.id: h for h in handles}
    if not pending:
        return
    rounds = Rounds(pending, timeout, poll, what)
    rounds.hub.ready(rounds.pacer.ready_wait())
    with rounds.hub.watch(pending) as waiter:
        while pending:
            due = rounds.take(waiter)
            yield from rounds.ended(rounds.pacer.read(due) if due else None)
            if pending:
                rounds.woke(waiter, waiter.wait(rounds.pause()))


def afollow(
    handles: Iterable[JobHandle],
    timeout: float | timedelta | None,
    poll: float | timedelta,
    what: Callable[[], str] | None = None,
) -> AsyncGenerator[tuple[JobHandle, Job], None]:
    """:func:`follow` in a task: reads in a thread, pauses awaited. Cancelling the task
    removes its registration."""
    pending = {h.id: h for h in handles}
    return _afollow(Rounds(pending, timeout, poll, what) if pending else None)


async def _afollow(rounds: Rounds | None) -> AsyncGenerator[tuple[JobHandle, Job], None]:
    if rounds is None:
        return
    pending = rounds.pending
    await rounds.pacer.opened(rounds.app, rounds.what())  # once, off the executor
    # Within the deadline too: the watcher's start waits READY_WAIT at most, but a thread
    # for it could be long in coming (aresult(timeout=1) took 8 s when the event loop's
    # default executor, shared with the application, was busy)
    ready = offloop.run(rounds.hub.ready, rounds.pacer.ready_wait())
    await rounds.pacer.bounded(ready, rounds.what)
    with rounds.hub.watch(pending, asyncio.get_running_loop()) as waiter:
        while pending:
            due = rounds.take(waiter)
            for ended in rounds.ended(await rounds.pacer.aread(due) if due else None):
                yield ended
            if pending:
                rounds.woke(waiter, await waiter.await_wake(rounds.pause()))


class AsCompleted(Iterator["JobHandle"], AsyncIterator["JobHandle"]):
    """What :func:`as_completed` returns: iterate it with ``for`` (the thread waits) or
    ``async for`` (the task waits; the event loop runs meanwhile), as Python 3.13's
    ``asyncio.as_completed`` can be. The wait, and its timeout, start with the first
    handle asked for."""

    def __init__(
        self, handles: Iterable[JobHandle], timeout: float | timedelta | None, poll: float
    ) -> None:
        self._handles = list(handles)
        self._timeout, self._poll = timeout, poll
        self._sync: Generator[tuple[JobHandle, Job], None, None] | None = None
        self._async: AsyncGenerator[tuple[JobHandle, Job], None] | None = None

    def __iter__(self) -> AsCompleted:
        return self

    def __next__(self) -> JobHandle:
        if self._sync is None:
            self._sync = follow(self._handles, self._timeout, self._poll)
        return next(self._sync)[0]

    def __aiter__(self) -> AsCompleted:
        return self

    async def __anext__(self) -> JobHandle:
        if self._async is None:
            self._async = afollow(self._handles, self._timeout, self._poll)
        return (await anext(self._async))[0]

    def close(self) -> None:
        """End the wait now: its registration goes (leaving a ``for`` early does that once
        the iterator is dropped; ``with as_completed(...) as ended:`` at the block's end)."""
        if self._sync is not None:
            self._sync.close()

    async def aclose(self) -> None:
        """End an ``async for``'s wait now: an async generator left early is closed only
        when the event loop collects it, and its registration stayed meanwhile (the hub
        read its jobs' rows on each wake); ``async with as_completed(...) as ended:``
        closes it at the block's end."""
        if self._async is not None:
            await self._async.aclose()

    def __enter__(self) -> AsCompleted:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> AsCompleted:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def as_completed(
    handles: Iterable[JobHandle],
    timeout: float | timedelta | None = None,
    poll: float = POLL_DEFAULT,
) -> AsCompleted:
    """Yield each handle as its job ends (completed, dead, cancelled or discarded), in the
    order they end; ``ResultTimeout`` when ``timeout`` seconds pass first. Call
    ``handle.result()`` on each for its result (or the error saying how it ended). The
    handles must belong to one App; the store wakes the wait (see errands.results).

    ``for handle in as_completed(...)`` waits in the thread; ``async for handle in
    as_completed(...)`` in the task, without blocking the event loop (cancelling the task
    removes the wait's registration).

    .. versionadded:: 0.2
    .. versionchanged:: 0.2 ``async for`` too.
    """
    return AsCompleted(handles, timeout, poll)


def wait_all(
    handles: Iterable[JobHandle],
    timeout: float | timedelta | None = None,
    poll: float = POLL_DEFAULT,
) -> list[JobHandle]:
    """Wait until every job has ended; return the handles in the order given. A dead or
    cancelled job does not raise (``handle.result()`` says how each ended);
    ``ResultTimeout`` when ``timeout`` seconds pass first.

    .. versionadded:: 0.2
    """
    given = list(handles)
    with closing(follow(given, timeout, poll)) as ended:
        for _ in ended:
            pass
    return given


async def await_all(
    handles: Iterable[JobHandle],
    timeout: float | timedelta | None = None,
    poll: float = POLL_DEFAULT,
) -> list[JobHandle]:
    """:func:`wait_all` for async code: the same outcomes and errors, one registration
    for every job and one read per round (in a thread: the event loop never blocks).
    Cancelling the awaiting task removes the registration.

    .. versionadded:: 0.2
    """
    given = list(handles)
    async with aclosing(afollow(given, timeout, poll)) as ended:
        async for _ in ended:
            pass
    return given


def first_end(handle: JobHandle, timeout: float | timedelta | None, poll: float) -> Job:
    """``handle``'s job once it is over (JobHandle.result)."""
    with closing(follow([handle], timeout, poll, handle._still)) as ended:
        return next(ended)[1]


async def afirst_end(
    handle: JobHandle, timeout: float | timedelta | None, poll: float
) -> tuple[Job, Pacer]:
    """:func:`first_end` for a task (JobHandle.aresult), with the wait's pacer: what is
    done with the job next (decoding its result) keeps to the same deadline."""
    rounds = Rounds({handle.id: handle}, timeout, poll, handle._still)
    async with aclosing(_afollow(rounds)) as ended:
        return (await anext(ended))[1], rounds.pacer
