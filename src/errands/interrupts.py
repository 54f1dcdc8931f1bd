"""Regions of errands' own code that an asynchronous interrupt must not land in.

A hook past its ``hook_timeout`` and a sync handler past its timeout are stopped by an
exception raised inside their thread (``PyThreadState_SetAsyncExc``), which lands at
whatever bytecode the thread is running. Landing inside one of errands' own store calls
made from that thread (a hook that enqueues, the hooks' own "done" mark, a handler's
``enqueue``) it could leave a lock taken and a transaction open: on SQLite, the process's
write lock and the file's, for good (seen in a soak: every worker's heartbeats failed for
23 minutes). So the store's transactions run :func:`shielded`, and whoever raises such an
interrupt asks :func:`aim_unless_shielded` first: a thread inside a shield is interrupted
once it leaves it (the caller tries again later).

Your own code can take the same shield (``errands.shielded()``), around a library call
that an exception landing inside would leave broken. psycopg_pool's sync pool is one:
an interrupt that lands while ``getconn()`` waits for a connection leaves the waiter in
the pool's queue, and the connection handed to it later is never given back (a slot of
the pool lost for good per interrupt; after a database outage, whose timeouts and
self-fences interrupt many waiting handlers at once, the pool is empty for good and every
handler waits its timeout for a connection).

An interrupt aimed too late (its target already finished what it was to stop) is dropped
with :func:`drop_pending`, which on CPython 3.11 never clears it with
``PyThreadState_SetAsyncExc(ident, NULL)``: there that leaves the interpreter flagged as
having an asynchronous exception pending when none is, and from then on every thread with
a trace or profile function (coverage, a debugger, a profiler) loops for ever at its next
function call: the whole process hangs (3.12 and later are not affected).
"""

from __future__ import annotations

import ctypes
import dis
import gc
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

DRAIN_LIMIT = 1.0  # seconds drop_pending waits for its own interrupt to land (it takes µs)
# Clearing a pending interrupt with NULL leaves no flag set from CPython 3.12 on.
_NULL_CLEARS = sys.version_info >= (3, 12)


class Interrupt(BaseException):
    """Base of the exceptions errands raises inside a thread to stop what it runs (a hook
    past ``hook_timeout``, a handler past its timeout). errands' own guards around user
    code (an event subscriber's, say) never swallow one: it stops the hook or handler
    that is running, whatever that called."""


# thread ident -> (the thread, one mark per shield it is inside). The thread is kept to
# tell a dead thread's entry from a live one's: idents are reused.
_shields: dict[int, tuple[threading.Thread, list[object]]] = {}
_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """``os.register_at_fork``'s hook, in a forked child, on its only thread (the forking
    one; no I/O, no logging): the lock starts afresh, and the shields are the forking
    thread's alone. The lock is taken by the hook watchdog (a hook past its limit) and by
    every :func:`shielded` (each store transaction, App.backend's opening of the store):
    copied held by a thread of the parent, which does not exist in the child, it hung the
    child's first shielded call for good. The other threads' marks are dropped (their
    threads are not in the child); the forking thread's, if it forked inside a shield,
    are kept: it is still inside it there, and leaves it as in the parent."""
    global _lock, _shields, _frames_lock, _gc_paused
    me = threading.current_thread()
    _lock = threading.Lock()
    _frames_lock = threading.Lock()
    if _gc_paused:  # a thread of the parent paused collection for _current_frame: that
        _gc_paused = False  # thread is not here to resume it
        gc.enable()
    _shields = {
        ident: (thread, list(marks))
        for ident, (thread, marks) in list(_shields.items())
        if thread is me
    }


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextmanager
def shielded() -> Iterator[None]:
    """Run the body with no asynchronous interrupt aimed at this thread.

    A handler's timeout (or self-fence, or the end of a graceful stop's grace) and a
    hook's ``hook_timeout`` stop a sync callable by raising an exception inside its
    thread; inside this block that waits until the block ends (``ctx.cancelled`` still
    turns true at once, and a thread still inside at ``abandon_after`` is abandoned). Use
    it around a library call that an exception landing inside would leave broken, such as
    taking and giving back a connection of psycopg_pool's sync pool::

        with errands.shielded(), pool.connection() as conn:
            conn.execute(...)

    Keep it short: a handler inside it cannot be stopped before its thread is abandoned.
    """
    ident = threading.get_ident()
    mark = object()
    try:  # one call each way: an interrupt pending as the shield begins lands before the
        # mark is taken or inside the try, never between (a count taken before the try,
        # then skipped by an interrupt landing there, left the thread shielded for good:
        # every later interrupt of it, and of a thread given its ident, held back)
        enter_shield(ident, mark)
        yield
    finally:
        leave_shield(ident, mark)


def enter_shield(ident: int, mark: object) -> None:
    """Begin the shield ``mark`` of thread ``ident`` (see shielded: call it inside the
    ``try`` whose ``finally`` calls leave_shield)."""
    with _lock:
        entry = _shields.get(ident)
        if entry is None or not entry[0].is_alive():  # none, or a dead thread's
            entry = _shields[ident] = (threading.current_thread(), [])
        entry[1].append(mark)


def leave_shield(ident: int, mark: object) -> None:
    """End the shield ``mark`` of thread ``ident`` (begun by enter_shield)."""
    with _lock:
        entry = _shields.get(ident)
        if entry is None or mark not in entry[1]:
            return
        entry[1].remove(mark)
        if not entry[1]:
            del _shields[ident]


def _is_shielded(ident: int) -> bool:
    """(Under ``_lock``.) A dead thread's marks do not count: its ident may be another's."""
    entry = _shields.get(ident)
    if entry is None:
        return False
    if not entry[0].is_alive():
        del _shields[ident]
        return False
    return bool(entry[1])


def aim_unless_shielded(ident: int, aim: Callable[[], None]) -> bool:
    """Call ``aim()`` (which raises the interrupt in thread ``ident``) unless that thread
    is inside a shield or in locking library code (:func:`in_locking_code`); False when
    it is (the caller tries again later)."""
    with _lock:
        if _is_shielded(ident) or in_locking_code(ident):
            return False
        aim()
        return True


def is_shielded(ident: int) -> bool:
    """Whether thread ``ident`` is inside a shield now."""
    with _lock:
        return _is_shielded(ident)


# Where an interrupt must not land: the moment a lock is taken in Python code before the
# ``try``/``with`` that gives it back. An interrupt aimed while a thread is blocked taking
# it lands exactly then, as the acquire returns, and the lock is held for good (a logging
# handler's: every thread that logs through it hangs; a Condition's, as Event.set(),
# Queue.get() and Future.result() take it: everyone waiting on it). Tried with an
# Event.set() loop interrupted at random: its lock was left held in a third of the runs.
# Waiting inside Condition.wait is not such a point (a ``finally`` takes the lock back
# and the caller's ``with`` gives it back): a handler polling with Event.wait(0.01) is
# interrupted there.
LOCK_TAKING = {
    "threading": ("__enter__", "acquire", "_acquire_restore"),  # Condition's, RLock's
    "logging": ("acquire", "_acquireLock"),  # Handler.acquire, the module's lock (to 3.12)
}
# From Python 3.13 logging takes its locks (a handler's, the module's) in ``with`` blocks
# of its own functions (Handler.handle, getLogger, ...): the lock, a C one, is taken
# inside the ``with`` instruction itself, and a thread blocked there is seen in the
# function holding the ``with``, at that instruction. An interrupt aimed then no longer
# leaves the lock held (the ``with`` gives it back), but it lands just inside the block,
# in logging's own code: the record is lost half handled (the handlers after it never
# see it), a logger tree being updated is left half done. So a thread blocked entering
# a ``with`` in one of LOCK_TAKING's modules is held back too, as on 3.11 and 3.12: it
# is interrupted once back in its own code. (The instruction is BEFORE_WITH on 3.11 to
# 3.13; where it does not exist, only LOCK_TAKING's names are looked for.)
_ENTERING_WITH = dis.opmap.get("BEFORE_WITH")
# Libraries whose own handling of an exception while they wait is for Exception only:
# psycopg_pool's sync pool loses the connection it hands to a waiter interrupted there.
UNSAFE_LIBRARIES = ("psycopg_pool",)
UNSAFE_DEPTH = 6  # frames from the innermost looked at for UNSAFE_LIBRARIES


# sys._current_frames() can stop a whole process on Python 3.11 (CPython gh-106883,
# fixed in 3.12, not in 3.11): it holds the runtime's lock of thread states while it makes
# frame objects; a garbage collection one of those allocations starts may free an object
# whose deallocation takes that lock again, and the thread waits for itself holding the
# GIL: every thread of the worker stands still for good (a CI run hung so, a hooks
# watchdog aiming an interrupt at a hung backoff). There, collection is paused for the
# call, as 3.12 does it inside; one call at a time, so no call resumes it under another.
_frames_lock = threading.Lock()
_gc_paused = False
_GC_SAFE_FRAMES = sys.version_info >= (3, 12)


def _current_frame(ident: int) -> FrameType | None:
    """Thread ``ident``'s current Python frame (None: no such thread)."""
    global _gc_paused
    if _GC_SAFE_FRAMES:
        return sys._current_frames().get(ident)
    with _frames_lock:
        collecting = gc.isenabled()
        gc.disable()
        _gc_paused = collecting
        try:
            return sys._current_frames().get(ident)
        finally:
            _gc_paused = False
            if collecting:
                gc.enable()


def in_locking_code(ident: int) -> bool:
    """Whether thread ``ident`` is at a point where an interrupt must not land now (see
    LOCK_TAKING and UNSAFE_LIBRARIES), judged by its Python frames. An interrupt is held
    back from it as from a shield: a thread blocked there is read exactly where the
    interrupt would land; one running elsewhere reaches its next check within a few
    bytecodes."""
    frame = _current_frame(ident)
    if frame is None:
        return False
    names = LOCK_TAKING.get(frame.f_globals.get("__name__", ""))
    if names is not None and (frame.f_code.co_name in names or _entering_with(frame)):
        return True
    for _ in range(UNSAFE_DEPTH):
        module = frame.f_globals.get("__name__", "")
        if any(module == name or module.startswith(name + ".") for name in UNSAFE_LIBRARIES):
            return True
        if (frame := frame.f_back) is None:
            return False
    return False


def _entering_with(frame: FrameType) -> bool:
    """Whether ``frame`` is at the instruction that enters a ``with`` block (its
    ``__enter__`` running, or blocked taking a lock)."""
    if _ENTERING_WITH is None:
        return False
    code, at = frame.f_code.co_code, frame.f_lasti  # f_lasti: the offset, in bytes
    return 0 <= at < len(code) and code[at] == _ENTERING_WITH


def aim(ident: int, exc_type: type[BaseException]) -> None:
    """Raise ``exc_type`` asynchronously in thread ``ident``: it lands at the thread's next
    bytecode, or when a C call it is blocked in returns."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc_type))


class _Drained(Interrupt):
    """Put in place of an interrupt still pending for the calling thread; lands at once."""


def drop_pending() -> None:
    """Drop an interrupt aimed at the calling thread that has not landed yet (if any).

    CPython 3.12 and later clear it with ``PyThreadState_SetAsyncExc(ident, NULL)``. On
    3.11 that leaves the interpreter's "pending" flag set (see the module doc), so the
    pending interrupt is replaced by one of this module's own, which lands in the loop
    below at once, and its landing clears the flag. (Not so on 3.12+: there a garbage
    collection the interpreter had scheduled runs first at that same check, and the
    private interrupt landed in whatever finalizer it ran, swallowed, while the loop spun
    its whole limit: a second per hook under heavy collection.) The caller holds whatever
    lock the interrupts are aimed under, so no other is aimed meanwhile."""
    me = threading.get_ident()
    if _NULL_CLEARS:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(me), None)
        return
    try:
        aim(me, _Drained)  # it may land as soon as this call returns
        deadline = time.monotonic() + DRAIN_LIMIT
        while time.monotonic() < deadline:  # each turn checks for pending interrupts
            pass
    except _Drained:
        return
    # Never seen: it landed elsewhere (a finalizer run by this thread that swallowed it),
    # which cleared the flag. Clearing with NULL now would set it again, with nothing
    # pending: the hang of the module doc.
