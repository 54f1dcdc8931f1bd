"""The timeout machine: stopping a handler that runs past its ``timeout``, gentlest first.

For a sync handler on a thread (threads cannot be killed):

1. at the timeout: ``ctx.cancelled`` turns true (a cooperative handler returns);
2. ``INTERRUPT_AFTER`` later: HandlerInterrupt is raised inside its thread;
3. ``abandon_after`` after the timeout: the timeout is recorded and the thread, blocked in
   some C call, is left to finish alone (a fresh thread takes its place).

Until then the attempt keeps its slot and its heartbeated lease, so its retry can never
run beside it; whatever the handler does after its deadline is recorded as a timeout,
never as a completion. An async handler's task is cancelled at its timeout (its
``asyncio.timeout``, and ``ctx.cancelled`` turns true); one that catches the cancel and
goes on is abandoned ``abandon_after`` later, as a thread is (its timeout recorded, its
slot freed, its task cancelled once more). A child process is killed. The same steps
stop sync handlers still running when a graceful stop's grace period is over
(:func:`interrupt_threads`); one already past its timeout then has its timeout recorded,
never a release. Either way a handler inside a durable step is decided only once the step
is over, ``abandon_after`` later at most (``Worker._give_back_after_steps``).

Self-fencing (:func:`on_fence`) stops a handler whose lease cannot be renewed with the same
steps, timed to end before the lease does: ``ctx.cancelled`` at the fence (the lease
keeper fences an attempt shortly before its lease runs out), HandlerInterrupt soon after,
and the job given back (released, uncharged) with the thread abandoned when a third of
the time left at the fence remains.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from .. import clock
from ..observability.logcontext import job_extra
from .execution import LEASE_UNRENEWED, Attempt, FenceSteps, JobTimeout
from .runners import Call

if TYPE_CHECKING:
    from .worker import Worker

log = logging.getLogger("errands.worker")

INTERRUPT_AFTER = 1.0


def on_deadline(worker: Worker, attempt: Attempt) -> None:
    """The lease keeper calls this when ``attempt.deadline`` has passed."""
    timeout = attempt.row.timeout or 0
    now = clock.now()
    first = not attempt.timed_out
    # Not once its handler ended after a graceful stop took the attempt over (the stop
    # gives its job back): that handler stopped when asked, before its time was up.
    if not attempt.time_out(now):
        return
    if attempt.definition is None or attempt.kill:
        attempt.deadline = None
        # Timed out, whatever ends it next: a child's answer racing its kill was recorded
        # as Interrupted ("lease_lost"), inflating the lease losses that excuse duplicate
        # runs.
        attempt.interrupt("timeout", worker.loop)  # the child is killed
        return
    is_async = attempt.definition.is_async
    if first:
        attempt.interrupt("timeout", worker.loop)  # ctx.cancelled; an async task cancelled
        log.warning(
            "job %s ran past its %g s timeout; asking its handler to stop",
            attempt.id,
            timeout,
            extra=job_extra(attempt.row),
        )
        if is_async:  # (its asyncio.timeout cancels it too): abandoned if it goes on
            attempt.deadline = now + worker.abandon_after
            return
        attempt.deadline = now + min(INTERRUPT_AFTER, worker.abandon_after)
        return
    if not is_async and now < attempt.timeout_at + worker.abandon_after:
        attempt.deadline = attempt.timeout_at + worker.abandon_after
        if attempt.interrupted:  # a graceful stop interrupted it first: once is enough
            return
        attempt.interrupted = True
        call = attempt.future  # (read once: see Attempt.unlink)
        if isinstance(call, Call):
            worker.threads_for(attempt).interrupt(call)
        log.warning(
            "job %s is still running past its timeout; interrupting it",
            attempt.id,
            extra=job_extra(attempt.row),
        )
        return
    attempt.deadline = None
    if is_async:
        why = (
            f"the handler went on {worker.abandon_after:g} s after its task was cancelled "
            "(it caught CancelledError) and was abandoned"
        )
    else:
        why = f"the handler ignored the interrupt for {worker.abandon_after:g} s and was abandoned"
    if abandon(worker, attempt, why):
        log.error(
            "job %s: handler did not stop %g s after its timeout; %s abandoned",
            attempt.id,
            worker.abandon_after,
            "task" if is_async else "thread",
            extra=job_extra(attempt.row),
        )


def abandon(worker: Worker, attempt: Attempt, why: str) -> bool:
    """Record the timeout of ``attempt``, whose handler still runs (``why``: how it came
    to be left running), and let the handler go: a thread is abandoned (a fresh one takes
    its place), a task cancelled once more (it may stop at its next ``await``). Its slot
    is free from now on; whatever the handler does later is ignored. False when another
    outcome was decided first."""
    error = JobTimeout(
        f"timed out after {attempt.row.timeout or 0:g} s; {why} (it may still be running)"
    )
    call = attempt.future  # (read before the outcome: see Attempt.unlink)
    # (over a graceful stop's claim too: the stop would record this timeout itself)
    if not worker.recorder.decided(attempt, error, None, handler_running=True, over_stop=True):
        return False
    if isinstance(call, Call):
        worker.threads_for(attempt).abandon(call)
    else:
        attempt.interrupt("timeout", worker.loop)
    worker.dispatcher.give_slot(attempt)  # its slot, if it holds one, to the next job
    return True


def on_fence(worker: Worker, attempt: Attempt) -> None:
    """Self-fencing, one step at a time: the lease keeper calls this when no heartbeat could
    renew ``attempt``'s lease and it is about to run out, then at the time of each step in
    ``attempt.fence``.

    1. at once: ``ctx.cancelled`` turns true (``lease could not be renewed``), an async
       task is cancelled, a child process killed; a prefetched job not yet begun is
       given back at once;
    2. a third of the time left later (1 s at most): HandlerInterrupt is raised inside a
       sync handler's thread;
    3. a third of the time left before the lease runs out (``abandon_after`` after the
       fence, if sooner): the job is given back (released, uncharged, fenced by its
       token) and the thread, still running, is abandoned (logged).

    A handler that stops before step 3 gives its job back itself (see the recorder). Only
    setting ``ctx.cancelled`` left a handler without a Context, or one that never looks,
    running after its lease was gone, beside the worker that took the job over."""
    now = clock.now()
    steps = attempt.fence
    if steps is None:
        attempt.fence = steps = FenceSteps()
        attempt.interrupt(LEASE_UNRENEWED, worker.loop)
        if attempt.withdraw():  # prefetched, never begun: back to the queue now
            worker.slot_freed(attempt)
            worker.release_in_background(
                [attempt],
                "released %d prefetched job(s) whose lease could not be renewed",
                prefetched=True,
            )
            return
        if isinstance(attempt.future, Call):  # a thread: escalate, as a timeout does
            left = max(attempt.lease_valid_until - now, 0.0)
            steps.interrupt_at = now + min(INTERRUPT_AFTER, left / 3)
            steps.abandon_at = min(now + worker.abandon_after, attempt.lease_valid_until - left / 3)
        return
    call = attempt.future
    if steps.interrupt_at is not None and now >= steps.interrupt_at:
        steps.interrupt_at = None
        if isinstance(call, Call) and worker.threads_for(attempt).interrupt(call):
            log.warning(
                "job %s: its handler still runs while its lease cannot be renewed; interrupting it",
                attempt.id,
                extra=job_extra(attempt.row),
            )
        return
    if steps.abandon_at is not None and now >= steps.abandon_at:
        steps.abandon_at = None
        if worker.recorder.give_back_fenced(attempt, handler_running=True) and isinstance(
            call, Call
        ):
            worker.threads_for(attempt).abandon(call)
            worker.dispatcher.give_slot(attempt)  # its slot (both kinds' worker) goes on
            log.error(
                "job %s: its handler did not stop before its lease (which could not be "
                "renewed) runs out; job given back, thread abandoned (it may still be running)",
                attempt.id,
                extra=job_extra(attempt.row),
            )


def interrupt_threads(worker: Worker, attempts: list[Attempt], wait: float) -> None:
    """Stop sync handlers whose jobs are being released (shutdown): ``ctx.cancelled`` is
    already set; wait up to ``wait`` seconds for them to return, then raise
    HandlerInterrupt in the threads of those still running, as a timeout does. Once per
    attempt: one its timeout interrupted already (a step held past the grace period) is
    not interrupted again (a second interrupt, retried until it lands, could hit the
    handler's cleanup after the first)."""
    deadline = time.monotonic() + wait
    calls = [
        (a, call, worker.threads_for(a))
        for a in attempts
        if isinstance(call := a.future, Call) and not a.interrupted
    ]
    while time.monotonic() < deadline and any(not c.done() for _, c, _ in calls):
        time.sleep(0.01)
    for attempt, call, threads in calls:
        if call.done() or attempt.interrupted:
            continue
        attempt.interrupted = True  # (the timeout's steps then interrupt it no more)
        if threads.interrupt(call):
            log.warning(
                "job %s: its handler still ran at the end of the grace period; interrupting it",
                attempt.id,
                extra=job_extra(attempt.row),
            )
